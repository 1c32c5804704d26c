"""Quantized linear and embedding: each kernel path against its dequantized reference."""

from __future__ import annotations

import pytest
import torch

from shard.model.quant import (
    QuantEmbedding,
    Quantized,
    QuantLinear,
    dense_dtype,
    kernel_dtype,
    quantize_int4,
    quantize_int8,
    split_int8,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# One bf16 rounding of outputs of magnitude ~30-100 (bf16 keeps 8 bits: a step is 2^-7 of
# the value), plus the scales' bf16 rounding: 1% of the largest output bounds every path.
REL_TOL = 1e-2

CASES = [
    ("int4 g32", lambda w: quantize_int4(w, 32), "int4"),
    ("int4 g128", lambda w: quantize_int4(w, 128), "int4"),
    ("int8 per channel", lambda w: quantize_int8(w), "int8-channel"),
    ("int8 g32", lambda w: quantize_int8(w, 32), "int8-group"),
    ("int4 g16", lambda w: quantize_int4(w, 16), "dequantize"),
]


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("name", "make", "path"), CASES, ids=[c[0] for c in CASES])
def test_quant_linear_matches_dequantized_reference(name: str, make: object, path: str) -> None:
    """Each path's product equals the dequantized weight's product within one bf16 rounding."""
    q: Quantized = make(_weight())  # type: ignore[operator]
    layer = QuantLinear(q)
    assert layer.path == path
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    ref = x.to(layer.compute).float() @ q.dequantize().T
    got = layer(x)
    assert got.dtype is torch.float32 and got.shape == (5, 96)
    assert (got - ref).abs().max() <= REL_TOL * ref.abs().max()


@pytest.mark.parametrize(("name", "make", "path"), CASES, ids=[c[0] for c in CASES])
def test_quant_linear_rows_are_batch_invariant(name: str, make: object, path: str) -> None:
    """A row's output has the same bits alone as among 9 rows (batching relies on it)."""
    layer = QuantLinear(make(_weight(k=768)))  # type: ignore[operator]
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    together = layer(x)
    for i in range(9):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1]), f"row {i}"


def test_quantizers_bound_their_error() -> None:
    """int4 g32 errs by at most half a step ((max-min)/30), int8 by max|w|/254."""
    w = _weight()
    g = w.view(96, -1, 32)
    err4 = (quantize_int4(w).dequantize() - w).abs().view(96, -1, 32).amax(-1)
    assert (err4 <= (g.amax(-1) - g.amin(-1)) / 30 + 1e-6).all()
    err8 = (quantize_int8(w).dequantize() - w).abs().amax(-1)
    assert (err8 <= w.abs().amax(-1) / 254 + 1e-6).all()


def test_int8_split_is_exact_in_float32() -> None:
    """The int8 group-wise path on CUDA (two int4 products, ``int8-split``) is exact as a
    representation: with fp32 scales its product equals the reference's up to fp32
    summation order. Built here on the CPU's int4 kernel (a CPU runs ``int8-group``)."""
    q = quantize_int8(_weight(), 32)
    parts = split_int8(q, torch.float32)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    got = parts[0].mm(x) + parts[1].mm(x)
    ref = x @ q.dequantize().T
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_embedding_gathers_dequantized_rows() -> None:
    """The embedding returns exactly the looked-up rows of the dequantized table."""
    for q in (quantize_int4(_weight()), quantize_int8(_weight(), 32), quantize_int8(_weight())):
        emb = QuantEmbedding(q, torch.float32)
        ids = torch.tensor([[3, 0, 95], [7, 7, 1]])
        assert torch.equal(emb(ids), q.dequantize()[ids])


def test_packed_kernels_run_in_bf16_and_dequantized_products_as_the_cpu_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The packed kernels run in bf16 on every CPU (their float32 variants are 11-33x slower
    where there are no bf16 instructions); a weight dequantized per call (a group of 16) is
    multiplied in bf16 only where the CPU has bf16 instructions, else in float32."""
    for has_bf16 in (False, True):
        monkeypatch.setattr("shard.model.quant.cpu_has_bf16", lambda has=has_bf16: has)
        assert kernel_dtype(torch.device("cpu")) is torch.bfloat16
        dense = torch.bfloat16 if has_bf16 else torch.float32
        assert dense_dtype(torch.device("cpu")) is dense
        w = _weight(n=32, k=64)
        assert QuantLinear(quantize_int4(w)).compute is torch.bfloat16
        odd = QuantLinear(quantize_int4(w, group=16))
        assert odd.path == "dequantize" and odd.compute is dense


def test_packed_bytes_per_parameter() -> None:
    """int4 g32 holds 0.625 bytes a parameter in memory with bf16 kernel scales (0.75 where
    the host's kernels hold fp32 ones), int8 in groups its codes and float32 scales (1.125),
    per channel ~1."""
    w = _weight(n=256, k=512)
    scale_bytes = kernel_dtype(torch.device("cpu")).itemsize
    int4 = 0.5 + 2 * scale_bytes / 32  # codes, and a scale and a zero per group of 32
    assert QuantLinear(quantize_int4(w)).nbytes() == 256 * 512 * int4
    assert QuantLinear(quantize_int8(w, 32)).nbytes() == 256 * 512 * (1 + 4 / 32)  # as stored
    per_channel = QuantLinear(quantize_int8(w)).nbytes()
    assert per_channel == 256 * 512 + 256 * scale_bytes


def test_cpu_packing_by_row_blocks_equals_one_pack() -> None:
    """Packing PACK_ROWS rows at a time gives the CPU packer's layout of the whole weight
    (what lets a large table pack without a 4-byte copy of all of it)."""
    from shard.model.quant import PACK_ROWS, _cpu_pack, pack_nibbles

    n = PACK_ROWS + 48
    ints = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(5))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints.to(torch.int32), 1)
    assert torch.equal(_cpu_pack(pack_nibbles(ints)), whole)
