"""GGUF blocks kept quantized: each format's codes and scales equal gguf's dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from shard.convert.quant_gguf import STORED_FORMATS, from_gguf
from shard.model.quant import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")

N, K = 16, 512
QUANTIZABLE = [
    T.Q4_0,
    T.Q4_1,
    T.Q8_0,
    T.Q5_0,
    T.Q5_1,
    T.MXFP4,
]  # gguf.quants.quantize can make these
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]  # gguf can only dequantize these: random blocks instead
PATHS = {
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q8_0": "int8-group",
    "Q5_0": "int8-group",
    "Q5_1": "int8-group",
    "Q5_K": "int8-group",
    "Q6_K": "int8-group",  # groups of 16
    "MXFP4": "int8-group",
}
REL_TOL = 1e-2  # one bf16 rounding of the outputs and of the scales (tests/test_quant.py)


def _quantized(qtype: T) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def _random_k_blocks(qtype: T) -> np.ndarray:
    """Random bytes as K-quant blocks, with their f16 super-block scales made small and finite."""
    rng = np.random.default_rng(1)
    size, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // size, block_bytes), dtype=np.uint8)
    for at in (block_bytes - 2,) if qtype is T.Q6_K else (0, 2):
        d = (rng.random((N, K // size)) * 0.01 + 0.001).astype(np.float16)
        raw[:, :, at : at + 2] = d.view(np.uint8).reshape(N, K // size, 2)
    return raw.reshape(N, -1)


def _blocks(qtype: T) -> np.ndarray:
    return _quantized(qtype) if qtype in QUANTIZABLE else _random_k_blocks(qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
def test_representation_is_exact(qtype: T) -> None:
    """scale * code + offset equals gguf.quants.dequantize bit for bit."""
    data = _blocks(qtype)
    q = from_gguf(data, qtype, (N, K))
    assert q is not None
    assert np.array_equal(q.dequantize().numpy(), gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda t: t.name)
def test_packed_product_matches_dequantized(qtype: T) -> None:
    """Each format takes its documented path; its product equals the dequantized weight's
    within one bf16 rounding, and its embedding rows equal the dequantized rows exactly."""
    data = _blocks(qtype)
    q = from_gguf(data, qtype, (N, K))
    assert q is not None
    layer = QuantLinear(q)
    assert layer.path == PATHS[qtype.name]
    ref_w = torch.from_numpy(gguf.quants.dequantize(data, qtype))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    ref = x.to(layer.compute).float() @ ref_w.T
    assert (layer(x) - ref).abs().max() <= REL_TOL * ref.abs().max()
    ids = torch.tensor([5, 0, 7])
    assert torch.equal(QuantEmbedding(q, torch.float32)(ids), ref_w[ids])


def test_mxfp4_extreme_exponents_are_exact() -> None:
    """MXFP4 blocks with every E8M0 exponent (0 and 1 give subnormal float32 scales, 254 the
    largest) and every code: ``scale * code`` equals gguf's dequantization bit for bit."""
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256, dtype=np.uint8)
    raw[255, 0] = 254  # 255 is E8M0's NaN
    data = raw.reshape(N, -1)
    q = from_gguf(data, T.MXFP4, (N, 256 * 32 // N))
    assert q is not None and q.kind == "int8" and q.offset is None
    want = gguf.quants.dequantize(data, T.MXFP4)
    assert np.array_equal(q.dequantize().numpy().view(np.uint32), want.view(np.uint32))


def test_other_types_are_left_to_dequantize() -> None:
    """F32, F16 and the formats without a mapping return None (the loader dequantizes)."""
    assert from_gguf(np.zeros((2, 32), np.float32), T.F32, (2, 32)) is None
    assert from_gguf(np.zeros((2, 84), np.uint8), T.Q2_K, (2, 256)) is None
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= STORED_FORMATS


def test_smollm2_real_tensors() -> None:
    """The bundled SmolLM2's Q4_1 projection and Q8_0 embedding: exact representation, the
    packed product within one bf16 rounding, the embedding gather exact."""
    from shard.convert.bundled import ModelNotFound, _bundled_gguf

    try:
        reader = gguf.GGUFReader(_bundled_gguf("smollm2"))
    except ModelNotFound as e:
        pytest.skip(str(e))
    by_name = {t.name: t for t in reader.tensors}
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        t = by_name[name]
        shape = (int(t.shape[1]), int(t.shape[0]))
        q = from_gguf(t.data, t.tensor_type, shape)
        assert q is not None, name
        ref_w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
        assert torch.equal(q.dequantize(), ref_w), name
        rows = torch.tensor([0, 1, 42, shape[0] - 1])
        assert torch.equal(QuantEmbedding(q, torch.float32)(rows), ref_w[rows]), name
        layer = QuantLinear(q)
        x = torch.randn(2, shape[1], generator=torch.Generator().manual_seed(4))
        ref = x.to(layer.compute).float() @ ref_w.T
        assert (layer(x) - ref).abs().max() <= REL_TOL * ref.abs().max(), name
