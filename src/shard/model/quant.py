"""Weights that stay quantized: group-wise int4/int8 codes with their scales, and the
linear and embedding modules that run on them.

``Quantized`` is the host-independent form (what a cache stores and a GGUF maps onto):
``w[n, k] = scale[n, g] * code[n, k] + offset[n, g]`` with ``g = k // group``; int4 codes are
``0..15`` packed two to a byte (even column in the low nibble), int8 codes are signed bytes
and may have no offset. A per-channel int8 weight is int8 with ``group == in_features``.

``QuantLinear`` packs a ``Quantized`` at load into the layout of the kernel that runs it:

- int4, groups of 32/64/128/256: ``_weight_int4pack_mm_for_cpu`` (CUDA: ``_weight_int4pack_mm``,
  written but untested: no GPU build of torch here). The kernel computes
  ``(code - 8) * scale + zero``, so ``zero = offset + 8 * scale``.
- int8 per channel without offset: ``_weight_int8pack_mm``.
- int8 group-wise (GGUF Q8_0, Q5_*, Q6_K, MXFP4; groups a multiple of 16 up to 256) on a
  CPU: ``int8-group``, the codes packed once for ``shard.model.q8``, which rounds the rows
  to 16-bit integers per group and multiplies in integers (one stated order, compiled, with
  a torch reference that gives the same bytes). A tied head lends its packed table to the
  embedding. Gemma 3 270M's 262144 x 640 head at one thread on the EPYC of session 36: 9
  rows in 20 ms (53 ms as session 35's float32 q8 product).
- int8 group-wise on CUDA (no stock kernel takes it): ``int8-split``, the codes split
  ``code = 16 * hi + lo`` into two int4 weights run by the int4 kernel, ``hi`` with scale
  ``16 * scale`` and ``lo`` with the offset: two int4 products, exact as a representation,
  1 byte a parameter (written but untested: no GPU build of torch here).
- anything else (int4 in groups of 16, an int4 row count not a multiple of 16; on CUDA also
  int8 in groups of 16, GGUF's Q6_K): dequantized per call, or held dequantized
  (``shard.model.held``, up to 16 MiB a layer).

Torch's int4 and int8-per-channel kernels take their scales in the activations' dtype and
are fast only in bf16, also on a CPU without bf16 instructions (their float32 variants ran
11-33x slower there: see ``kernel_dtype``), so those paths run in bf16 on every device; the
input is cast to bf16 and the output back to the input's (the q8 product takes float32 rows
and rounds them to 16-bit integers per group itself). A weight dequantized per call is
multiplied in ``dense_dtype``: bf16 where the CPU multiplies bf16 natively
(``cpu_has_bf16``) and on CUDA, float32 otherwise. Scales and activations
rounded to bf16 (or the q8 product's rows to 16-bit integers) are where a stored weight stops
being exact: ``tests/test_quant.py`` states the tolerance (load ``weights = "float32"`` for
float32 products).

Row invariance: every kernel path gave each row the same bits whether it ran alone or among
9 rows (``test_quant_linear_rows_are_batch_invariant``), which is what lets a batched stage
and a spot check replay a session's product bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.device import cpu_has_bf16
from shard.model.linear import padded_linear
from shard.model.q8 import Int8Group, q8_fits

__all__ = [
    "KERNEL_GROUPS",
    "QuantEmbedding",
    "QuantLinear",
    "Quantized",
    "dense_dtype",
    "kernel_dtype",
    "q8_fits",
    "quantize_int4",
    "quantize_int8",
    "split_int8",
]

#: Group sizes the int4 kernels take.
KERNEL_GROUPS: Final = frozenset({32, 64, 128, 256})

Kind = Literal["int4", "int8", "fp8"]


@attrs.frozen
class Quantized:
    """``w = scale * code + offset`` per group of ``group`` columns (module docstring).

    ``codes``: uint8 ``[N, K // 2]`` (int4), int8 ``[N, K]`` (int8) or float8_e4m3fn ``[N, K]``
    (fp8: a published FP8 weight, ``shard.model.fp8``); ``scale``, ``offset``: float32
    ``[N, K // group]`` (``offset`` None: zero).
    """

    kind: Kind
    codes: Tensor
    scale: Tensor
    offset: Tensor | None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n, g = self.scale.shape
        return int(n), int(g) * self.group

    def int_codes(self, rows: Tensor | None = None) -> Tensor:
        """Codes ``[N, K]`` (uint8 for int4, int8 for int8, float8_e4m3fn for fp8), of ``rows``
        when given."""
        codes = self.codes if rows is None else self.codes.index_select(0, rows)
        if self.kind != "int4":
            return codes
        return torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)  # [R, K]: even, odd

    def dequantize(self, rows: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight ``[N, K]`` (or its rows ``rows``), computed in float32."""
        codes = self.int_codes(rows)
        r, k = codes.shape
        scale, offset = self.scale, self.offset
        if rows is not None:
            scale = scale.index_select(0, rows)
            offset = None if offset is None else offset.index_select(0, rows)
        w = codes.to(torch.float32).view(r, k // self.group, self.group)
        w.mul_(scale[:, :, None])
        if offset is not None:
            w.add_(offset[:, :, None])
        out: Tensor = w.view(r, k).to(dtype)
        return out

    def tensors(self) -> list[Tensor]:
        """Codes, scales and offsets (when there are offsets)."""
        return [self.codes, self.scale] + ([] if self.offset is None else [self.offset])

    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        extra = 0 if self.offset is None else self.offset.nbytes
        return int(self.codes.nbytes + self.scale.nbytes + extra)


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 ``[N, K // 2]`` from int codes ``0..15`` ``[N, K]`` (even column low)."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def quantize_int4(weight: Tensor, group: int = 32) -> Quantized:
    """Asymmetric min/max int4 in groups of ``group`` (a float checkpoint quantized at load).

    Per group ``scale = (max - min) / 15``, ``offset = min``, ``code = round((w - min) /
    scale)``: the error is at most half a step, ``(max - min) / 30`` (``tests/test_quant.py``).
    """
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((w - lo[:, :, None]) * inv[:, :, None]).round().clamp(0, 15)
    return Quantized("int4", pack_nibbles(codes.view(n, k)), scale, lo, group)


def quantize_int8(weight: Tensor, group: int | None = None) -> Quantized:
    """Symmetric absmax int8, per output channel (``group`` None) or in groups of ``group``.

    ``scale = max|w| / 127``: the error is at most half a step, ``max|w| / 254``.
    """
    n, k = weight.shape
    g = k if group is None else group
    w = weight.float().reshape(n, k // g, g)
    scale = w.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (w * inv[:, :, None]).round().clamp(-127, 127).to(torch.int8)
    return Quantized("int8", codes.view(n, k), scale, None, g)


def to_device(q: Quantized, device: torch.device) -> Quantized:
    """``q`` with its tensors on ``device``."""
    offset = None if q.offset is None else q.offset.to(device)
    return attrs.evolve(q, codes=q.codes.to(device), scale=q.scale.to(device), offset=offset)


def kernel_dtype(device: torch.device) -> torch.dtype:
    """The dtype the packed kernels (int4, int8 split, int8 per channel) run in: bf16 on every
    device. Their float32 variants are not vectorized on a CPU without bf16 instructions:
    one SmolLM2-shaped row (576 x 1536, one thread, AVX2) took 3.3 ms in float32 against
    0.29 ms in bf16 (a dense float32 product: 0.19 ms), 9 rows 16 ms against 0.48, and int8
    per channel 1.3 ms against 0.09. For float32 products, load dense (``weights = "float32"``)."""
    return torch.bfloat16


def dense_dtype(device: torch.device) -> torch.dtype:
    """The dtype a weight dequantized per call is multiplied in: bf16 on CUDA and on CPUs with
    bf16 instructions, float32 elsewhere (an emulated bf16 GEMM is slower than float32)."""
    return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32


#: Rows packed at a time: the CPU packer's blocked layout is separable by row blocks of this
#: size (a test checks it), and packing in blocks keeps its int32 input to 4 bytes a
#: parameter of one block, not of the whole table (SmolLM2's head: 9 MB, not 113 MB). Each
#: block is written into the one output tensor, so no list of blocks is held beside it.
PACK_ROWS: Final = 4096


def _cpu_pack_ints(n: int, k: int, blocks: Iterator[tuple[int, Tensor]]) -> Tensor:
    """``_convert_weight_to_int4pack_for_cpu`` of an ``[n, k]`` weight given as int32 code
    blocks ``(first row, [rows, k])``, written block by block into one ``[n, k // 2]``."""
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for i, ints in blocks:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 1)
        out[i : i + ints.shape[0]] = packed.view(ints.shape[0], k // 2)
    return out


def _cpu_pack(codes: Tensor) -> Tensor:
    """``_convert_weight_to_int4pack_for_cpu`` of nibble codes uint8 ``[N, K // 2]``."""
    n, k = codes.shape[0], codes.shape[1] * 2

    def blocks() -> Iterator[tuple[int, Tensor]]:
        for i in range(0, n, PACK_ROWS):
            block = codes[i : i + PACK_ROWS]
            yield i, torch.stack((block & 15, block >> 4), -1).flatten(-2).to(torch.int32)

    return _cpu_pack_ints(n, k, blocks())


def _split_int8(codes: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes ``[N, K]`` as nibbles ``hi + 8`` and ``lo`` (``code = 16 hi + lo``), each
    uint8 ``[N, K // 2]``, a block of rows at a time."""
    n, k = codes.shape
    hi = torch.empty(n, k // 2, dtype=torch.uint8, device=codes.device)
    lo = torch.empty_like(hi)
    for i in range(0, n, PACK_ROWS):
        c = codes[i : i + PACK_ROWS].to(torch.int16)  # arithmetic shift of the signed codes
        hi[i : i + PACK_ROWS] = pack_nibbles((c >> 4) + 8)
        lo[i : i + PACK_ROWS] = pack_nibbles(c & 15)
    return hi, lo


def _pack(codes: Tensor) -> Tensor:
    """Nibble codes uint8 ``[N, K // 2]`` in the int4 kernel's layout on their device."""
    if codes.device.type == "cuda":  # untested here: no CUDA build of torch on this host
        swapped = (codes & 15) << 4 | (codes >> 4)  # the CUDA packer wants even high
        out: Tensor = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
        return out
    return _cpu_pack(codes)


def split_int8(q: Quantized, dt: torch.dtype) -> list[_Int4]:
    """An int8 weight in groups as two int4 weights (``int8-split``: module docstring) whose
    products, summed, are its product: ``hi`` with scale ``16 * scale``, ``lo`` with the
    offset, scales and zeros in ``dt``."""
    zero = torch.zeros_like(q.scale)
    offset = q.offset if q.offset is not None else zero
    hi, lo = (_pack(c) for c in _split_int8(q.codes))
    g = q.group
    return [_Int4(hi, 16 * q.scale, zero, g, dt), _Int4(lo, q.scale, offset + 8 * q.scale, g, dt)]


class _Int4:
    """One int4 weight packed for its kernel (``packed``), with ``[K // g, N, 2]`` scales and
    zeros."""

    def __init__(self, packed: Tensor, scale: Tensor, zero: Tensor, group: int, dt: torch.dtype):
        self.group = group
        self.packed = packed
        self.scales_zeros = torch.stack((scale.T, zero.T), -1).to(dt).contiguous()

    @classmethod
    def stacked(cls, parts: Sequence[_Int4]) -> _Int4:
        """``parts`` (same group and input width, CPU) as one weight, stacked by output row.
        The CPU packer lays rows out in blocks of 64 (``shard.model.fused.PACK_BLOCK``), so
        the packed rows stack as they are where every part but the last has a multiple of 64
        rows; the caller (``shard.model.fused``) checks that."""
        joined = cls.__new__(cls)
        joined.group = parts[0].group
        joined.packed = torch.cat([p.packed for p in parts])
        joined.scales_zeros = torch.cat([p.scales_zeros for p in parts], dim=1).contiguous()
        return joined

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def tensors(self) -> list[Tensor]:
        """The packed codes and the scales/zeros."""
        return [self.packed, self.scales_zeros]

    def mm(self, x: Tensor) -> Tensor:
        if x.device.type == "cuda":
            op = torch.ops.aten._weight_int4pack_mm
        else:
            op = torch.ops.aten._weight_int4pack_mm_for_cpu
        out: Tensor = op(x, self.packed, self.group, self.scales_zeros)
        return out


class QuantLinear(nn.Module):
    """A linear layer on a ``Quantized`` weight (paths: module docstring), with an optional
    dense ``bias`` (Qwen2's q/k/v) added in the input's dtype.

    ``path`` names the one taken: ``"int4"``, ``"int8-channel"``, ``"int8-group"``,
    ``"int8-split"``, ``"dequantize"``, or ``"held"`` after ``hold``. ``q`` keeps the
    host-independent codes only on the ``dequantize`` path. Its tensors are plain attributes,
    not buffers: the layer is built on its device (``device``) and ``Module.to`` leaves it
    alone.
    """

    def __init__(
        self, q: Quantized, device: torch.device | str = "cpu", bias: Tensor | None = None
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = q.shape
        self.compute = kernel_dtype(dev)
        on_device = to_device(q, dev)
        self._parts: list[_Int4] | list[Int8Group] = []
        self._int8: tuple[Tensor, Tensor] | None = None
        self._held: Tensor | None = None  # ``hold``: the weight as each call would dequantize it
        self.path = self._pack(on_device)
        self.q = on_device if self.path == "dequantize" else None  # else the kernel's form only
        #: set by ``join``: the joined product this layer is a slice of (``shard.model.fused``)
        self.joined: tuple[nn.Module, int] | None = None

    def join(self, joined: nn.Module, index: int) -> None:
        """Run as output ``index`` of ``joined`` (a ``shard.model.fused.JoinedInt4`` that now
        holds this layer's weight), holding nothing of its own."""
        self._parts = []
        self.joined = (joined, index)

    def _pack(self, q: Quantized) -> str:
        n, k = q.shape
        dt, g = self.compute, q.group
        zero = torch.zeros_like(q.scale)
        offset = q.offset if q.offset is not None else zero
        fits = g in KERNEL_GROUPS and k % g == 0 and n % 16 == 0  # the int4 packers' rules
        if q.kind == "int4" and fits:
            self._parts = [_Int4(_pack(q.codes), q.scale, offset + 8 * q.scale, g, dt)]
            return "int4"
        if q.kind == "int8" and g == k and q.offset is None and q.codes.device.type == "cpu":
            self._int8 = (q.codes.contiguous(), q.scale[:, 0].to(dt).contiguous())
            return "int8-channel"
        if q.kind == "int8" and q.codes.device.type == "cpu" and n > 0 and q8_fits(k, g):
            self._parts = [Int8Group(q.codes, q.scale, q.offset, g)]  # packed once
            self.compute = torch.float32
            return "int8-group"
        if q.kind == "int8" and fits:
            self._parts = split_int8(q, dt)
            return "int8-split"
        self.compute = dense_dtype(q.codes.device)
        return "dequantize"

    @property
    def holdable(self) -> bool:
        """Dequantized per call in bf16 because no kernel takes its groups (GGUF's K-quant
        sub-blocks of 16: Q6_K), so ``hold`` may keep it dequantized instead. FP8
        weights, int4 ones of a kernel's group with an odd row count, and any multiplied in
        float32 (``dense_dtype`` on a CPU without bf16) are left to the call."""
        q = self.q
        if self.path != "dequantize" or self.compute != torch.bfloat16 or q is None:
            return False
        return q.kind != "fp8" and q.group < 32

    def hold_cost(self) -> int:
        """Bytes ``hold`` adds: the dequantized weight in ``compute`` less the codes it frees."""
        assert self.q is not None
        return self.out_features * self.in_features * self.compute.itemsize - self.q.nbytes()

    def hold(self) -> None:
        """Keep the weight dequantized in ``compute`` (the very tensor each call made: the same
        bytes out) and free its codes; ``path`` becomes ``"held"``. Gemma 3's 640 x 2048 Q6_K
        weights took ~2 ms a call to dequantize here (docs/benchmarks.md)."""
        assert self.holdable and self.q is not None
        self._held = self.q.dequantize(dtype=self.compute)
        self.q, self.path = None, "held"

    def forward(self, x: Tensor) -> Tensor:
        if self.joined is not None:  # bias None: join_siblings joins only bias-free layers
            joined, index = self.joined
            piece: Tensor = joined(x)[index]
            return piece
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(self.compute)  # [R, in]
        if self._int8 is not None:
            out = torch.ops.aten._weight_int8pack_mm(rows, *self._int8)
        elif self._parts:
            outs = [p.mm(rows) for p in self._parts]
            out = outs[0] if len(outs) == 1 else outs[0].float() + outs[1].float()
        else:
            if self._held is not None:
                w = self._held
            else:
                assert self.q is not None
                w = self.q.dequantize(dtype=self.compute)
            cpu = rows.device.type == "cpu"
            two = cpu and rows.shape[0] == 1 and rows.dtype is torch.bfloat16  # shard.model.linear
            if two:
                out = F.linear(rows.expand(2, -1), w)[:1]
            elif cpu and rows.dtype is torch.float32:
                out = padded_linear(rows, w)  # row-invariant (shard.model.linear)
            else:
                out = F.linear(rows, w)
        result: Tensor = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return result if self.bias is None else result + self.bias

    def tensors(self) -> list[Tensor]:
        """Every tensor this layer holds for its weight (kernel-packed codes, scales, zeros,
        or the codes it dequantizes), bias aside (a parameter)."""
        held = [] if self.q is None else self.q.tensors()
        for p in self._parts:
            held += p.tensors()
        if self._int8 is not None:
            held += list(self._int8)
        if self._held is not None:
            held.append(self._held)
        return held

    def nbytes(self) -> int:
        """Bytes this layer holds in memory (kernel-packed codes, scales, zeros)."""
        total = 0 if self.q is None else self.q.nbytes()
        total += sum(t.nbytes for p in self._parts for t in p.tensors())
        if self._int8 is not None:
            total += self._int8[0].nbytes + self._int8[1].nbytes
        if self._held is not None:
            total += self._held.nbytes
        return int(total)


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: ``forward`` dequantizes only the rows looked up.
    ``share`` makes it read a tied ``int8-group`` head's packed table instead of its own."""

    def __init__(self, q: Quantized, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.q: Quantized | Int8Group = to_device(q, torch.device(device))
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = q.shape

    def share(self, head: QuantLinear) -> None:
        """Read rows from ``head``'s packed table (an ``int8-group`` head built from this table:
        the same codes, scales and offsets, the same bytes) and free this one's own."""
        (table,) = head._parts
        assert head.path == "int8-group" and isinstance(table, Int8Group)
        self.q = table

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.q.dequantize(ids.reshape(-1), dtype=self.dtype)  # [B*S, D]
        return rows.view(*ids.shape, self.embedding_dim)

    def tensors(self) -> list[Tensor]:
        """The table's codes, scales and offsets."""
        return self.q.tensors()

    def nbytes(self) -> int:
        return self.q.nbytes()
