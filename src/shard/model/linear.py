"""``Linear``: ``nn.Linear`` whose one-row products in bf16 on the CPU sum as many-row ones do.

A batched stage runs many sessions' rows through one product (``shard.model.packed``), and
a session's output should not depend on who else is in the batch. In bf16 on the CPU that
comes down to one case: oneDNN computes a product with one row (a lone decode step) by
another kernel than a product with two or more, and for some widths that kernel rounds
differently (SmolLM2's 1,536-wide down projection: a few outputs in every thousand, one bf16
step apart, enough to flip a greedy choice 30 layers later). Every product of two or more
rows gave a row the same bits whatever the row count at every SmolLM2 shape (1 and 2
threads, 2 to 64 rows), so a one-row product here runs as two (the row and a stride-0 copy
of it; the second output is dropped). That costs a few microseconds a product and makes
SmolLM2's bf16 forward batch-invariant bit for bit (``tests/test_batch.py``). It is an
observation about this kernel library, not a guarantee for every shape: the tiny test
models' 32-wide value projection still rounds a row differently among 16 rows than among 2,
so the tests keep the tie rule there.

float32 products on this CPU (an AVX2 EPYC, oneDNN/MKL in torch 2.13) take three kernels by row
count: one row, two or three, four or more; at two threads five to seven and nine to eleven
rows split differently again. Padded with zero rows to a multiple of 4, every row had its lone
bits at every row count from 1 to 64 and at 1, 2 and 4 threads (docs/benchmarks.md, session
21). ``pad_rows`` does that; ``Linear.rowwise`` (set by the loader on quantized blocks, whose
every other product is row-invariant) turns it on for a float32 ``Linear``, as the dequantized
products of ``shard.model.quant`` always do. A dense float32 model keeps the plain product
(its batched rows differ in the last bits, counted as ties): padding costs a lone row 2.6x
(576 -> 1536: 0.095 -> 0.25 ms). Every GPU is untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Linear", "padded_linear"]

#: float32 CPU products keep a row's bits when their row count is a multiple of this
ROW_MULTIPLE = 4


def padded_linear(rows: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(rows, weight, bias)`` over ``rows`` ``[R, in]`` padded with zero rows to a
    multiple of ``ROW_MULTIPLE`` (module docstring); the padding's outputs are dropped."""
    r = rows.shape[0]
    extra = -r % ROW_MULTIPLE
    if extra:
        rows = F.pad(rows, (0, 0, 0, extra))
    out: Tensor = F.linear(rows, weight, bias)
    return out[:r] if extra else out


class Linear(nn.Linear):
    """``nn.Linear`` with the one-row bf16 CPU product run as two rows, and with ``rowwise``
    a float32 CPU product over rows padded to a multiple of 4 (module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rowwise = False

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        if x.dtype is torch.bfloat16 and x.numel() == x.shape[-1]:
            two = x.reshape(1, -1).expand(2, -1)  # [2, in]: the row twice, no copy
            out: Tensor = F.linear(two, self.weight, self.bias)[:1]  # [1, out]
            return out.reshape(*x.shape[:-1], -1)
        if self.rowwise and x.dtype is torch.float32:
            rows = padded_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
            return rows.reshape(*x.shape[:-1], -1)
        return super().forward(x)


def embedding(vocab: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` ``[vocab, dim]`` with its table left unset: a stage's table is
    always replaced by the checkpoint's. Built on the meta device (the loader), a plain
    ``nn.Embedding``'s random init runs through torch's reference ops and imports
    ``torch._dynamo`` first: about 1 s of every process that builds a first stage."""
    return nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim))
