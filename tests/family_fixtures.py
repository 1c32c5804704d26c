"""Tiny random checkpoints of every model family, built by transformers' own classes.

Each family is built from a fixed seed with its transformers config and ``*ForCausalLM``
class, its weights re-drawn at trained-model scales (``_redraw``: transformers' own init, std
0.02, gives near-zero logits and greedy ties), saved with ``save_pretrained`` (Mixtral as two
shards with an index, a small ``max_shard_size``) next to the tiny byte-level tokenizer of
``shard.testing``. ``family_dir(name)`` builds one once per test session (the session-scoped
``family_checkpoint`` fixture caches it); tests must not modify it.

The configs turn on what makes each family differ: Gemma 3 alternates sliding (window 8, its
own rope base) and full layers with linear rope scaling, a ``query_pre_attn_scalar`` unlike
the head size and final logit softcapping; gpt-oss alternates windows with YaRN; GLM has a
dense first layer, 2 expert groups of 4, a shared expert and partial rotary; MiniMax-M2 has
8 experts under a sigmoid router with a (redrawn, so non-zero) correction bias, q/k norms over
all heads and half of each head rotated; DeepSeek-V3 has
two dense layers then DeepSeekMoE, MLA with a low-rank query (``VARIANTS``: a plain ``q_proj``
with rotate-half rope), YaRN with ``mscale`` and ``mscale_all_dim`` that differ (both the
cos/sin factor and the softmax scale move), a value width unlike the key's, and an
``rms_norm_eps`` unlike the latent norms' fixed 1e-6. DeepSeek-V4 has 3 hyper-connection
streams, hash-routed layers 0 and 1 (``tid2eid`` drawn: distinct experts per token id), CSA
(rate 4, an indexer keeping 2 entries), HCA (rate 8) and sliding layers of window 8, and YaRN
on the compressed rope.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shard.testing.checkpoints import SPECIAL_TOKENS, _tokenizer_config, _write_json, tiny_tokenizer

SEED = 31
#: Common shape: 4 layers, hidden 64, 4 query / 2 KV heads of 16.
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

#: What DeepSeek-V3 and GLM-5 share: MLA with a low-rank query, a value narrower than the key,
#: YaRN with ``mscale`` unlike ``mscale_all_dim``, 8 experts (2 a token) and a shared one.
FAMILIES_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,  # MLA: every head reads the one latent
    "head_dim": 8,  # transformers' rope reads it: qk_rope_head_dim
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
}

#: What Qwen3-Next and Qwen3.5-MoE share: Gated DeltaNet layers (2 key heads serving 4 value
#: heads, a 4-tap convolution) around one gated full-attention layer, 8 experts (2 a token)
#: and a gated shared expert. Layers 2 and 3 are both linear: a stage may hold no attention.
HYBRID: dict[str, Any] = {
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}

#: family name -> (transformers config class, model class, config kwargs).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "intermediate_size": 128,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 128}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "intermediate_size": 128,
            "tie_word_embeddings": True,
            "sliding_window": 8,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
        },
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
        },
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        {
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rotary_dim": 8,
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **FAMILIES_MLA,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 2,
        },
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        {
            **FAMILIES_MLA,
            "n_group": 1,
            "topk_group": 1,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "index_n_heads": 16,  # relu zeroes all of 4 heads too often: exact ties
            "index_head_dim": 16,
            "index_topk": 4,  # fewer than the prompts' positions: the indexer drops keys
        },
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**HYBRID, "intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    ),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID),
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        {
            "num_key_value_heads": 1,  # one shared K=V head
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "sliding_window": 8,
            "hc_mult": 3,
            "rms_norm_eps": 1e-5,
            "partial_rotary_factor": 0.5,
            "index_n_heads": 16,  # relu zeroes all of 4 heads too often: exact ties
            "index_head_dim": 8,
            "index_topk": 2,  # fewer than the prompts' entries: the indexer drops some
            "layer_types": [
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "sliding_attention",
                "compressed_sparse_attention",
            ],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],  # layer 1 on stage 2
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
}

#: Variants built like the families but run only by their own tests: Gemma 3 with heads of 32
#: (k/v of 64 rows, so that an int4 load joins q/k/v, ``shard.model.fused``, and the native
#: forward takes it: ``tests/test_native.py``); DeepSeek-V3 with a plain ``q_proj``
#: (``q_lora_rank`` null), rotate-half rope (``rope_interleave`` false), no scaling.
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3_wide": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**FAMILIES["gemma3"][2], "head_dim": 32},
    ),
    "deepseek_v3_plain_q": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **{
                k: v
                for k, v in FAMILIES["deepseek_v3"][2].items()
                if k not in ("rope_parameters", "q_lora_rank")
            },
            "q_lora_rank": None,
            "rope_interleave": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        },
    ),
    # six layers, for the failover harness's three stages of two (tests/test_qwen3_next.py)
    "qwen3_next_6": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **HYBRID,
            "num_hidden_layers": 6,
            "layer_types": ["linear_attention", "full_attention"] * 3,
            "intermediate_size": 128,
            "mlp_only_layers": [1],
        },
    ),
}

#: Families saved sharded (``model.safetensors.index.json``) rather than as one file.
SHARDED = {"mixtral": "200KB"}


def family_dir(name: str, root: Path) -> Path:
    """Build family ``name``'s tiny checkpoint under ``root / name`` and return the directory."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[name] if name in FAMILIES else VARIANTS[name]
    tok = tiny_tokenizer()
    im_end, endoftext = (tok.token_to_id(t) for t in SPECIAL_TOKENS[1:])
    kw = {**BASE, **extra, "vocab_size": tok.get_vocab_size()}
    kw |= {"bos_token_id": endoftext, "eos_token_id": im_end, "pad_token_id": endoftext}
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config).eval()
    _redraw(model, name, torch.Generator().manual_seed(SEED))
    out = root / name
    model.save_pretrained(out, max_shard_size=SHARDED.get(name, "50GB"))
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(BASE["max_position_embeddings"]))
    return out


def _redraw(model: Any, family: str, gen: torch.Generator) -> None:
    """Every tensor re-drawn in name order at a trained model's scales (``shard.testing``'s
    rules: ~1/sqrt(fan_in) projections, residual outputs doubled, norms ~1, a sharp head)."""
    gemma = family in ("gemma3", "gemma3_wide", *HYBRIDS)  # norms scale by 1 + weight
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routes: distinct experts per id
                n_exp = model.config.n_routed_experts
                rows = [
                    torch.randperm(n_exp, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])
                ]
                t.copy_(torch.stack(rows))
            if not t.is_floating_point():
                continue
            t.copy_(_draw(name, tuple(t.shape), gemma, gen, family))


def _draw(
    name: str, shape: tuple[int, ...], gemma: bool, gen: torch.Generator, family: str
) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if name == "model.norm.weight":  # Gemma's tied head reads a small embedding: a larger gain
        gain = (16.0 if gemma else 4.0) * (1.0 + normal(0.1))
        return gain - 1.0 if gemma else gain
    if name.endswith("norm.bias"):  # GLM-5's indexer k_norm is a LayerNorm: a small shift
        return normal(0.1)
    if "norm" in name:  # (a DeltaNet's gated norm scales by its weight)
        return normal(0.1) if gemma and "linear_attn.norm" not in name else 1.0 + normal(0.1)
    if "conv1d" in name:  # [C, 1, K]
        return normal(shape[-1] ** -0.5)
    if "embed_tokens" in name or name == "lm_head.weight":  # Gemma scales it by sqrt(hidden)
        return normal(0.025 if gemma else 0.1)
    if name.endswith(("bias", "sinks")):
        return normal(0.5 if name.endswith("sinks") else 0.1)
    if len(shape) == 3:  # fused experts: gpt-oss's [E, in, out]; MiniMax-M2's [E, out, in]
        fan_in = shape[2] if family in ("minimax_m2", *HYBRIDS) else shape[1]  # (others kept)
        return normal((1.0 if "gate_up" in name else 2.0) * fan_in**-0.5)
    fan_in = shape[-1]
    doubled = ("q_proj", "k_proj", "o_proj", "down_proj", "w2", "gate.weight", "router.weight")
    return normal((2.0 if any(k in name for k in doubled) else 1.0) * fan_in**-0.5)


#: The linear-attention hybrids (``shard.model.hybrid_config``).
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text", "qwen3_next_6")

#: Built checkpoints, shared by every test module that imports the fixture (one build each).
_MADE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_checkpoint(name)`` -> that family's tiny checkpoint, built once per session."""

    def get(name: str) -> Path:
        if name not in _MADE:
            _MADE[name] = family_dir(name, tmp_path_factory.mktemp("family"))
        return _MADE[name]

    return get
