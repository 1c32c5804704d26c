"""Row attention (issue 42): a short chunk's attention on the CPU in float32, each row in one
stated order, so that a compiled kernel and plain torch give the same bytes and a row gives
the same bytes alone (its decode step) as in a chunk (a verify chunk), in one call.

It replaces, on quantized blocks (``Attention.rowwise``), torch's scaled-dot-product attention
called once per row: 9 calls a layer for a verify chunk, each with its own few tens of
microseconds of overhead (Gemma 3 270M's 9-row verify chunk at position 100, two threads: 3.9
of its 33 ms).

For a chunk of ``S`` rows at positions ``[start, start + S)`` over keys ``[0, L)``
(``L = start + S``), row ``i`` attends keys ``[0, n)`` with ``n = start + i + 1``, where its
mask row allows, exactly the keys and mask its own one-row decode at ``start + i`` has. Per
row and head ``h`` (its key/value head ``h // (H / KV)``), every float operation one correctly
rounded float32 operation, never fused:

- ``dot(q, k)``: 16 lanes, lane ``l`` the products ``q[16 b + l] * k[16 b + l]`` summed over
  ``b`` left to right; then the lanes in halves, ``a[l] + a[l + 8]``, ``+ a[l + 4]``,
  ``+ a[l + 2]``, ``+ a[l + 1]``;
- ``s_j = dot(q, k_j) * scale`` for each allowed ``j``; ``m`` the largest (NaN if any is NaN);
- ``e_j = exp(s_j - m)`` (``exp``: Cody-Waite range reduction and Cephes' six-term
  polynomial, each step stated in ``stated_exp``; 0 below -87);
- ``den`` the sum over ``j < n`` of ``e_j`` and ``num[d]`` that of ``e_j * v_j[d]``, a key
  the mask hides counting as -0.0 (which adds nothing): the keys in chunks of 16
  (``[0, 16), [16, 32), ...``), each chunk's terms summed left to right from -0.0, then the
  chunks' sums pairwise: neighbours ``(c_0 + c_1), (c_2 + c_3), ...``, the last carried up
  when the count is odd, until one is left;
- the output ``num[d] / den``.

``attend_rows`` runs the compiled kernel (``native_attn.cpp``, one build with the native
forward's: AVX-512, AVX2 or plain C++, the same bytes) and falls back to ``reference``, the
same operations in torch, where the extension did not build.
"""

from __future__ import annotations

import functools
import logging
from typing import Final

import torch
from torch import Tensor

from shard.model.native_build import build

__all__ = [
    "CHUNK",
    "LANES",
    "attend_rows",
    "fits",
    "pairwise_sum",
    "reference",
    "shapes_fit",
    "stated_exp",
]

log = logging.getLogger(__name__)

#: Lanes of the dot product (the head dimension is a multiple of it).
LANES: Final = 16
#: Keys summed in order before their chunks' sums are added pairwise.
CHUNK: Final = 16
#: ``stated_exp``: below this, 0.
EXP_FLOOR: Final = -87.0
LOG2E: Final = 1.44269504
LN2_HI: Final = 0.693359375
LN2_LO: Final = -2.12194440e-4
#: Cephes' ``expf`` polynomial, highest power first.
EXP_POLY: Final = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)


def shapes_fit(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether row attention takes heads of ``head_dim`` (a multiple of 16), ``heads`` query
    heads over ``kv_heads`` (a multiple of them)."""
    return head_dim > 0 and head_dim % LANES == 0 and kv_heads > 0 and heads % kv_heads == 0


def fits(q: Tensor, keys: Tensor, mask: Tensor) -> bool:
    """Whether row attention takes ``q`` ``[B, H, S, Dh]`` over ``keys`` ``[B, KV, L, Dh]``
    under ``mask`` ``[S, L]``: float32 on the CPU, ``Dh`` a multiple of 16, ``H`` a multiple
    of ``KV``, a boolean two-dimensional mask."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and keys.dtype == torch.float32
        and q.dim() == 4
        and keys.dim() == 4
        and shapes_fit(q.shape[-1], q.shape[1], keys.shape[1])
        and mask.dtype == torch.bool
        and mask.dim() == 2
        and tuple(mask.shape) == (q.shape[2], keys.shape[2])
        and q.shape[2] <= keys.shape[2]
    )


def _f(x: float) -> Tensor:
    return torch.tensor(x, dtype=torch.float32)


def stated_exp(x: Tensor) -> Tensor:
    """``exp`` of float32 ``x <= 0`` (or NaN) in the stated steps: ``n`` the nearest integer
    (ties to even) of ``x * log2(e)``, ``r = (x - n * LN2_HI) - n * LN2_LO``, ``y`` the
    polynomial in ``r`` by Horner's rule times ``r * r``, plus ``r``, plus 1, times ``2^n``;
    0 where ``x < -87`` and ``x`` where ``x`` is NaN."""
    t = x * _f(LOG2E)
    n = torch.where(t.isnan(), torch.zeros_like(t), t).round()
    r = (x - n * _f(LN2_HI)) - n * _f(LN2_LO)
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + _f(c)
    y = ((p * (r * r)) + r) + _f(1.0)
    low = x < EXP_FLOOR
    power = ((torch.where(low, torch.zeros_like(n), n).to(torch.int32) + 127) << 23).view(
        torch.float32
    )
    y = y * power
    return torch.where(low, torch.zeros_like(y), torch.where(x.isnan(), x, y))


def _split(t: Tensor, dim: int, parts: int) -> Tensor:
    """``t`` with its dimension ``dim`` (negative) split into ``[-1, parts]``."""
    shape = list(t.shape)
    return t.reshape([*shape[:dim], -1, parts, *shape[len(shape) + dim + 1 :]])


def pairwise_sum(t: Tensor, dim: int) -> Tensor:
    """``t`` summed along ``dim`` (negative) in the stated pairwise order (module docstring):
    neighbours added, the last carried up when the count is odd."""
    n = t.shape[dim]
    while n > 1:
        pairs = _split(t.narrow(dim, 0, n - n % 2), dim, 2)  # [..., n // 2, 2, ...]
        summed = pairs.select(dim, 0) + pairs.select(dim, 1)
        t = torch.cat([summed, t.narrow(dim, n - 1, 1)], dim) if n % 2 else summed
        n = t.shape[dim]
    return t.squeeze(dim)


def _dot(q: Tensor, k: Tensor) -> Tensor:
    """``q`` ``[..., Dh]`` with ``k`` ``[..., Dh]`` (broadcast) in the stated lanes: ``[...]``."""
    p = _split(q * k, -1, LANES)
    acc = p[..., 0, :]
    for b in range(1, p.shape[-2]):
        acc = acc + p[..., b, :]
    w = LANES
    while w > 1:
        w //= 2
        acc = acc[..., :w] + acc[..., w : 2 * w]
    return acc[..., 0]


def _chunks(t: Tensor, minus_zero: Tensor) -> Tensor:
    """Terms ``[..., n, D]`` summed in order in chunks of ``CHUNK`` keys, from -0.0 (the last
    chunk padded with -0.0, which adds nothing): ``[..., ceil(n / CHUNK), D]``."""
    n = t.shape[-2]
    pad = -n % CHUNK
    if pad:
        t = torch.cat([t, minus_zero.expand(*t.shape[:-2], pad, t.shape[-1])], -2)
    t = _split(t, -2, CHUNK)  # [..., C, CHUNK, D]
    acc = t[..., 0, :]
    for c in range(1, CHUNK):
        acc = acc + t[..., c, :]
    return acc


def reference(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Row attention in torch (module docstring): ``[B, H, S, Dh]`` float32."""
    b, h, s, dh = q.shape
    rep = h // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1)
    values = values.repeat_interleave(rep, dim=1)
    out = q.new_empty(b, h, s, dh)
    start = keys.shape[2] - s
    minus_zero = _f(-0.0)
    for i in range(s):
        n = start + i + 1
        allowed = mask[i, :n]  # [n]
        dots = _dot(q[:, :, i, None, :], keys[:, :, :n])  # [B, H, n]
        scores = dots * _f(scale)
        m = torch.where(allowed, scores, _f(float("-inf"))).amax(-1, keepdim=True)
        e = torch.where(allowed, stated_exp(scores - m), minus_zero)
        den = pairwise_sum(_chunks(e[..., None], minus_zero), -2)[..., 0]  # [B, H]
        terms = torch.where(allowed[:, None], e[..., None] * values[:, :, :n], minus_zero)
        out[:, :, i] = pairwise_sum(_chunks(terms, minus_zero), -2) / den[..., None]
    return out


@functools.cache
def _fallback_warning(why: str) -> None:
    log.warning("row attention runs in plain torch, the same bytes several times slower: %s", why)


def attend_rows(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, isa: int = -1
) -> Tensor:
    """Row attention (module docstring) of ``q`` ``[B, H, S, Dh]`` over ``keys``/``values``
    ``[B, KV, L, Dh]`` under ``mask`` ``[S, L]`` (``fits``): ``[B, H, S, Dh]`` float32, by the
    compiled kernel where it built, else ``reference``. ``isa``: the kernel's version (0 plain
    C++, 1 AVX2, 2 AVX-512; -1 the widest the CPU runs): the same bytes, for tests."""
    ext = build()
    if isinstance(ext, str):
        _fallback_warning(ext)
        return reference(q, keys, values, mask, scale)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:  # the kernel reads a head's values in a row
        keys, values = keys.contiguous(), values.contiguous()
    out: Tensor = ext.row_attention(q, keys, values, mask, scale, isa)
    return out
