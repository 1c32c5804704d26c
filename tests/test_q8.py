"""The q8 product (``shard.model.q8``, issue 42): an int8 weight in groups, packed once, times
rows rounded to 16-bit integers per group, in one stated order. The compiled kernel, in every
version this CPU runs, gives the torch reference's bytes; a row's bytes never depend on the
other rows or the thread count; the packed table reads back as stored; a tied head shares the
embedding's table."""

from __future__ import annotations

import logging

import pytest
import torch

from shard.model import q8
from shard.model.native_build import build
from shard.model.quant import QuantLinear, quantize_int8

#: Shapes (outputs, inputs, rows, group, offsets): GGUF's groups of 32 (the unrolled kernel)
#: and others up to 256, output counts not a multiple of the 16-output block (a narrower last
#: block), 1 to 17 rows (the AVX-512 version tiles rows up to 8).
SHAPES = [
    (37, 64, 1, 32, False),
    (64, 640, 9, 32, True),
    (5, 96, 17, 32, False),
    (33, 128, 3, 64, True),
    (16, 256, 8, 128, False),
    (7, 48, 2, 16, True),
    (100, 512, 9, 256, False),
]


def _ext():  # type: ignore[no-untyped-def]
    ext = build()
    if isinstance(ext, str):
        pytest.skip(f"no native extension here: {ext}")
    return ext


def _weight(n: int, k: int, group: int, offsets: bool, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.02
    offset = torch.randn(n, k // group, generator=gen) * 0.1 if offsets else None
    return codes, scale, offset


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns, every NaN as one (NaN payloads are not part of the order)."""
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


@pytest.mark.parametrize(("n", "k", "rows", "group", "offsets"), SHAPES)
def test_every_kernel_version_gives_the_reference_bytes(
    n: int, k: int, rows: int, group: int, offsets: bool
) -> None:
    ext = _ext()
    codes, scale, offset = _weight(n, k, group, offsets, seed=n * k)
    weight = q8.Int8Group(codes, scale, offset, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = q8.reference(x, codes, scale, offset, group)
    for isa in range(ext.q8_best() + 1):  # plain C++, AVX2, AVX-512 VNNI as the CPU has them
        got = q8.q8_mm(x, weight, isa)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), isa
    # and it is the product up to the rows' 16-bit rounding (half a step of 32767 per group,
    # summed over the groups): against float64 on the float weight
    w = codes.double().view(n, k // group, group) * scale.double()[:, :, None]
    if offset is not None:
        w = w + offset.double()[:, :, None]
    exact = x.double() @ w.view(n, k).T
    err = (want.double() - exact).abs().max() / exact.abs().max()
    assert 0 < err < 1e-4, err


def test_the_rows_round_as_stated() -> None:
    """Half-way values round to even, NaN to 0, a group of zeros to zeros with scale 0, and a
    group's largest value to +-32767 (16-bit integers)."""
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([32767.0, 0.5, 1.5, -2.5, float("nan")])
    q, d = q8.quantize_rows(torch.cat([x, torch.zeros(1, 32)], 1), 32)
    assert q.dtype == torch.int16
    assert torch.isnan(d[0, 0]) and d[0, 1] == 0 and not q[0, 32:].any()
    y = torch.zeros(1, 32)
    y[0, :4] = torch.tensor([-32767.0, 0.5, 1.5, -2.5])
    q, d = q8.quantize_rows(y, 32)
    assert d[0, 0] == 1 and q[0, :4].tolist() == [-32767, 0, 2, -2]


def test_hostile_values_compute_as_the_reference() -> None:
    """NaN, infinities, float32's largest and subnormal values in the rows and the scales:
    the same bits as the reference (NaN for NaN), in every version."""
    ext = _ext()
    codes, scale, offset = _weight(24, 64, 32, True, seed=3)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    x[0, 3], x[1, 40], x[2, 7], x[3, 0] = float("nan"), float("inf"), 3e38, 1e-40
    scale[5, 1], scale[6, 0], offset[7, 1] = float("inf"), 1e-42, -3e38
    weight = q8.Int8Group(codes, scale, offset, 32)
    want = q8.reference(x, codes, scale, offset, 32)
    assert want.isnan().any() and want.isinf().any()
    for isa in range(ext.q8_best() + 1):
        got = q8.q8_mm(x, weight, isa)
        assert torch.equal(_bits(got), _bits(want)), isa


def test_a_rows_bytes_never_depend_on_its_neighbours_or_the_threads() -> None:
    _ext()
    codes, scale, offset = _weight(300, 640, 32, False, seed=7)
    weight = q8.Int8Group(codes, scale, offset, 32)
    x = torch.randn(13, 640, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q8.q8_mm(x, weight)
        torch.set_num_threads(2)
        two = q8.q8_mm(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    alone = torch.cat([q8.q8_mm(x[i : i + 1], weight) for i in range(13)])
    assert torch.equal(alone.view(torch.int32), one.view(torch.int32))


def test_the_packed_table_reads_back_as_stored() -> None:
    """Codes, scales, offsets and ``dequantize`` of any rows (in the narrower last block
    too) equal the stored weight's, so an embedding can share the table; stacking by row
    packs the parts' rows in order."""
    codes, scale, offset = _weight(37, 64, 32, True, seed=5)
    weight = q8.Int8Group(codes, scale, offset, 32)
    assert weight.nbytes() == codes.numel() + 2 * 4 * scale.numel()  # the stored sizes
    rows = torch.tensor([36, 0, 17, 32, 15, 16])
    assert torch.equal(weight.codes(rows), codes[rows])
    assert torch.equal(weight.scales(rows), scale[rows])
    got_offsets = weight.offsets(rows)
    assert got_offsets is not None and torch.equal(got_offsets, offset[rows])
    stored = q8.Int8Group(codes, scale, offset, 32)
    from shard.model.quant import Quantized

    want = Quantized("int8", codes, scale, offset, 32).dequantize(rows, torch.bfloat16)
    assert torch.equal(stored.dequantize(rows, torch.bfloat16), want)
    both = q8.Int8Group.stacked([weight, q8.Int8Group(codes[:5], scale[:5], offset[:5], 32)])
    assert torch.equal(both.codes(), torch.cat([codes, codes[:5]]))


def test_without_the_extension_torch_gives_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: ``q8_mm`` runs the reference (the same bytes) and warns once."""
    codes, scale, offset = _weight(40, 96, 32, True, seed=9)
    weight = q8.Int8Group(codes, scale, offset, 32)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(10))
    compiled = q8.q8_mm(x, weight)
    monkeypatch.setattr(q8, "build", lambda: "no C++ compiler ('c++' is not on PATH)")
    q8._fallback_warning.cache_clear()
    with caplog.at_level(logging.WARNING, logger="shard.model.q8"):
        slow = q8.q8_mm(x, weight)
    q8._fallback_warning.cache_clear()
    assert torch.equal(slow.view(torch.int32), compiled.view(torch.int32))
    assert "no C++ compiler" in caplog.text and "same bytes" in caplog.text


def test_bad_shapes_are_a_typed_error_not_a_crash() -> None:
    ext = _ext()
    codes, scale, _ = _weight(8, 64, 32, False, seed=11)
    weight = q8.Int8Group(codes, scale, None, 32)
    packed, packed_scale = weight.packed, weight.scale
    x = torch.randn(2, 64)
    none = scale.new_empty(0)
    with pytest.raises(RuntimeError, match="group"):
        ext.q8_mm(x, packed, packed_scale, none, 24, -1)  # not a multiple of 16
    with pytest.raises(RuntimeError, match="group"):
        ext.q8_mm(x, packed, packed_scale, none, 512, -1)  # wider than 256
    with pytest.raises(RuntimeError, match="packed codes"):
        ext.q8_mm(x, codes, packed_scale, none, 32, -1)  # int8, not the packed uint8
    with pytest.raises(RuntimeError, match="scales"):
        ext.q8_mm(x, packed, packed_scale[:, :1].contiguous(), none, 32, -1)
    with pytest.raises(RuntimeError, match="offsets"):
        ext.q8_mm(x, packed, packed_scale, none[:0].new_zeros(3), 32, -1)
    with pytest.raises(RuntimeError, match="rows"):
        ext.q8_mm(x.double(), packed, packed_scale, none, 32, -1)
    with pytest.raises(RuntimeError, match="group"):  # no columns: nothing to sum
        ext.q8_mm(x[:, :0], packed[:, :0], packed_scale[:, :0], none, 32, -1)
    with pytest.raises(ValueError, match="does not fit"):
        q8.Int8Group(codes[:0], scale[:0], None, 32)  # no outputs


def test_a_quant_linear_runs_int8_groups_packed() -> None:
    """``QuantLinear`` takes the path on a CPU and gives ``q8_mm``'s bytes, the input's dtype
    out (a bf16 row is widened first)."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(12))
    q = quantize_int8(w, group=32)
    layer = QuantLinear(q)
    assert layer.path == "int8-group" and layer.compute == torch.float32
    x = torch.randn(2, 3, 64)
    want = q8.reference(x.view(6, 64), q.codes, q.scale, None, 32).view(2, 3, 48)
    assert torch.equal(layer(x), want)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_a_tied_head_shares_the_embedding_table(smollm2_dir) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2's Q8_0 head is its embedding table: one packed copy, which the embedding reads
    (the same rows as the table as stored)."""
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage
    from shard.model.quant import QuantEmbedding

    n = ModelConfig.from_dir(smollm2_dir).n_layers
    stage = load_stage(smollm2_dir, 0, n, weights="stored")
    assert isinstance(stage.embed_tokens, QuantEmbedding) and stage.lm_head is not None
    assert stage.lm_head.path == "int8-group"
    head = stage.lm_head._parts[0]
    assert stage.embed_tokens.q is head
    alone = load_stage(smollm2_dir, 0, 1, weights="stored")  # the embedding without the head
    assert alone.embed_tokens is not None
    ids = torch.tensor([[0, 1, 2, 49151, 12345]])
    assert torch.equal(stage.embed_tokens(ids), alone.embed_tokens(ids))


def test_a_large_packed_table_asks_for_huge_pages() -> None:
    """Where Linux gives transparent huge pages (``always`` or ``madvise``), the packed codes
    of a table over 2 MiB are advised before they are written; the advice changes no value."""
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this host")
    fresh = torch.empty(8 << 20, dtype=torch.uint8)
    assert q8.huge_pages(fresh)
    assert not q8.huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # no whole huge page
    codes, scale, _ = _weight(4096, 1024, 32, False, seed=13)
    weight = q8.Int8Group(codes, scale, None, 32)
    assert torch.equal(weight.codes(), codes)
