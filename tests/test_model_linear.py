"""``shard.model.linear.Linear``: a one-row bf16 product on the CPU gives the bits that row
gets inside a many-row product (what makes a batched bf16 stage batch-invariant)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shard.model.linear import Linear


def _layer(cls: type[nn.Linear], k: int, n: int, dtype: torch.dtype, seed: int) -> nn.Linear:
    layer = cls(k, n, bias=False).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    return layer


@pytest.mark.parametrize(("k", "n"), [(1536, 576), (576, 1536), (576, 192), (576, 49152)])
def test_one_row_in_bfloat16_sums_as_it_does_among_many(k: int, n: int) -> None:
    """SmolLM2's shapes (the down projection, gate/up, k/v, the head): each of 32 rows alone,
    as ``[1, in]`` or ``[1, 1, in]``, equals its row of the 32-row product bit for bit."""
    layer = _layer(Linear, k, n, torch.bfloat16, seed=7)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        many = layer(x)
        for i in range(32):
            assert torch.equal(layer(x[i : i + 1]), many[i : i + 1])
            assert torch.equal(layer(x[i].view(1, 1, k)), many[i].view(1, 1, n))


def test_other_dtypes_and_shapes_are_plain_linear() -> None:
    """fp32, and bf16 with more than one row, compute exactly what ``nn.Linear`` does."""
    for dtype, rows in ((torch.float32, 1), (torch.float32, 5), (torch.bfloat16, 3)):
        ours, plain = _layer(Linear, 64, 48, dtype, 1), _layer(nn.Linear, 64, 48, dtype, 1)
        x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.no_grad():
            assert torch.equal(ours(x), plain(x))
