"""What each model family adds to the Llama decoder, read from its ``config.json``.

A family is a small declared difference, not a copied model file: ``family_fields(arch, d)``
returns the ``ModelConfig`` fields that differ from a plain Llama for that family, each read
the way transformers reads it. ``ModelConfig`` stays the one typed view; ``shard.model.llama``
and ``shard.model.moe`` act on the fields, never on the family's name.

| family (``model_type``) | what it adds                                                      |
|-------------------------|-------------------------------------------------------------------|
| ``qwen3``               | q/k RMSNorm per head                                              |
| ``gemma3_text``         | (1 + w) norms before and after attention and MLP, q/k norm,       |
|                         | √hidden embedding scale, GELU-tanh, sliding layers with their own |
|                         | rope base, ``query_pre_attn_scalar``, final logit softcapping      |
| ``mixtral``             | sparse MoE: softmax over experts, top-k, renormalised             |
| ``qwen3_moe``           | q/k norm; MoE as Mixtral with ``norm_topk_prob``, dense layers by  |
|                         | ``decoder_sparse_step`` / ``mlp_only_layers``                      |
| ``gpt_oss``             | router bias, top-k then softmax, clamped SwiGLU, fused experts,    |
|                         | attention sinks, alternating sliding/full layers, YaRN, biases     |
| ``glm4_moe``            | sigmoid router with correction bias, group-limited top-k, scaling, |
|                         | shared experts, first layers dense, partial rotary, q/k norm       |
| ``deepseek_v3``         | multi-head latent attention (``MlaConfig``), interleaved rotary on |
|                         | the rope dims only, YaRN ``mscale_all_dim`` in the softmax scale;  |
|                         | DeepSeekMoE: GLM-4.5's router, shared experts, first layers dense  |

This module imports neither torch nor safetensors.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["MlaConfig", "MoeConfig", "family_fields", "layer_types_of"]


@attrs.frozen
class MoeConfig:
    """A sparse feed-forward: which layers have one and how their router picks experts.

    ``router``: ``"softmax"`` (softmax over all experts, top-k; Mixtral, Qwen3-MoE),
    ``"topk_softmax"`` (top-k of the logits, softmax over the chosen; gpt-oss) or
    ``"sigmoid_group"`` (sigmoid scores, group-limited top-k by score + correction bias;
    GLM-4.5). ``experts``: ``"swiglu"`` (separate gate/up/down per expert) or
    ``"clamped_swiglu"`` (gpt-oss: fused interleaved ``gate_up_proj`` with biases).
    ``names``: the checkpoint layout of separate experts — ``"hf"`` (``mlp.experts.N.gate_proj``)
    or ``"mixtral"`` (``block_sparse_moe.experts.N.w1``). ``cast_weights``: the router's
    weights are cast back to the model dtype before they scale the experts (Qwen3-MoE).
    """

    router: str
    experts: str
    n_experts: int
    top_k: int
    expert_size: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = True
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    names: str = "hf"
    cast_weights: bool = False


@attrs.frozen
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V3): keys and values are up-projected per head
    from one shared latent of ``kv_lora_rank`` numbers a token, beside one shared rotary key
    of ``qk_rope_head_dim``; queries come through a low-rank ``q_lora_rank`` bottleneck (None:
    a plain ``q_proj``). Each head's query/key is ``qk_nope_head_dim`` unrotated dimensions then
    ``qk_rope_head_dim`` rotated ones; its value is ``v_head_dim`` wide. ``rope_interleave``:
    the rotary pairs are adjacent dimensions (transformers' default for DeepSeek-V3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """The width of one head's query and key (what the softmax scale is taken of)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def layer_types_of(d: dict[str, Any], n_layers: int, pattern: int | None) -> tuple[str, ...]:
    """``layer_types`` as transformers fills them: given, else every ``pattern``-th layer full."""
    given = d.get("layer_types")
    if given:
        return tuple(str(t) for t in given)
    if pattern is None:
        return ("full_attention",) * n_layers
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
    )


def family_fields(arch: str, d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields ``arch`` sets beyond a Llama's (empty for llama/qwen2/mistral)."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "gemma3_text":
        return _gemma3(d, n_layers)
    if arch == "mixtral":
        moe = _softmax_moe(d, int(d["num_local_experts"]), tuple(range(n_layers)))
        return {"moe": attrs.evolve(moe, names="mixtral", norm_topk_prob=True)}
    if arch == "qwen3_moe":
        step = int(d.get("decoder_sparse_step", 1))
        dense = set(d.get("mlp_only_layers") or ())
        n_exp = int(d.get("num_experts") or d["num_local_experts"])
        sparse = tuple(
            i for i in range(n_layers) if i not in dense and n_exp > 0 and (i + 1) % step == 0
        )
        return {
            "qk_norm": True,
            "moe": attrs.evolve(_softmax_moe(d, n_exp, sparse), cast_weights=True),
        }
    if arch == "gpt_oss":
        return _gpt_oss(d, n_layers)
    if arch == "glm4_moe":
        return _glm4_moe(d, n_layers)
    if arch == "deepseek_v3":
        return _deepseek_v3(d, n_layers)
    return {}


def _softmax_moe(d: dict[str, Any], n_experts: int, sparse: tuple[int, ...]) -> MoeConfig:
    return MoeConfig(
        router="softmax",
        experts="swiglu",
        n_experts=n_experts,
        top_k=int(d["num_experts_per_tok"]),
        expert_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        sparse_layers=sparse,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
    )


def _gemma3(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma attn_logit_softcapping is not supported (Gemma 3 leaves it null)")
    rope = d.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    cap = d.get("final_logit_softcapping")
    return {
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "qk_norm": True,
        "hidden_act": str(d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"),
        "attn_scale": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcapping": None if cap is None else float(cap),
        "layer_types": layer_types_of(d, n_layers, int(d.get("sliding_window_pattern", 6))),
        "rope_local_theta": float(
            local.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0
        ),
    }


def _gpt_oss(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    moe = MoeConfig(
        router="topk_softmax",
        experts="clamped_swiglu",
        n_experts=int(d["num_local_experts"]),
        top_k=int(d["num_experts_per_tok"]),
        expert_size=int(d["intermediate_size"]),
        sparse_layers=tuple(range(n_layers)),
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
    )
    bias = bool(d.get("attention_bias", True))
    return {
        "moe": moe,
        "attention_sinks": True,
        "o_proj_bias": bias,
        "layer_types": layer_types_of(d, n_layers, 2),
    }


def _glm4_moe(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    first_dense = int(d.get("first_k_dense_replace", 1))
    moe = MoeConfig(
        router="sigmoid_group",
        experts="swiglu",
        n_experts=int(d.get("n_routed_experts") or d["num_local_experts"]),
        top_k=int(d["num_experts_per_tok"]),
        expert_size=int(d["moe_intermediate_size"]),
        sparse_layers=tuple(range(first_dense, n_layers)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        n_shared_experts=int(d.get("n_shared_experts", 1)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        n_group=int(d.get("n_group", 1)),
        topk_group=int(d.get("topk_group", 1)),
    )
    rope = d.get("rope_parameters") or {}
    partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
    return {"moe": moe, "qk_norm": bool(d.get("use_qk_norm", False)), "partial_rotary": partial}


def _deepseek_v3(d: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """DeepSeek-V3 as transformers' ``DeepseekV3Config`` reads it (its defaults where a key is
    absent). Types are checked here, ranges in ``ModelConfig`` (one ``_check`` each)."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if d.get(key, want) != want:
            raise ValueError(f"{key} {d[key]!r} is not DeepSeek-V3's {want!r}")
    if d.get("quantization_config"):  # the published FP8 weights with block scales
        raise ValueError(
            "quantization_config is set: shard reads float DeepSeek-V3 weights only; "
            "dequantize the FP8 checkpoint to bf16 first"
        )
    if _int(d, "moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {d['moe_layer_freq']!r}: only 1 (every layer) is read")
    q_rank = d.get("q_lora_rank", 1536)
    mla = MlaConfig(
        q_lora_rank=None if q_rank is None else _int(d, "q_lora_rank", 1536),
        kv_lora_rank=_int(d, "kv_lora_rank", 512),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", 64),
        v_head_dim=_int(d, "v_head_dim", 128),
        rope_interleave=_bool(d, "rope_interleave", True),
    )
    moe = MoeConfig(
        router="sigmoid_group",
        experts="swiglu",
        n_experts=_int(d, "n_routed_experts", 256),
        top_k=_int(d, "num_experts_per_tok", 8),
        expert_size=_int(d, "moe_intermediate_size", 2048),
        sparse_layers=tuple(range(_int(d, "first_k_dense_replace", 3), n_layers)),
        norm_topk_prob=_bool(d, "norm_topk_prob", True),
        n_shared_experts=_int(d, "n_shared_experts", 1),
        routed_scaling_factor=_float(d, "routed_scaling_factor", 2.5),
        n_group=_int(d, "n_group", 8),
        topk_group=_int(d, "topk_group", 4),
    )
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}  # as config._from_hf
    scale = mla.qk_head_dim**-0.5
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        # transformers' ``yarn_apply_mscale``: the softmax scale of every dimension, not only
        # the rotated ones, grows by YaRN's mscale(factor, mscale_all_dim) squared
        all_dim = _float(rope, "mscale_all_dim", 0.0)
        if all_dim:
            m = yarn_mscale(_float(rope, "factor", 1.0), all_dim)
            scale = scale * m * m
    return {"mla": mla, "moe": moe, "head_dim": mla.qk_rope_head_dim, "attn_scale": scale}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``): transformers'
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _int(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v
