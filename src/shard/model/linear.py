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
so the tests keep the tie rule there. fp32 products are untouched (their batched rows differ
in the last bits, counted as ties), as is every GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``nn.Linear`` with the one-row bf16 CPU product run as two rows (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype is torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
            two = x.reshape(1, -1).expand(2, -1)  # [2, in]: the row twice, no copy
            out: Tensor = F.linear(two, self.weight, self.bias)[:1]  # [1, out]
            return out.reshape(*x.shape[:-1], -1)
        return super().forward(x)
