"""The q8 product (issue 42): an int8 weight in groups (GGUF's Q8_0 and Q5_*, ``Quantized``
int8 with ``group`` columns a scale) times float32 rows, in one stated order of float32
operations, so that a compiled kernel and plain torch give the same bytes.

For a row ``x`` and an output ``n`` (codes ``c``, a group's scale ``s`` and offset ``o``;
``L = 16`` lanes; every operation one correctly rounded float32 add or multiply, never fused):

- per group ``g`` and lane ``l``: ``v[l]``, the products ``c[k] * x[k]`` of the group's columns
  ``k = l, l + 16, l + 32, ...`` summed left to right (starting from the first product);
- ``t[l] = s * v[l]``; with offsets ``t[l] = s * v[l] + o * u[l]``, ``u[l]`` the same sums of
  ``x`` alone;
- ``acc[l]``: ``t[l]`` summed over the groups left to right (starting from group 0's);
- the output: ``acc`` folded in halves, ``acc[l] += acc[l + 8]``, then ``+ 4``, ``+ 2``, ``+ 1``:
  ``acc[0]``.

Each output of each row is computed from that row and that weight row alone, so a verify chunk
equals its decode steps and a batched row its lone run, on any thread count and instruction
set. Against the int4 kernel's two products it used to run as (``int8-split``, still the path
on CUDA), it keeps the activations in float32 (no bf16 rounding) and reads the codes as
stored: a tied head shares the embedding's table instead of a packed copy.

``q8_mm`` runs the compiled kernel of ``native_step.cpp`` (built by ``shard.model.native_build``;
AVX-512, AVX2 or plain code chosen at run time, the same bytes) and falls back to
``reference``, the same operations as torch tensor operations: the same bytes, many times
slower (a warning says so once). ``tests/test_q8.py`` checks the two against each other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Final

import torch
from torch import Tensor

from shard.model.native_build import build

__all__ = ["LANES", "Int8Group", "q8_mm", "reference"]

log = logging.getLogger(__name__)

#: Lanes of the stated order (module docstring).
LANES: Final = 16
#: Weight rows the reference multiplies at a time (its products are 4 bytes a weight).
REFERENCE_ROWS: Final = 2048


def _lane_sums(t: Tensor) -> Tensor:
    """``[..., J, L]`` summed over ``J`` left to right, starting from the first."""
    out = t[..., 0, :]
    for j in range(1, t.shape[-2]):
        out = out + t[..., j, :]
    return out


def reference(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int) -> Tensor:
    """``[R, K] x [N, K] -> [R, N]`` in the stated order (module docstring), in torch."""
    r, k = x.shape
    n, groups, slices = codes.shape[0], k // group, group // LANES
    xs = x.float().reshape(r, 1, groups, slices, LANES)
    u = _lane_sums(xs) if offset is not None else None  # [R, 1, G, L]
    out = torch.empty(r, n, dtype=torch.float32, device=x.device)
    for i in range(0, n, REFERENCE_ROWS):
        c = codes[i : i + REFERENCE_ROWS].float().reshape(1, -1, groups, slices, LANES)
        t = _lane_sums(c * xs) * scale[i : i + REFERENCE_ROWS, :, None]  # [R, n, G, L]
        if offset is not None and u is not None:
            t = t + offset[i : i + REFERENCE_ROWS, :, None] * u
        acc = _lane_sums(t)  # [R, n, L]: over the groups
        width = LANES
        while width > 1:
            width //= 2
            acc = acc[..., :width] + acc[..., width : 2 * width]
        out[:, i : i + REFERENCE_ROWS] = acc[..., 0]
    return out


@functools.cache
def _fallback_warning(why: str) -> None:
    log.warning("int8 products run in plain torch, the same bytes many times slower: %s", why)


def q8_mm(
    x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int, isa: int = -1
) -> Tensor:
    """Rows ``x`` ``[R, K]`` (float32) times the int8 weight: ``[R, N]`` float32, by the compiled
    kernel where it built, else ``reference``. ``isa`` picks the kernel's version (0 plain C++,
    1 AVX2, 2 AVX-512; -1 the widest the CPU runs): the same bytes, for tests."""
    ext = build()
    if isinstance(ext, str) or x.device.type != "cpu":
        if isinstance(ext, str):
            _fallback_warning(ext)
        return reference(x, codes, scale, offset, group)
    none = scale.new_empty(0)
    rows = x.contiguous()
    out: Tensor = ext.q8_mm(rows, codes, scale, none if offset is None else offset, group, isa)
    return out


class Int8Group:
    """An int8 weight in groups kept as stored, for ``q8_mm``: codes ``[N, K]`` int8, scale and
    offset (or None) ``[N, K // group]`` float32, all contiguous on the CPU."""

    def __init__(self, codes: Tensor, scale: Tensor, offset: Tensor | None, group: int) -> None:
        self.codes = codes.contiguous()
        self.scale = scale.float().contiguous()
        self.offset = None if offset is None else offset.float().contiguous()
        self.group = group

    @classmethod
    def stacked(cls, parts: Sequence[Int8Group]) -> Int8Group:
        """``parts`` (same group and input width; all with offsets or none) stacked by row."""
        offsets = [p.offset for p in parts]
        offset = None if offsets[0] is None else torch.cat([o for o in offsets if o is not None])
        return cls(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            offset,
            parts[0].group,
        )

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> list[Tensor]:
        """Codes, scales and offsets (when there are offsets)."""
        return [self.codes, self.scale] + ([] if self.offset is None else [self.offset])

    def mm(self, x: Tensor) -> Tensor:
        return q8_mm(x, self.codes, self.scale, self.offset, self.group)
