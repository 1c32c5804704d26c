"""FP8 block-scaled weights (DeepSeek-V3's ``weight_scale_inv`` layout) load as stored, one
byte a weight, exactly as transformers dequantizes them; splits equal the unsplit model; the
footprint prices what loads; malformed FP8 checkpoints are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.test_model_split import greedy_tokens, run_ring
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from shard.model.config import ModelConfig, ModelLoadError
from shard.model.footprint import measured, stored
from shard.model.fp8 import dequantize_fp8, fp8_weight, quantize_fp8
from shard.model.loader import load_stage
from shard.model.quant import Quantized, QuantLinear, dense_dtype, kernel_dtype
from shard.testing.checkpoints import make_tiny_checkpoint

BLOCK = (16, 32)
PROMPT = torch.tensor([[5, 77, 101, 260, 33, 8, 199, 42]])
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_dequantization_equals_transformers_bit_for_bit() -> None:
    """``dequantize_fp8`` is transformers' Fp8Dequantize in float32, bit for bit, and the
    stored form (``Quantized`` of kind fp8) dequantizes to the same bits."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=gen) * 0.05
    codes, scale_inv = quantize_fp8(w, (128, 128))
    assert codes.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    ours = dequantize_fp8(codes, scale_inv, (128, 128))
    theirs = Fp8Dequantize(None)._dequantize_one(codes, scale_inv, torch.float32)
    assert torch.equal(ours, theirs)
    q = fp8_weight(codes, scale_inv, (128, 128))
    assert isinstance(q, Quantized) and q.kind == "fp8"
    assert torch.equal(q.dequantize(), ours)
    # e4m3 keeps 3 mantissa bits (half an ulp: 2^-4 relative); its subnormals step 2^-9
    assert torch.allclose(ours, w, rtol=2**-4, atol=float(scale_inv.max()) * 2**-9)


def test_blocks_that_do_not_divide_the_weight() -> None:
    """Edge blocks (N, K not multiples of the block) take their own scale, as DeepSeek's
    dequantization does; a K off the block is kept dense."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    codes, scale_inv = quantize_fp8(w, (128, 128))
    assert scale_inv.shape == (2, 3)
    out = dequantize_fp8(codes, scale_inv, (128, 128))
    for n, k in ((0, 0), (127, 255), (128, 256), (199, 299)):
        assert out[n, k] == codes[n, k].float() * scale_inv[n // 128, k // 128]
    dense = fp8_weight(codes, scale_inv, (128, 128))
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, out)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_weight(codes, scale_inv[:1], (128, 128))


def _fp8_checkpoint(root: Path) -> tuple[Path, Path]:
    """A tiny Llama whose layer linears are FP8 (block 16x32), and its float twin holding the
    dequantized weights (what transformers computes with)."""
    src = make_tiny_checkpoint(root / "float", n_layers=4, seed=3)
    tensors = load_file(src / "model.safetensors")
    fp8: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in LINEARS):
            codes, scale_inv = quantize_fp8(t, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = codes, scale_inv
            twin[name] = dequantize_fp8(codes, scale_inv, BLOCK)
        else:
            fp8[name] = twin[name] = t
    out = {}
    for kind, content in (("fp8", fp8), ("twin", twin)):
        d = root / kind
        d.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(content, d / "model.safetensors")
        out[kind] = d
    config = json.loads((out["fp8"] / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (out["fp8"] / "config.json").write_text(json.dumps(config))
    return out["fp8"], out["twin"]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def test_a_stored_fp8_stage_holds_one_byte_a_weight(fp8_dirs: tuple[Path, Path]) -> None:
    """By default an FP8 checkpoint loads stored: every FP8 linear keeps its e4m3 codes (one
    byte a weight) and block scales, and the footprint prices the stage exactly."""
    fp8, _ = fp8_dirs
    stage = load_stage(fp8, 0, 4)
    layers = [m for m in stage.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * len(LINEARS)
    for layer in layers:
        assert layer.path == "dequantize" and layer.q is not None and layer.q.kind == "fp8"
        n, k = layer.q.shape
        assert layer.q.codes.dtype == torch.float8_e4m3fn and layer.q.codes.nbytes == n * k
    bf16 = kernel_dtype(torch.device("cpu")) is torch.bfloat16
    predicted = stored(ModelConfig.from_dir(fp8), fp8, bf16_kernels=bf16)
    assert predicted is not None
    assert predicted.stage(0, 4) == measured(stage)
    for first, last in ((0, 1), (1, 3), (3, 4)):
        assert predicted.stage(first, last) == measured(load_stage(fp8, first, last))


def test_fp8_logits_equal_transformers_on_the_dequantized_weights(
    fp8_dirs: tuple[Path, Path],
) -> None:
    """shard's float32 load of the FP8 checkpoint is within 1e-4 of transformers holding the
    dequantized weights, greedy ids identical; the stored load computes the same logits:
    within 5e-2 where its per-call products run in float32 (``dense_dtype``), and on a host
    that multiplies bf16 natively no further from them than the float model run in bf16
    is (measured on an AMX host: 0.24 against 0.37, the largest logit ~12)."""
    from transformers import AutoModelForCausalLM

    fp8, twin = fp8_dirs
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(PROMPT).logits
    dense = load_stage(fp8, 0, 4, weights="float32")
    got = dense(PROMPT, 0, dense.new_cache(32))
    assert (got - want).abs().max() < 1e-4
    steps = greedy_tokens(dense, PROMPT, 6)
    with torch.no_grad():
        theirs = ref.generate(PROMPT, max_new_tokens=6, do_sample=False)
    assert torch.equal(steps, theirs[:, : steps.shape[1]])
    kept = load_stage(fp8, 0, 4)
    got_kept = kept(PROMPT, 0, kept.new_cache(32))
    if dense_dtype(torch.device("cpu")) is torch.float32:
        assert (got_kept - got).abs().max() < 5e-2
    else:  # bf16 products: the float model's own bf16 rounding is the bound
        half = load_stage(fp8, 0, 4, dtype=torch.bfloat16, weights="bfloat16")
        noise = (half(PROMPT, 0, half.new_cache(32)).float() - got).abs().max()
        assert (got_kept - got).abs().max() <= noise


def test_every_split_of_a_stored_fp8_model_is_bit_identical(fp8_dirs: tuple[Path, Path]) -> None:
    """Blocks [0,1) [1,3) [3,4) of the stored FP8 model equal the unsplit one, bit for bit."""
    fp8, _ = fp8_dirs
    tokens = torch.cat([PROMPT, torch.tensor([[9, 1, 250]])], dim=1)
    full = run_ring([load_stage(fp8, 0, 4)], tokens, PROMPT.shape[1])
    split = run_ring([load_stage(fp8, a, b) for a, b in ((0, 1), (1, 3), (3, 4))], tokens, 8)
    for a, b in zip(full, split, strict=True):
        assert torch.equal(a, b)


def _rewrite(fp8: Path, tmp_path: Path, edit: Any) -> Path:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in fp8.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    edit(bad)
    return bad


def _drop_scale(d: Path) -> None:
    t = load_file(d / "model.safetensors")
    del t["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(t, d / "model.safetensors")


def _wrong_scale(d: Path) -> None:
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(t, d / "model.safetensors")


def _no_block(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    del c["quantization_config"]
    (d / "config.json").write_text(json.dumps(c))


def _other_method(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 32]}
    (d / "config.json").write_text(json.dumps(c))


def _bad_block(d: Path) -> None:
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"]["weight_block_size"] = [0, 128]
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_drop_scale, "weight_scale_inv"),
        (_wrong_scale, "weight_scale_inv"),
        (_no_block, "quantization_config"),
        (_other_method, "fmt must be 'e4m3'"),
        (_bad_block, "weight_block_size"),
    ],
)
def test_a_malformed_fp8_checkpoint_is_one_line(
    fp8_dirs: tuple[Path, Path], tmp_path: Path, edit: Any, words: str
) -> None:
    """A missing or misshapen scale, no block size, another FP8 format: one line."""
    bad = _rewrite(fp8_dirs[0], tmp_path, edit)
    with pytest.raises(ModelLoadError) as err:
        load_stage(bad, 0, 4)
    assert "\n" not in str(err.value) and words in str(err.value)
