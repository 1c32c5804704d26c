"""The q8 product (issue 42): an int8 weight in groups (GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K,
MXFP4; ``Quantized`` int8 with ``group`` columns a scale) times rows rounded to 16-bit
integers per group, multiplied in integers, in one stated order, so that a compiled kernel and
plain torch give the same bytes.

For a row ``x``, per group ``g`` of ``B`` columns (every float operation one correctly rounded
float32 operation, never fused):

- ``amax`` the largest ``|x|`` of the group (NaN if any is NaN), ``d = amax / 32767``,
  ``q = round_half_even(clamp(x * i, -32767, 32767))`` with ``i = 1 / d`` (0 where ``d == 0``)
  and a NaN product taken as 0: int16, and ``u = d * float(sum(q))`` (exact: below 2^24);
- per output ``n`` (codes ``c``, scale ``s``, offset ``o``): ``m = sum(q * c)`` over the group,
  an exact integer (``B`` at most 256, so ``|m| < 2^31``), and ``float(m)`` rounded to
  nearest, ties to even;
- ``t = (s * d) * float(m)``; with offsets ``t = (s * d) * float(m) + o * u``;
- the output: ``t`` summed over the groups left to right (from group 0's; the kernel starts
  from -0.0, which adds nothing).

Why 16 bits: the rounding of a row to 16 bits is 256 times finer than llama.cpp's to 8 (its
Q8_0 and Q8_K activations) and finer than the bf16 rows of torch's int4 kernel, so the
stored products stay as close to the float weight's as before (``tests/test_quant.py``'s
1 %; a tiny Qwen3's stored logits moved 0.17 % with 16-bit rows, 1.1 % with 8-bit ones),
at twice an 8-bit product's integer work: a row value is two bytes, ``q = 256 h + l``, and
one AVX-512 VNNI instruction multiplies 4 columns of 16 outputs by 4 broadcast bytes.

Each output comes from its own row and weight row, and the integer sums are exact in any
order, so every node, instruction set and thread count and the torch reference give the same
bytes: a verify chunk equals its decode steps, a batched row its lone run, and an audit
replays it. It replaced, in session 36, a float32 product of the same weights (session 35's,
the rows kept in float32, 16 lanes of float sums): Gemma 3 270M's 262144 x 640 head, 9 rows,
one thread, 53 ms there (docs/benchmarks.md has this one's).

The codes are packed once, at load (``Int8Group``): blocks of 16 outputs (the last may be
narrower), each ``[K / 4][width][4]`` bytes of ``code + 128``, and the scales and offsets
``[G][width]`` a block: the stored sizes. A tied head on the embedding's stage lends its packed
table to the embedding (``Int8Group.dequantize`` reads rows back), so the table is held once.
``q8_mm`` runs the compiled kernel of ``native_q8.cpp`` (AVX-512 with VNNI, AVX2 or plain C++,
chosen at run time, the same bytes) and falls back to ``reference``, the same operations in torch:
the same bytes, many times slower (a warning says so once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Final

import torch
from torch import Tensor

from shard.model.native_build import build

__all__ = [
    "MAX_GROUP",
    "WIDTH",
    "Int8Group",
    "huge_pages",
    "q8_fits",
    "q8_mm",
    "quantize_rows",
    "reference",
]

log = logging.getLogger(__name__)

#: Outputs a packed block.
WIDTH: Final = 16
#: The widest group it takes (``|m| < 2^31``: module docstring).
MAX_GROUP: Final = 256
#: A row value's largest magnitude (16-bit integers).
LEVELS: Final = 32767
#: Outputs the reference multiplies at a time.
REFERENCE_ROWS: Final = 4096
#: A huge page (x86-64 and arm64 Linux with 4 KiB base pages): ``huge_pages``.
HUGE_PAGE: Final = 2 << 20
#: ``madvise``'s advice for transparent huge pages (Linux's ``MADV_HUGEPAGE``).
MADV_HUGEPAGE: Final = 14


def q8_fits(k: int, group: int) -> bool:
    """Whether an int8 weight of ``k`` columns in groups of ``group`` runs as ``int8-group``."""
    return k > 0 and 0 < group <= MAX_GROUP and group % 16 == 0 and k % group == 0


def quantize_rows(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Rows ``[R, K]`` rounded to 16-bit integers per group (module docstring): the values
    ``[R, K]`` int16 and the scales ``d`` ``[R, K // group]`` float32."""
    r, k = x.shape
    xs = x.float().reshape(r, k // group, group)
    d = xs.abs().amax(-1) / LEVELS
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    y = xs * inv[:, :, None]
    y = torch.where(y.isnan(), torch.zeros_like(y), y).clamp(-LEVELS, LEVELS).round()
    return y.to(torch.int16).reshape(r, k), d


def reference(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int) -> Tensor:
    """``[R, K] x [N, K] -> [R, N]`` in the stated order (module docstring), in torch; codes int8
    ``[N, K]``, scales and offsets ``[N, K // group]`` as stored (not packed)."""
    r, k = x.shape
    n, groups = codes.shape[0], k // group
    q, d = quantize_rows(x, group)
    qs = q.double().reshape(r, groups, group)
    u = d * qs.sum(-1).float()  # [R, G]: the sums of q are exact integers below 2^24
    out = torch.empty(r, n, dtype=torch.float32)
    for i in range(0, n, REFERENCE_ROWS):
        c = codes[i : i + REFERENCE_ROWS].double().reshape(-1, groups, group)
        m = torch.einsum("rgb,ngb->rng", qs, c).float()  # exact in float64, then rounded
        t = (scale[None, i : i + REFERENCE_ROWS, :] * d[:, None, :]) * m  # [R, n, G]
        if offset is not None:
            t = t + offset[None, i : i + REFERENCE_ROWS, :] * u[:, None, :]
        acc = t[..., 0]
        for g in range(1, groups):
            acc = acc + t[..., g]
        out[:, i : i + REFERENCE_ROWS] = acc
    return out


@functools.cache
def _fallback_warning(why: str) -> None:
    log.warning("int8 products run in plain torch, the same bytes many times slower: %s", why)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    advise: Callable[[int, int, int], int] = fn
    return advise


def huge_pages(t: Tensor) -> bool:
    """Ask Linux to back ``t``'s whole 2 MiB pages with huge pages (``madvise``), before its
    memory is first written: a weight read end to end on every decode step then misses the
    TLB far less (Gemma 3's head, one row, one thread: ~8 ms instead of ~11 on the EPYC of
    session 36, where transparent huge pages are given only where asked, ``madvise`` mode).
    No effect on any value; False where it could not ask (another OS, a tensor under a huge
    page, the kernel refusing)."""
    fn = _madvise()
    start = t.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    if fn is None or t.device.type != "cpu" or last <= first:
        return False
    return int(fn(first, last - first, MADV_HUGEPAGE)) == 0


def _pack(out: Tensor, values: Tensor, inner: int) -> None:
    """``values`` ``[N, C * inner]`` into ``out`` (``N * C * inner`` elements) in blocks of
    ``WIDTH`` rows, each ``[C][width][inner]``, a block at a time (no whole-table temporary)."""
    n, cols = values.shape
    flat = out.view(-1)
    for b in range(0, n, WIDTH):
        width = min(WIDTH, n - b)
        tiles = values[b : b + width].reshape(width, cols // inner, inner).transpose(0, 1)
        flat[b * cols : (b + width) * cols].view(cols // inner, width, inner).copy_(tiles)


def _unpack(packed: Tensor, n: int, cols: int, inner: int, rows: Tensor | None) -> Tensor:
    """The rows ``rows`` (all when None) ``[R, cols]`` of a table ``_pack`` laid out."""
    ids = torch.arange(n) if rows is None else rows.reshape(-1).long()
    flat = packed.view(-1)
    full = n - n % WIDTH
    out = flat.new_empty(ids.numel(), cols)
    body = flat[: full * cols].view(full // WIDTH, cols // inner, WIDTH, inner)
    inside = ids < full
    if bool(inside.any()):
        b = ids[inside]
        out[inside] = body[b // WIDTH, :, b % WIDTH, :].reshape(-1, cols)
    if not bool(inside.all()):
        tail = flat[full * cols :].view(cols // inner, n - full, inner)
        out[~inside] = tail[:, ids[~inside] - full, :].transpose(0, 1).reshape(-1, cols)
    return out


class Int8Group:
    """An int8 weight in groups packed for ``q8_mm`` (module docstring) from codes ``[N, K]``
    int8, scales and offsets (or None) ``[N, K // group]``: ``packed`` uint8 ``[N, K]`` and
    ``scale``/``offset`` float32 ``[N, K // group]`` hold the stored sizes in the kernel's
    blocks (their rows are not the weight's: ``codes``, ``scales``, ``offsets`` read those)."""

    def __init__(self, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int) -> None:
        n, k = codes.shape
        if n == 0 or not q8_fits(k, group) or tuple(scale.shape) != (n, k // group):
            raise ValueError(f"an int8 weight of {n} x {k} in groups of {group} does not fit")
        self.shape = (int(n), int(k))
        self.group = group
        self.packed = torch.empty(n, k, dtype=torch.uint8)
        huge_pages(self.packed)  # before the first write: no value depends on it
        _pack(self.packed, codes.view(torch.uint8) ^ 128, 4)  # code + 128
        self.scale = torch.empty(n, k // group, dtype=torch.float32)
        huge_pages(self.scale)
        _pack(self.scale, scale.float(), 1)
        self.offset = None
        if offset is not None:
            self.offset = torch.empty(n, k // group, dtype=torch.float32)
            _pack(self.offset, offset.float(), 1)

    @classmethod
    def stacked(cls, parts: Sequence[Int8Group]) -> Int8Group:
        """``parts`` (same group and input width; all with offsets or none) stacked by row."""
        offsets = [p.offsets() for p in parts]
        return cls(
            torch.cat([p.codes() for p in parts]),
            torch.cat([p.scales() for p in parts]),
            None if offsets[0] is None else torch.cat([o for o in offsets if o is not None]),
            parts[0].group,
        )

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def codes(self, rows: Tensor | None = None) -> Tensor:
        """The stored codes ``[R, K]`` int8 of ``rows`` (all when None), read back."""
        n, k = self.shape
        return (_unpack(self.packed, n, k, 4, rows) ^ 128).view(torch.int8)

    def scales(self, rows: Tensor | None = None) -> Tensor:
        """The scales ``[R, K // group]`` float32 of ``rows`` (all when None)."""
        return _unpack(self.scale, self.shape[0], self.shape[1] // self.group, 1, rows)

    def offsets(self, rows: Tensor | None = None) -> Tensor | None:
        """The offsets ``[R, K // group]`` float32 of ``rows`` (all when None), or None."""
        if self.offset is None:
            return None
        return _unpack(self.offset, self.shape[0], self.shape[1] // self.group, 1, rows)

    def dequantize(self, rows: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Quantized.dequantize`` of the stored weight (the same operations, the same bytes),
        for an embedding that shares this table."""
        codes = self.codes(rows)
        r, k = codes.shape
        w = codes.to(torch.float32).view(r, k // self.group, self.group)
        w.mul_(self.scales(rows)[:, :, None])
        offset = self.offsets(rows)
        if offset is not None:
            w.add_(offset[:, :, None])
        out: Tensor = w.view(r, k).to(dtype)
        return out

    def tensors(self) -> list[Tensor]:
        """The packed codes, scales and offsets (when there are offsets)."""
        return [self.packed, self.scale] + ([] if self.offset is None else [self.offset])

    def nbytes(self) -> int:
        return int(sum(t.nbytes for t in self.tensors()))

    def mm(self, x: Tensor) -> Tensor:
        return q8_mm(x, self)


def q8_mm(x: Tensor, weight: Int8Group, isa: int = -1) -> Tensor:
    """Rows ``x`` ``[R, K]`` times ``weight``: ``[R, N]`` float32, by the compiled kernel where it
    built, else ``reference``. ``isa``: the kernel's version (0 plain C++, 1 AVX2, 2 AVX-512
    with VNNI; -1 the widest the CPU runs): the same bytes, for tests."""
    ext = build()
    rows = x.float().contiguous()
    if isinstance(ext, str):
        _fallback_warning(ext)
        codes, scale, offset = weight.codes(), weight.scales(), weight.offsets()
        return reference(rows, codes, scale, offset, weight.group)
    none = weight.scale.new_empty(0)
    offset = none if weight.offset is None else weight.offset
    out: Tensor = ext.q8_mm(rows, weight.packed, weight.scale, offset, weight.group, isa)
    return out
