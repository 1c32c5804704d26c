"""Loading keeps what is stored: packed checkpoints, the ``weights`` option, split identity."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import pytest
import torch

from fixtures_smollm2 import write_tiny_gguf
from shard.convert.gguf_import import QUANT_METADATA, convert_gguf
from shard.model.config import ModelLoadError
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.quant import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[5, 77, 101, 260, 33, 8, 199, 42]])


def _header(model_dir: Path) -> dict[str, object]:
    raw = (model_dir / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header: dict[str, object] = json.loads(raw[8 : 8 + length])
    return header


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny GGUF (Q8_0, F16 and F32 tensors) converted kept as stored and to float32."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    write_tiny_gguf(root / "tiny.gguf")
    stored = convert_gguf(root / "tiny.gguf", root / "stored", progress=False)
    dense = convert_gguf(root / "tiny.gguf", root / "dense", progress=False, stored=False)
    return stored, dense


def _logits(stages: Sequence[StageModel], steps: int = 3) -> list[torch.Tensor]:
    """Prefill PROMPT through ``stages`` in turn, then ``steps`` greedy single-token steps."""
    caches = [s.new_cache(32) for s in stages]
    x, start, out = PROMPT, 0, []
    for _ in range(steps + 1):
        h = x
        for stage, cache in zip(stages, caches, strict=True):
            h = stage(h, start, cache)
        out.append(h)
        start += x.shape[1]
        x = h[:, -1:].argmax(-1)
    return out


def test_stored_checkpoint_lists_its_quantized_tensors(tiny_ggufs: tuple[Path, Path]) -> None:
    """A stored conversion keeps Q8_0 tensors as int8 codes plus scales; F16/F32 stay float."""
    stored, _ = tiny_ggufs
    header = _header(stored)
    quant = json.loads(header["__metadata__"][QUANT_METADATA])  # type: ignore[index]
    assert quant["model.embed_tokens.weight"] == {"kind": "int8", "group": 32, "shape": [264, 64]}
    assert header["model.embed_tokens.weight"]["dtype"] == "I8"  # type: ignore[index]
    assert "model.embed_tokens.weight.scale" in header
    assert "model.layers.0.self_attn.q_proj.weight" not in quant  # F32 in the GGUF
    assert header["model.norm.weight"]["dtype"] == "F32"  # type: ignore[index]


def test_dense_load_of_stored_equals_float32_conversion(tiny_ggufs: tuple[Path, Path]) -> None:
    """Loading a stored checkpoint as float32 gives the float32 conversion's weights bit for bit."""
    stored, dense = tiny_ggufs
    a = dict(load_stage(stored, 0, 2, weights="float32").named_parameters())
    b = dict(load_stage(dense, 0, 2).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_default_weights_follow_the_checkpoint(
    tiny_ggufs: tuple[Path, Path], tiny_checkpoint: Callable[..., Path]
) -> None:
    """No ``weights``: a checkpoint with quantized tensors loads them as stored (any dtype), a
    float one dense in dtype; a spec without ``weights`` takes the same default, and one that
    names ``weights`` keeps it."""
    from shard.model.weights import checkpoint_weights, resolve_weights
    from shard.nodes.defaults import with_checkpoint_weights
    from shard.spec.swarm import SwarmSpec

    def spec_for(model: Path) -> SwarmSpec:
        data = {
            "swarm": {"name": "x", "model": str(model), "insecure": True},
            "coordinator": {"listen": "127.0.0.1:0"},
            "stage": [{"name": "s0", "listen": "127.0.0.1:0"}],
        }
        return SwarmSpec.from_dict(data, source="x.toml")

    stored, dense = tiny_ggufs
    assert (checkpoint_weights(stored), checkpoint_weights(dense)) == ("stored", None)
    assert resolve_weights(None, stored, torch.bfloat16) == "stored"
    assert resolve_weights(None, dense, torch.bfloat16) == "bfloat16"
    assert resolve_weights("float32", stored, torch.float32) == "float32"
    for dtype in (torch.float32, torch.bfloat16):
        default = load_stage(stored, 0, 2, dtype=dtype)
        assert isinstance(default.embed_tokens, QuantEmbedding)
        assert isinstance(default.layers[0].mlp.down_proj, QuantLinear)
        want = _logits([load_stage(stored, 0, 2, dtype=dtype, weights="stored")], steps=1)
        for a, b in zip(_logits([default], steps=1), want, strict=True):
            assert torch.equal(a, b)
    assert not isinstance(load_stage(dense, 0, 2).embed_tokens, QuantEmbedding)
    float_ckpt = tiny_checkpoint(arch="llama")
    assert checkpoint_weights(float_ckpt) is None
    assert with_checkpoint_weights(spec_for(stored), stored).weights == "stored"
    assert with_checkpoint_weights(spec_for(float_ckpt), float_ckpt).weights is None
    named = attrs.evolve(spec_for(stored), weights="float32")
    assert with_checkpoint_weights(named, stored).weights == "float32"


def test_stored_weights_run_quantized_and_split_bit_identically(
    tiny_ggufs: tuple[Path, Path],
) -> None:
    """weights="stored" holds the Q8_0 tensors packed (the tied head on the embedding's
    table), runs within a bf16 rounding of the dense model, and two stages equal one."""
    stored, _ = tiny_ggufs
    whole = load_stage(stored, 0, 2, weights="stored")
    assert isinstance(whole.embed_tokens, QuantEmbedding)
    assert isinstance(whole.lm_head, QuantLinear)
    assert isinstance(whole.layers[1].mlp.down_proj, QuantLinear)
    split = [load_stage(stored, 0, 1, weights="stored"), load_stage(stored, 1, 2, weights="stored")]
    for a, b in zip(_logits([whole]), _logits(split), strict=True):
        assert torch.equal(a, b)
    dense = _logits([load_stage(stored, 0, 2, weights="float32")], steps=0)[0]
    quant = _logits([whole], steps=0)[0]
    assert (quant - dense).abs().max() <= 0.05 * dense.abs().max()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_float_checkpoint_quantized_at_load_splits_bit_identically(
    tiny_checkpoint: Callable[..., Path], weights: str
) -> None:
    """A float checkpoint quantized at load (int8, int4) gives the same logits split in
    three as whole, tied and untied, and stays near the float model (int8: within 10% of
    the largest logit; int4 on this random 64-wide model only correlates, cosine >= 0.8:
    quality is measured on SmolLM2, docs/model.md)."""
    for tied in (True, False):
        ckpt = tiny_checkpoint(arch="llama", tie_word_embeddings=tied)
        whole = load_stage(ckpt, 0, 4, weights=weights)
        assert isinstance(whole.layers[0].self_attn.q_proj, QuantLinear)
        split = [load_stage(ckpt, a, b, weights=weights) for a, b in ((0, 1), (1, 3), (3, 4))]
        for a, b in zip(_logits([whole]), _logits(split), strict=True):
            assert torch.equal(a, b)
        dense = _logits([load_stage(ckpt, 0, 4)], steps=0)[0].flatten()
        quant = _logits([whole], steps=0)[0].flatten()
        if weights == "int8":
            assert (quant - dense).abs().max() <= 0.1 * dense.abs().max()
        assert torch.nn.functional.cosine_similarity(quant, dense, 0) >= 0.8


def test_qwen2_biases_survive_quantization(tiny_checkpoint: Callable[..., Path]) -> None:
    """A layer with a bias (Qwen2's q/k/v) keeps it when its weight is quantized at load."""
    ckpt = tiny_checkpoint(arch="qwen2", n_layers=5, seed=1)
    stage = load_stage(ckpt, 0, 5, weights="int8")
    q_proj = stage.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.bias is not None
    assert q_proj.bias.device.type == "cpu" and q_proj.bias.abs().sum() > 0


def test_contradictory_weights_and_dtype_are_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    """A float weights value other than dtype is refused in one line saying what to set."""
    ckpt = tiny_checkpoint(arch="llama")
    with pytest.raises(ModelLoadError, match=r"contradicts dtype = 'float32'") as info:
        load_stage(ckpt, 0, 1, weights="bfloat16")
    assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="unknown weights 'int3'"):
        load_stage(ckpt, 0, 1, weights="int3")
    assert load_stage(ckpt, 0, 1, dtype=torch.bfloat16, weights="bfloat16").dtype is torch.bfloat16


def test_manifest_block_includes_scales(tiny_ggufs: tuple[Path, Path]) -> None:
    """A joining stage's block lists the scales of its quantized embedding and head."""
    from shard.weights.build import build_manifest
    from shard.weights.plan import block_tensors

    stored, _ = tiny_ggufs
    manifest = build_manifest(stored, model="tiny", version=1)
    first = block_tensors(manifest, 0, 1)
    assert {"model.embed_tokens.weight", "model.embed_tokens.weight.scale"} <= set(first)
    assert "model.embed_tokens.weight.scale" in block_tensors(manifest, 1, 2)  # the tied head


def test_profile_times_a_layer_in_its_weights_format(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joining node's profile times its scratch layer as its weights hold it: quantized
    linears for stored/int4/int8, dense for a float format or none."""
    from shard.model import profile
    from shard.model.config import ModelConfig

    calls: list[int] = []

    class Spy(profile.QuantLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            out: torch.Tensor = super().forward(x)
            return out

    monkeypatch.setattr(profile, "QuantLinear", Spy)
    config = ModelConfig.from_dir(tiny_checkpoint(arch="llama"))
    for weights, quantized in ((None, False), ("float32", False), ("stored", True), ("int8", True)):
        calls.clear()
        ms = profile.measure_layer_ms(
            config, device=torch.device("cpu"), dtype=torch.float32, rows=(1, 3), repeats=1,
            warmup=0, weights=weights,
        )  # fmt: skip
        assert all(t > 0 for t in ms) and bool(calls) == quantized, weights
