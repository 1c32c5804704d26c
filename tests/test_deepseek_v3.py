"""DeepSeek-V3 (multi-head latent attention + DeepSeekMoE) against transformers' own model.

Two tiny checkpoints built by transformers' ``DeepseekV3Config`` / ``DeepseekV3ForCausalLM``
from a fixed seed and saved by ``save_pretrained`` (``family_fixtures``): ``deepseek_v3``
(low-rank query, interleaved rope, YaRN with ``mscale`` != ``mscale_all_dim``) and
``deepseek_v3_plain_q`` (``q_lora_rank`` null, rotate-half rope, no scaling); both have two
dense layers then two DeepSeekMoE layers (8 experts in 2 groups, 1 shared), a value head
narrower than the key head and an ``rms_norm_eps`` unlike the latent norms' 1e-6.

shard attends with the up-projection absorbed into the query and the output
(``shard.model.mla``); transformers expands the latent into keys and values. Measured (torch
2.13 CPU, float32): logits within 1.5e-5 and 6.2e-5 of transformers' (std ~3.3). ``ATOL``
1e-4 leaves room for that reordering and still fails on each slip measured on
``deepseek_v3``'s prefill: the softmax scale without mscale_all_dim moves logits by 4.3,
rotate-half instead of interleaved rope by 9.1, YaRN's plain cos/sin factor by 4.2, the
latent norms at the config's epsilon (1e-5) instead of 1e-6 by 1.6e-4. The family tests
(``test_model_families``, ``test_family_ring``, ``test_footprint``) run ``deepseek_v3`` too.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import family_fixtures
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.footprint import measured, predict, stored
from shard.model.loader import load_stage
from shard.model.mla import KvUp, MLAttention
from shard.model.quant import QuantLinear, kernel_dtype, quantize_int4, quantize_int8
from shard.stage.chunks import kv_refusal
from test_model_split import bounds_for, greedy_tokens, run_ring
from test_model_vs_transformers import hf_greedy, shard_greedy

transformers = pytest.importorskip("transformers")
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
VARIANTS = ["deepseek_v3", "deepseek_v3_plain_q"]
BATCH = ([5, 77, 101, 260, 33, 8, 199, 42, 42, 7, 3], [9, 1, 250, 66, 12, 180, 97, 4, 4, 120, 31])
LONG = [(13 * i + 7) % 260 + 1 for i in range(21)]
SPECS = Path(__file__).resolve().parents[1] / "specs" / "models"


def load_hf(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_match_transformers(
    family_checkpoint: Callable[[str], Path], variant: str, report: Callable[[str], None]
) -> None:
    """A batch prefill's logits within ATOL of transformers'; greedy ids identical over two
    prompts, each step's logits within ATOL."""
    model_dir = family_checkpoint(variant)
    config = ModelConfig.from_dir(model_dir)
    ours, hf = load_stage(model_dir, 0, config.n_layers), load_hf(model_dir)
    ids = torch.tensor(BATCH)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ours(ids, 0, ours.new_cache(32, batch=2))
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    worst = float((got - want).abs().max())
    for prompt in (BATCH[0], LONG):
        our_ids, our_logits = shard_greedy(ours, prompt, 16)
        hf_ids, hf_logits = hf_greedy(hf, prompt, 16)
        assert our_ids == hf_ids, prompt
        torch.testing.assert_close(our_logits, hf_logits, rtol=0, atol=ATOL)
        worst = max(worst, float((our_logits - hf_logits).abs().max()))
    report(f"{variant}: max |logit diff| vs transformers {worst:.2g}")


def test_the_cache_holds_transformers_latent(family_checkpoint: Callable[[str], Path]) -> None:
    """After a prefill, each layer's cache holds the normed latent and the rotated shared
    key transformers' own cache holds (and nothing wider), within float noise."""
    model_dir = family_checkpoint("deepseek_v3")
    config = ModelConfig.from_dir(model_dir)
    ours, hf = load_stage(model_dir, 0, config.n_layers), load_hf(model_dir)
    ids = torch.tensor(BATCH[:1])
    cache = ours.new_cache(16)
    ours(ids, 0, cache)
    with torch.no_grad():
        past = hf(input_ids=ids, use_cache=True).past_key_values
    n = ids.shape[1]
    for layer in range(config.n_layers):
        theirs = past.layers[layer]
        torch.testing.assert_close(cache.k[layer, :, :, :n], theirs.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.v[layer, :, :, :n], theirs.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_split_is_identical(family_checkpoint: Callable[[str], Path], variant: str) -> None:
    """Blocks cut at every point, run in turn, equal the unsplit model bit for bit."""
    model_dir = family_checkpoint(variant)
    n_layers = ModelConfig.from_dir(model_dir).n_layers
    full = load_stage(model_dir, 0, n_layers)
    tokens = greedy_tokens(full, torch.tensor(BATCH), 4)
    expected = run_ring([full], tokens, len(BATCH[0]))
    for bounds in bounds_for(n_layers):
        stages = [load_stage(model_dir, a, b) for a, b in itertools.pairwise(bounds)]
        got = run_ring(stages, tokens, len(BATCH[0]))
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(g, e), f"{variant}: split {bounds} differs at step {step}"


def _chunk_and_steps(model: Any, prompt: list[int], draft: list[int]) -> tuple[Any, Any]:
    """The logits of ``draft`` as one verify chunk, and as ``len(draft)`` decode steps, each
    after the same prefill of ``prompt`` into a cache of its own."""
    n = len(prompt)
    a, b = model.new_cache(64), model.new_cache(64)
    model(torch.tensor([prompt]), 0, a)
    model(torch.tensor([prompt]), 0, b)
    chunk = model(torch.tensor([draft]), n, a)[0]  # [K, V]
    steps = torch.cat([model(torch.tensor([[t]]), n + i, b)[0] for i, t in enumerate(draft)])
    return chunk, steps


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_verify_chunk_equals_its_decode_steps(
    family_checkpoint: Callable[[str], Path], variant: str, report: Callable[[str], None]
) -> None:
    """A chunk of 6 rows gives its 6 decode steps' logits: within float noise in float32
    (the dense products see 6 rows, not 1; greedy ids equal), bit for bit with int8 weights
    (``rowwise``: each row runs its decode step's own ops, the absorbed products included)."""
    model_dir = family_checkpoint(variant)
    draft = [44, 45, 46, 47, 48, 49]
    dense = load_stage(model_dir, 0, 4)
    chunk, steps = _chunk_and_steps(dense, LONG, draft)
    worst = float((chunk - steps).abs().max())
    assert worst < 1e-4 and torch.equal(chunk.argmax(-1), steps.argmax(-1))
    quant = load_stage(model_dir, 0, 4, weights="int8")
    assert all(m.rowwise for m in quant.modules() if isinstance(m, MLAttention))
    chunk, steps = _chunk_and_steps(quant, LONG, draft)
    assert torch.equal(chunk, steps)
    report(f"{variant}: verify chunk vs decode steps: fp32 {worst:.2g}, int8 bit-identical")


def test_static_positions_and_rollback(family_checkpoint: Callable[[str], Path]) -> None:
    """``forward_at`` (the CUDA-graph path: positions as a tensor, the whole cache under a
    mask) gives ``forward``'s logits and latents; a rejected chunk past the frontier leaves no
    trace in the next step on either path (rollback by overwrite)."""
    model = load_stage(family_checkpoint("deepseek_v3"), 0, 2)  # the dense MLA layers
    a, b = model.new_cache(48), model.new_cache(48)
    x, n = torch.tensor([LONG]), len(LONG)
    torch.testing.assert_close(model(x, 0, a), model.forward_at(x, torch.arange(n), b))
    clean_a, clean_b = a.k.clone(), b.k.clone()
    model(torch.tensor([[250, 1, 77, 3]]), n, a)  # a rejected draft
    model.forward_at(torch.tensor([[250, 1, 77, 3]]), torch.arange(n, n + 4), b)
    step = torch.tensor([[42]])
    fresh = model.new_cache(48)
    model(x, 0, fresh)
    want = model(step, n, fresh)
    assert torch.equal(model(step, n, a), want)
    torch.testing.assert_close(model.forward_at(step, torch.arange(n, n + 1), b), want)
    torch.testing.assert_close(a.k[:, :, :, :n], clean_a[:, :, :, :n], rtol=0, atol=0)
    torch.testing.assert_close(b.k[:, :, :, :n], clean_b[:, :, :, :n], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_per_token_is_the_latent(
    family_checkpoint: Callable[[str], Path], dtype: torch.dtype
) -> None:
    """A layer caches kv_lora_rank + qk_rope_head_dim numbers a position (32 + 8), not
    2 x heads x head widths; footprint's KV pricing and the stage's KV admission agree."""
    model_dir = family_checkpoint("deepseek_v3")
    config = ModelConfig.from_dir(model_dir)
    assert config.mla is not None
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = (config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * elem
    stage = load_stage(model_dir, 1, 3, dtype=dtype)
    cache = stage.new_cache(100)
    assert cache.nbytes == 2 * 100 * per_layer
    footprint = predict(config, "bfloat16" if dtype == torch.bfloat16 else "float32")
    assert abs(footprint.kv(1, 3, 100) - cache.nbytes) <= 0.05 * cache.nbytes
    assert footprint.kv_token == (per_layer,) * config.n_layers
    assert kv_refusal(stage, 100, 0, cache.nbytes) is None
    assert kv_refusal(stage, 101, 0, cache.nbytes) is not None


def test_int8_keeps_kv_b_proj_dense_and_quantizes_the_rest(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """weights="int8" quantizes every MLA projection but kv_b_proj (a dense matrix the
    absorbed products read per head) and every expert; the greedy run stays close to float."""
    model_dir = family_checkpoint("deepseek_v3")
    stage = load_stage(model_dir, 0, 4, weights="int8")
    attn = [m for m in stage.modules() if isinstance(m, MLAttention)]
    assert len(attn) == 4
    for m in attn:
        assert isinstance(m.kv_b_proj, KvUp) and m.kv_b_proj.weight.dtype == torch.float32
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            assert isinstance(getattr(m, name), QuantLinear), name
    assert sum(isinstance(m, QuantLinear) for m in stage.modules()) > 4 * 4 + 2 * 8 * 3
    ids, _ = shard_greedy(stage, BATCH[0], 8)
    want, _ = shard_greedy(load_stage(model_dir, 0, 4), BATCH[0], 8)
    assert ids[:2] == want[:2]


def stored_copy(src: Path, dst: Path) -> Path:
    """``src`` with every 2-D layer weight and the head kept quantized as ``shard convert``
    keeps one (codes, ``.scale``, ``.offset``, ``shard.quant`` metadata): int4 g32 where the
    int4 kernel takes the shape, int8 per channel elsewhere, routers and ``kv_b_proj``
    included. (An int4 shape no kernel takes runs dequantized per call, a float product
    whose rows are not row-invariant; so is a float head: a chunk would then differ from its
    steps in the last bits, in every family.)"""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors, out, quant = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in tensors.items():
        if not name.startswith(("model.layers.", "lm_head.")) or t.dim() != 2:
            out[name] = t
            continue
        int4 = t.shape[1] % 32 == 0 and t.shape[0] % 16 == 0  # the int4 kernel's shapes
        q = quantize_int4(t) if int4 else quantize_int8(t)
        out[name], out[f"{name}.scale"] = q.codes, q.scale
        if q.offset is not None:
            out[f"{name}.offset"] = q.offset
        quant[name] = {"kind": q.kind, "group": q.group, "shape": list(t.shape)}
    save_file(out, str(dst / "model.safetensors"), metadata={"shard.quant": json.dumps(quant)})
    return dst


def test_stored_weights_load_run_and_are_priced(
    family_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A checkpoint kept quantized (``weights = "stored"``): every MLA and expert linear runs
    stored, kv_b_proj and the routers are installed dense from their codes, the logits stay
    within 2 % of the largest of the same codes run densely, a verify chunk equals its decode
    steps bit for bit, and ``footprint.stored`` prices each stage to the byte. The packed
    kernels take bf16 activations (``kernel_dtype``), so the bound is bf16's 5 % (measured
    2.1 %, 0.25 of 11.8; 2 % held while this CPU ran them in float32)."""
    path = stored_copy(family_checkpoint("deepseek_v3"), tmp_path / "stored")
    config = ModelConfig.from_dir(path)
    stage = load_stage(path, 0, 4)  # the default for a quantized checkpoint: stored
    kv_b = [m for m in stage.modules() if isinstance(m, KvUp)]
    assert len(kv_b) == 4 and all(m.weight.dtype == torch.float32 for m in kv_b)
    assert sum(isinstance(m, QuantLinear) for m in stage.modules()) > 4 * 4 + 2 * 8 * 3
    dense = load_stage(path, 0, 4, weights="float32")  # the codes dequantized
    ids = torch.tensor([LONG])
    got, want = stage(ids, 0, stage.new_cache(32)), dense(ids, 0, dense.new_cache(32))
    bound = 0.05 if kernel_dtype(torch.device("cpu")) is torch.bfloat16 else 0.02
    assert float((got - want).abs().max()) < bound * float(want.abs().max())
    chunk, steps = _chunk_and_steps(stage, LONG, [44, 45, 46, 47, 48, 49])
    assert torch.equal(chunk, steps)
    prices = stored(config, path, bf16_kernels=kernel_dtype(torch.device("cpu")) is torch.bfloat16)
    assert prices is not None
    for first, last in ((0, 1), (1, 3), (3, 4), (0, 4)):
        block = load_stage(path, first, last)
        assert measured(block) == prices.stage(first, last), (first, last)


def test_bfloat16_runs_close_to_float32(family_checkpoint: Callable[[str], Path]) -> None:
    """In bfloat16 (the CPU attends in float32, as for every family) the logits stay within
    5 % of the largest float32 logit (measured 3 %: 0.34 of 11.2)."""
    model_dir = family_checkpoint("deepseek_v3")
    f32, bf16 = load_stage(model_dir, 0, 4), load_stage(model_dir, 0, 4, dtype=torch.bfloat16)
    ids = torch.tensor([LONG])
    want = f32(ids, 0, f32.new_cache(32))
    got = bf16(ids, 0, bf16.new_cache(32))
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


def test_a_draft_head_over_mla_is_refused(family_checkpoint: Callable[[str], Path]) -> None:
    """The EAGLE-style head is built from Llama layers: over an MLA target it is refused."""
    from shard.decode.head.model import HeadConfig, HeadError

    config = ModelConfig.from_dir(family_checkpoint("deepseek_v3"))
    with pytest.raises(HeadError, match="MLA"):
        HeadConfig(target=config)


def test_scales_are_transformers(family_checkpoint: Callable[[str], Path]) -> None:
    """YaRN's cos/sin factor (mscale / mscale_all_dim) and the softmax scale
    (qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2) equal transformers' own."""
    model_dir = family_checkpoint("deepseek_v3")
    config = ModelConfig.from_dir(model_dir)
    hf = load_hf(model_dir)
    assert config.rope_scaling is not None
    assert config.rope_scaling.attention_factor == pytest.approx(
        hf.model.rotary_emb.attention_scaling, rel=1e-12
    )
    assert config.attn_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert config.rope_scaling.attention_factor != 1.0 and config.attn_scale != 24**-0.5


BAD = [
    ({"kv_lora_rank": 0}, "kv_lora_rank must be an integer in"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank must be an integer"),
    ({"q_lora_rank": 0}, "q_lora_rank must be an integer in"),
    ({"q_lora_rank": 1.5}, "q_lora_rank must be an integer"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 is odd"),
    ({"qk_nope_head_dim": -1}, "qk_nope_head_dim must be an integer in"),
    ({"v_head_dim": True}, "v_head_dim must be an integer"),
    ({"rope_interleave": "yes"}, "rope_interleave must be true or false"),
    ({"topk_group": 3}, "topk_group 3 of 2"),
    ({"n_group": 3}, "multiple of n_group"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok must be an integer in"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a finite number above 0"),
    ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor must be a number"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be an integer in"),
    ({"n_shared_experts": -1}, "n_shared_experts must be an integer in"),
    ({"scoring_func": "softmax"}, "scoring_func must be DeepSeek-V3's 'sigmoid'"),
    ({"topk_method": "greedy"}, "topk_method must be DeepSeek-V3's"),
    ({"moe_layer_freq": 2}, "moe_layer_freq must be 1"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt must be 'e4m3'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": -1}}, "mscale must be"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_fields_are_refused_in_one_line(
    family_checkpoint: Callable[[str], Path], change: dict[str, Any], message: str
) -> None:
    """Each malformed or out-of-range DeepSeek-V3 field: a one-line ModelLoadError naming it."""
    d = json.loads((family_checkpoint("deepseek_v3") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message) as err:
        ModelConfig.from_hf(d | change)
    assert "\n" not in str(err.value)


def test_real_deepseek_v3_config_plans_with_its_latent() -> None:
    """The published DeepSeek-V3 config (specs/models): its shapes are transformers'
    DeepseekV3Config defaults, a token's KV is 61 x 576 numbers (70,272 bytes in bfloat16),
    the softmax scale carries YaRN's mscale_all_dim, and 256 experts over 58 layers make the
    model ~671 B parameters."""
    config = ModelConfig.from_dir(SPECS / "deepseek-v3")
    defaults = transformers.DeepseekV3Config()
    assert config.mla is not None and config.moe is not None
    assert (config.hidden_size, config.n_layers, config.vocab_size) == (
        defaults.hidden_size,
        defaults.num_hidden_layers,
        defaults.vocab_size,
    )
    assert (config.mla.kv_lora_rank, config.mla.q_lora_rank, config.moe.n_experts) == (
        defaults.kv_lora_rank,
        defaults.q_lora_rank,
        defaults.n_routed_experts,
    )
    assert config.moe.sparse_layers == tuple(range(3, 61))
    footprint = predict(config, "bfloat16")
    assert footprint.kv(0, 61) == 61 * 576 * 2
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert config.attn_scale == pytest.approx(192**-0.5 * mscale**2)
    assert 660e9 < footprint.total / 2 < 690e9
