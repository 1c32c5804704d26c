"""Every family against transformers, on tiny random checkpoints transformers itself built.

``family_fixtures`` builds each family with its transformers config and model class and saves
it with ``save_pretrained``; shard loads the directory with its own code. Measured (torch 2.13
CPU, transformers 5.25, float32, eager attention in transformers): max |logit diff| over a
prefill of 20 positions is 0 (gpt-oss) to ~1.6e-5 (Llama 3 rope scaling), logits have std ~3.
Greedy decoding against transformers' own KV cache adds the sliding-window families' cache
trimming (their attention shapes differ). ``ATOL`` 1e-4 leaves room for kernel order without
hiding a bug: a wrong norm, rope, router or window moves logits by 1e-1 to 10.

The linear-attention hybrids (Qwen3-Next, Qwen3.5-MoE) get ``HYBRID_ATOL`` 2e-4: transformers
prefills them with the chunked form of the gated delta rule (a triangular solve per chunk of
64) where shard steps position by position as transformers' own decode does; the two sum in
different orders, measured up to 1.01e-4 apart here, still three orders below a bug's effect.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import family_fixtures
from family_fixtures import FAMILIES, SHARDED
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.loader import checkpoint_index, load_stage
from test_model_split import bounds_for, greedy_tokens, run_ring
from test_model_vs_transformers import hf_greedy, shard_greedy

transformers = pytest.importorskip("transformers")
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
HYBRID_ATOL = 2e-4
NEW_TOKENS = 24
#: Two prompts of one length (a batch of 2), and one longer than every sliding window.
BATCH = ([5, 77, 101, 260, 33, 8, 199, 42, 42, 7, 3], [9, 1, 250, 66, 12, 180, 97, 4, 4, 120, 31])
LONG = [(13 * i + 7) % 260 + 1 for i in range(21)]


def _atol(family: str) -> float:
    return HYBRID_ATOL if family in family_fixtures.HYBRIDS else ATOL


def load_hf(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_logits_match_transformers(
    family_checkpoint: Callable[[str], Path], family: str, report: Callable[[str], None]
) -> None:
    """A batch of two prompts: every position's logits within ATOL of transformers'."""
    model_dir = family_checkpoint(family)
    config = ModelConfig.from_dir(model_dir)
    ours = load_stage(model_dir, 0, config.n_layers)
    hf = load_hf(model_dir)
    assert type(hf).__name__ == config.architecture
    ids = torch.tensor(BATCH)  # [2, 11]
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ours(ids, 0, ours.new_cache(32, batch=2))
    diff = float((got - want).abs().max())
    report(f"{family}: batch prefill max |logit diff| vs transformers {diff:.3g}")
    torch.testing.assert_close(got, want, rtol=0, atol=_atol(family))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(
    family_checkpoint: Callable[[str], Path], family: str, report: Callable[[str], None]
) -> None:
    """Greedy decoding past every sliding window: ids identical, each step's logits within ATOL."""
    model_dir = family_checkpoint(family)
    config = ModelConfig.from_dir(model_dir)
    ours, hf = load_stage(model_dir, 0, config.n_layers), load_hf(model_dir)
    worst, seen = 0.0, set()
    for prompt in (BATCH[0], LONG):
        our_ids, our_logits = shard_greedy(ours, prompt, NEW_TOKENS)
        hf_ids, hf_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert our_ids == hf_ids, f"{family}: {prompt}"
        worst = max(worst, float((our_logits - hf_logits).abs().max()))
        torch.testing.assert_close(our_logits, hf_logits, rtol=0, atol=_atol(family))
        seen |= set(our_ids)
    assert len(seen) > NEW_TOKENS // 3, "greedy output degenerated into a loop"
    report(f"{family}: greedy {NEW_TOKENS} tokens, max |logit diff| vs transformers {worst:.3g}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_split_is_identical(family_checkpoint: Callable[[str], Path], family: str) -> None:
    """Blocks [0,a),[a,b),...,[z,L) run in turn equal the unsplit model bit for bit."""
    model_dir = family_checkpoint(family)
    n_layers = ModelConfig.from_dir(model_dir).n_layers
    full = load_stage(model_dir, 0, n_layers)
    tokens = greedy_tokens(full, torch.tensor(BATCH), 4)
    expected = run_ring([full], tokens, len(BATCH[0]))
    for bounds in bounds_for(n_layers):
        stages = [load_stage(model_dir, a, b) for a, b in itertools.pairwise(bounds)]
        got = run_ring(stages, tokens, len(BATCH[0]))
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(g, e), f"{family}: split {bounds} differs at step {step}"


def test_configs_declare_each_familys_differences(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """config.json as transformers wrote it parses into each family's declared differences."""
    gemma = ModelConfig.from_dir(family_checkpoint("gemma3"))
    assert (gemma.norm_unit_offset, gemma.sandwich_norms, gemma.embed_scale) == (True,) * 3
    assert [gemma.window_of(i) for i in range(4)] == [8, 8, None, 8]
    assert [gemma.local_rope(i) for i in range(4)] == [True, True, False, True]
    assert gemma.rope_scaling is not None and gemma.rope_scaling.kind == "linear"
    assert (gemma.attn_scale, gemma.final_logit_softcapping) == (24**-0.5, 30.0)
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings
    oss = ModelConfig.from_dir(family_checkpoint("gpt_oss"))
    assert oss.moe is not None and oss.moe.router == "topk_softmax" and oss.attention_sinks
    assert [oss.window_of(i) for i in range(4)] == [8, None, 8, None]
    assert oss.rope_scaling is not None and oss.rope_scaling.kind == "yarn"
    glm = ModelConfig.from_dir(family_checkpoint("glm4_moe"))
    assert glm.moe is not None and glm.moe.sparse_layers == (1, 2, 3)
    assert (glm.rotary_dim, glm.qk_norm, glm.moe.n_shared_experts) == (8, True, 1)
    qmoe = ModelConfig.from_dir(family_checkpoint("qwen3_moe"))
    assert qmoe.moe is not None and qmoe.moe.sparse_layers == (0, 2, 3)
    assert not qmoe.moe.norm_topk_prob and qmoe.qk_norm
    mix = ModelConfig.from_dir(family_checkpoint("mixtral"))
    assert mix.moe is not None and mix.moe.names == "mixtral" and mix.moe.norm_topk_prob
    mm2 = ModelConfig.from_dir(family_checkpoint("minimax_m2"))
    assert mm2.moe is not None and mm2.moe.router == "sigmoid_group" and mm2.moe.n_group == 1
    assert mm2.moe.sparse_layers == (0, 1, 2, 3) and not mm2.moe.bias_in_gate
    assert (mm2.rotary_dim, mm2.qk_norm_whole, mm2.qk_norm) == (8, True, False)


def test_sharded_save_and_a_stage_reads_only_its_tensors(
    family_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Mixtral saved in shards loads through the index; a stage of layers [2, 4) loads from a
    copy holding only its layers' tensors (experts included) and the head, and equals the
    stage loaded from the whole checkpoint."""
    src = family_checkpoint("mixtral")
    assert "mixtral" in SHARDED
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    keep = ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")
    dst = tmp_path / "partial"
    shutil.copytree(src, dst)
    for file in set(index["weight_map"].values()):
        tensors = load_file(str(dst / file))
        save_file({n: t for n, t in tensors.items() if n.startswith(keep)}, str(dst / file))
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in checkpoint_index(dst)
    partial, whole = load_stage(dst, 2, 4), load_stage(src, 2, 4)
    assert partial.state_dict().keys() == whole.state_dict().keys()
    for name, t in whole.state_dict().items():
        assert torch.equal(partial.state_dict()[name], t), name
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        load_stage(dst, 0, 2)


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe", "minimax_m2"])
def test_int8_quantizes_experts_and_keeps_routers_dense(
    family_checkpoint: Callable[[str], Path], family: str
) -> None:
    """weights="int8" runs every expert (and shared expert) through the quantized linear; the
    router stays a dense fp32 matrix (its choice is discrete); the model still runs."""
    from shard.model.moe import Router, SparseMoE
    from shard.model.quant import QuantLinear

    model_dir = family_checkpoint(family)
    stage = load_stage(model_dir, 0, 4, weights="int8")
    moes = [m for m in stage.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == (3 if family == "glm4_moe" else 4)  # GLM: a dense first layer
    for m in moes:
        assert isinstance(m.gate, Router) and m.gate.weight.dtype == torch.float32
        experts = [e for e in m.experts.modules() if isinstance(e, QuantLinear)]
        assert len(experts) == 3 * m.moe.n_experts
    ids = torch.tensor(BATCH[:1])
    assert stage(ids, 0, stage.new_cache(16)).isfinite().all()


def test_minimax_m2_routes_by_its_layer_correction_bias(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """MiniMax-M2's e_score_correction_bias (the layer's, not the gate's) is loaded into its
    router and decides the experts chosen: zeroing it changes some row's choice."""
    from shard.model.moe import SparseMoE

    model = load_stage(family_checkpoint("minimax_m2"), 0, 4)
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    bias = moe.gate.e_score_correction_bias
    assert bias is not None and bias.abs().max() > 0
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, chosen = moe.route(h)
    bias.data.zero_()
    _, unbiased = moe.route(h)
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)
