"""gpt-oss's fused experts kept quantized: each expert's product against its dequantized
reference, the whole model against the same model on weights dequantized from the same codes,
row invariance, the bytes ``footprint`` predicts, and a ring equal to the local run.

Only gpt-oss's checkpoint fuses its experts (``[E, in, out]`` tensors): transformers 5 writes
Mixtral's, Qwen3-MoE's and GLM's per expert, so shard loads those as ``Linear`` s and the
loader quantizes them as any linear (``tests/test_model_families.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from safetensors import safe_open
from torch import nn

import family_fixtures
from shard.model.config import ModelConfig
from shard.model.footprint import measured, predict
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.moe import FusedExperts, Router
from shard.model.quant import QuantLinear, kernel_dtype, quantize_int4, quantize_int8
from test_family_ring import ring_spec
from test_quant import REL_TOL
from test_quant_ring import _local, _prompts, _ring

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[5, 77, 101, 260, 33, 8, 199, 42, 42, 7, 3]])
#: Whole-model bound against the dequantized reference with the kernels in float32, relative
#: to the largest logit: only summation order differs. Measured: int8 2.5e-6, int4 2.1e-6.
FP32_TOL = 1e-4


def _quantize(w: torch.Tensor, weights: str) -> torch.Tensor:
    """``w`` ``[out, in]`` through the loader's quantizer and back to float32."""
    return (quantize_int8(w) if weights == "int8" else quantize_int4(w)).dequantize()


def _fused(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every fused expert weight in the checkpoint, by name."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        return {k: f.get_tensor(k) for k in names if k.endswith(("gate_up_proj", "down_proj"))}


def _dequantized_reference(model_dir: Path, weights: str) -> StageModel:
    """The dense float32 model with every weight the loader quantizes replaced by its codes,
    dequantized: linears and embedding as matrices, fused experts expert by expert."""
    model = load_stage(model_dir, 0, 4)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding) and not isinstance(module, Router):
                module.weight.copy_(_quantize(module.weight, weights))
            if isinstance(module, FusedExperts):
                for p in (module.gate_up_proj, module.down_proj):
                    assert p is not None
                    for e in range(p.shape[0]):
                        p[e] = _quantize(p[e].T, weights).T
    return model


def _swiglu(gate_up: torch.Tensor, experts: FusedExperts) -> torch.Tensor:
    """transformers' gpt-oss activation of a biased ``gate_up`` product (gate and up
    interleaved, clamped), written out here as the reference."""
    gate = gate_up[..., ::2].clamp(max=experts.limit)
    up = gate_up[..., 1::2].clamp(-experts.limit, experts.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got - ref).abs().max() <= REL_TOL * ref.abs().max())


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_fused_experts_are_quantized_per_expert(
    family_checkpoint: Callable[[str], Path], weights: str
) -> None:
    """Under int8/int4 each fused weight becomes one QuantLinear per expert (no dense 3-D
    parameter left, biases float32): each product equals the dequantized codes' product
    within test_quant's tolerance, and an expert is exactly bias, interleaved clamped SwiGLU,
    bias around those two products."""
    model_dir = family_checkpoint("gpt_oss")
    stage = load_stage(model_dir, 0, 4, weights=weights)
    fused = _fused(model_dir)
    gen = torch.Generator().manual_seed(3)
    path = "int8-channel" if weights == "int8" else "int4"
    compute = kernel_dtype(torch.device("cpu"))
    for layer, block in enumerate(stage.layers):
        experts = block.mlp.experts
        assert isinstance(experts, FusedExperts)
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert experts.gate_up_q is not None and experts.down_q is not None
        assert experts.gate_up_proj_bias.dtype is torch.float32
        linears = [*experts.gate_up_q, *experts.down_q]
        assert all(isinstance(q, QuantLinear) and q.path == path for q in linears)
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = fused[prefix + "gate_up_proj"], fused[prefix + "down_proj"]
        for e in range(gate_up.shape[0]):
            x = torch.randn(6, 64, generator=gen)
            gu = experts.gate_up_q[e](x)
            assert _close(gu, x.to(compute).float() @ _quantize(gate_up[e].T, weights).T)
            h = _swiglu(gu + experts.gate_up_proj_bias[e], experts)
            out = experts.down_q[e](h)
            assert _close(out, h.to(compute).float() @ _quantize(down[e].T, weights).T)
            assert torch.equal(experts.run(e, x), out + experts.down_proj_bias[e])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_model_matches_its_dequantized_reference(
    family_checkpoint: Callable[[str], Path],
    weights: str,
    monkeypatch: pytest.MonkeyPatch,
    report: Callable[[str], None],
) -> None:
    """gpt-oss at int8/int4, its kernels run in float32, gives the logits of the same model
    run densely on weights dequantized from the same codes within FP32_TOL of the largest
    logit (and not the float model's: quantization moved them ~40 times further)."""
    # bf16 on every host by default (kernel_dtype), and the layers the kernels cannot take
    # (dequantized per call) in bf16 on a host with bf16 instructions (dense_dtype); in
    # float32 the packing is checked alone
    monkeypatch.setattr("shard.model.quant.kernel_dtype", lambda device: torch.float32)
    monkeypatch.setattr("shard.model.quant.dense_dtype", lambda device: torch.float32)
    model_dir = family_checkpoint("gpt_oss")
    quant = load_stage(model_dir, 0, 4, weights=weights)
    assert all(m.compute is torch.float32 for m in quant.modules() if isinstance(m, QuantLinear))
    ref_model = _dequantized_reference(model_dir, weights)
    float_model = load_stage(model_dir, 0, 4)
    got, ref, plain = (m(PROMPT, 0, m.new_cache(32)) for m in (quant, ref_model, float_model))
    scale = ref.abs().max()
    err, moved = (got - ref).abs().max() / scale, (plain - ref).abs().max() / scale
    report(f"gpt-oss {weights}, fp32 kernels: |logits - ref| {err:.1e} of max (float {moved:.1e})")
    assert err <= FP32_TOL
    assert moved > 100 * FP32_TOL  # the reference really is the quantized model


def test_bf16_kernels_stay_within_bf16_noise(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """With the host's kernels (bf16 where the CPU has bf16), gpt-oss at int4 is no further
    from its dequantized reference than the float model computed in bf16 is from float32
    (measured 0.46 against 1.89, the largest logit ~10)."""
    model_dir = family_checkpoint("gpt_oss")
    quant = load_stage(model_dir, 0, 4, weights="int4")
    ref_model = _dequantized_reference(model_dir, "int4")
    got, ref = (m(PROMPT, 0, m.new_cache(32)) for m in (quant, ref_model))
    dense = load_stage(model_dir, 0, 4)
    half = load_stage(model_dir, 0, 4, dtype=torch.bfloat16)
    noise = half(PROMPT, 0, half.new_cache(32)).float() - dense(PROMPT, 0, dense.new_cache(32))
    err, bound = (got - ref).abs().max(), noise.abs().max()
    report(f"gpt-oss int4, host kernels: |logits - ref| {err:.3f}, bf16 noise {bound:.3f}")
    assert err <= bound


def test_quantized_expert_rows_are_batch_invariant(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """A row through a quantized expert has the same bits alone as among 9 rows, in bf16
    and in float32 activations (the batched path does not change a session's output)."""
    stage = load_stage(family_checkpoint("gpt_oss"), 0, 4, weights="int4")
    experts = stage.layers[2].mlp.experts
    assert isinstance(experts, FusedExperts)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
        for e in range(4):
            together = experts.run(e, x)
            for i in range(9):
                assert torch.equal(experts.run(e, x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_footprint_prices_quantized_experts(
    family_checkpoint: Callable[[str], Path], weights: str
) -> None:
    """``predict`` counts the fused experts as the loader installs them, to the byte, and
    leaves none of their bytes among the unquantized."""
    model_dir = family_checkpoint("gpt_oss")
    config = ModelConfig.from_dir(model_dir)
    bf16 = kernel_dtype(torch.device("cpu")) is torch.bfloat16
    footprint = predict(config, weights, bf16_kernels=bf16)
    assert measured(load_stage(model_dir, 1, 3, weights=weights)) == footprint.stage(1, 3)
    d, f, e = config.hidden_size, config.moe.expert_size, config.moe.n_experts  # type: ignore[union-attr]
    assert footprint.unquantized == 4 * 4 * (e * d + e * 2 * f + e * d)  # routers, biases


@pytest.mark.parametrize("weights", ["int8", "int4"])
async def test_gpt_oss_quantized_ring_equals_local(
    family_checkpoint: Callable[[str], Path], weights: str
) -> None:
    """gpt-oss quantized at load runs through a 3-stage ring exactly as locally, 8 sessions
    at once, plain and speculative."""
    model_dir = family_checkpoint("gpt_oss")
    spec = attrs.evolve(ring_spec(model_dir), weights=weights)  # the n-gram drafter
    prompts = _prompts(8)
    want = [r.token_ids for r in _local(model_dir, weights, prompts, 16)]
    for k in (0, 3):
        assert await _ring(spec, model_dir, prompts, 16, k) == want, f"k={k}"
