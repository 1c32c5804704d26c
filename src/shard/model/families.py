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
| ``minimax_m2``          | GLM's router with one group, every layer sparse (Mixtral names),   |
|                         | q/k norm over all heads at once, partial rotary                    |
| ``deepseek_v3``         | multi-head latent attention (``MlaConfig``), interleaved rotary on |
|                         | the rope dims only, YaRN ``mscale_all_dim`` in the softmax scale;  |
|                         | DeepSeekMoE: GLM-4.5's router, shared experts, first layers dense  |
| ``glm_moe_dsa``         | DeepSeek-V3's MLA and MoE (GLM-5's defaults, ``mlp_layer_types``)  |
|                         | plus DeepSeek sparse attention's indexer (``DsaConfig``): each     |
|                         | query attends its ``index_topk`` best-scored keys only             |

This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import Any

import attrs

from shard.model.config_fields import MAX, Fields, ModelLoadError
from shard.model.families_v4 import deepseek_v4_fields
from shard.model.rope_config import yarn_mscale

__all__ = ["DsaConfig", "MlaConfig", "MoeConfig", "family_fields", "layer_types_of"]


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
    ``bias_in_gate``: the correction bias is ``gate.e_score_correction_bias`` (GLM-4.5), else
    the layer's own ``e_score_correction_bias`` (MiniMax-M2).
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
    bias_in_gate: bool = True  # the correction bias is the gate's (GLM), else the layer's
    #: one ``shared_expert`` of ``shared_size`` scaled by ``sigmoid(shared_expert_gate(x))``
    #: (Qwen3-Next, Qwen3.5-MoE), beside or instead of ``n_shared_experts``
    shared_gate: bool = False
    shared_size: int = 0


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


@attrs.frozen
class DsaConfig:
    """DeepSeek sparse attention (GLM-5, ``shard.model.dsa``): an indexer of
    ``index_n_heads`` heads of ``index_head_dim`` scores every visible key per query (its own
    projections, and its own key of ``index_head_dim`` cached per position), and MLA attends
    the ``index_topk`` best-scored keys only."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int


def layer_types_of(f: Fields, n_layers: int, pattern: int | None) -> tuple[str, ...]:
    """``layer_types`` as transformers fills them: given, else every ``pattern``-th layer full."""
    given = f.texts("layer_types", most=MAX["layers"])
    if given:
        return given
    if pattern is None:
        return ("full_attention",) * n_layers
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
    )


def family_fields(arch: str, f: Fields, n_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields ``arch`` sets beyond a Llama's (empty for llama/qwen2/mistral)."""
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "gemma3_text":
        return _gemma3(f, n_layers)
    if arch == "mixtral":
        n_exp = f.integer("num_local_experts", hi=MAX["experts"])
        moe = _softmax_moe(f, n_exp, tuple(range(n_layers)))
        return {"moe": attrs.evolve(moe, names="mixtral", norm_topk_prob=True)}
    if arch == "qwen3_moe":
        step = f.integer("decoder_sparse_step", 1, hi=MAX["layers"])
        dense = set(f.integers("mlp_only_layers", lo=0, hi=n_layers - 1, most=n_layers) or ())
        key = "num_experts" if f.has("num_experts") else "num_local_experts"
        n_exp = f.integer(key, lo=0, hi=MAX["experts"])
        sparse = tuple(
            i for i in range(n_layers) if i not in dense and n_exp > 0 and (i + 1) % step == 0
        )
        if not sparse:  # a Qwen3-MoE with no expert layer is a dense Qwen3
            return {"qk_norm": True}
        return {
            "qk_norm": True,
            "moe": attrs.evolve(_softmax_moe(f, n_exp, sparse), cast_weights=True),
        }
    if arch == "gpt_oss":
        return _gpt_oss(f, n_layers)
    if arch == "glm4_moe":
        return _glm4_moe(f, n_layers)
    if arch == "minimax_m2":
        return _minimax_m2(f, n_layers)
    if arch == "deepseek_v3":
        return _deepseek_v3(f, n_layers)
    if arch == "glm_moe_dsa":
        return _glm_moe_dsa(f, n_layers)
    if arch == "deepseek_v4":  # its own module
        return deepseek_v4_fields(f, n_layers)
    return {}


def _top_k(f: Fields, n_experts: int) -> int:
    return f.integer("num_experts_per_tok", hi=max(1, n_experts))


def _softmax_moe(f: Fields, n_experts: int, sparse: tuple[int, ...]) -> MoeConfig:
    key = "moe_intermediate_size" if f.has("moe_intermediate_size") else "intermediate_size"
    return MoeConfig(
        router="softmax",
        experts="swiglu",
        n_experts=n_experts,
        top_k=_top_k(f, n_experts),
        expert_size=f.integer(key, hi=MAX["ffn"]),
        sparse_layers=sparse,
        norm_topk_prob=f.flag("norm_topk_prob", True),
    )


def _gemma3(f: Fields, n_layers: int) -> dict[str, Any]:
    if f.has("attn_logit_softcapping"):
        raise ModelLoadError(
            f"{f.where}: Gemma attn_logit_softcapping is not supported (Gemma 3 leaves it null)"
        )
    rope = f.table("rope_parameters")
    local = rope.table("sliding_attention") if rope is not None else None
    local_theta = (
        local.real("rope_theta", lo=0, above=True)
        if local is not None and local.has("rope_theta")
        else f.real("rope_local_base_freq", 10000.0, lo=0, above=True)
    )
    act = f.text("hidden_activation") or f.text("hidden_act") or "gelu_pytorch_tanh"
    pattern = f.integer("sliding_window_pattern", 6, hi=MAX["layers"])
    return {
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "qk_norm": True,
        "hidden_act": act,
        "attn_scale": f.real("query_pre_attn_scalar", 256, lo=0, above=True) ** -0.5,
        "final_logit_softcapping": f.opt_real("final_logit_softcapping", lo=0, above=True),
        "layer_types": layer_types_of(f, n_layers, pattern),
        "rope_local_theta": local_theta,
    }


def _gpt_oss(f: Fields, n_layers: int) -> dict[str, Any]:
    n_exp = f.integer("num_local_experts", hi=MAX["experts"])
    moe = MoeConfig(
        router="topk_softmax",
        experts="clamped_swiglu",
        n_experts=n_exp,
        top_k=_top_k(f, n_exp),
        expert_size=f.integer("intermediate_size", hi=MAX["ffn"]),
        sparse_layers=tuple(range(n_layers)),
        swiglu_alpha=f.real("swiglu_alpha", 1.702, lo=0, above=True),
        swiglu_limit=f.real("swiglu_limit", 7.0, lo=0, above=True),
    )
    bias = f.flag("attention_bias", True)
    return {
        "moe": moe,
        "attention_sinks": True,
        "o_proj_bias": bias,
        "layer_types": layer_types_of(f, n_layers, 2),
    }


def _glm4_moe(f: Fields, n_layers: int) -> dict[str, Any]:
    first_dense = f.integer("first_k_dense_replace", 1, lo=0, hi=n_layers)
    key = "n_routed_experts" if f.has("n_routed_experts") else "num_local_experts"
    n_exp = f.integer(key, hi=MAX["experts"])
    moe = MoeConfig(
        router="sigmoid_group",
        experts="swiglu",
        n_experts=n_exp,
        top_k=_top_k(f, n_exp),
        expert_size=f.integer("moe_intermediate_size", hi=MAX["ffn"]),
        sparse_layers=tuple(range(first_dense, n_layers)),
        norm_topk_prob=f.flag("norm_topk_prob", True),
        n_shared_experts=f.integer("n_shared_experts", 1, lo=0, hi=MAX["experts"]),
        routed_scaling_factor=f.real("routed_scaling_factor", 1.0, lo=0, above=True),
        n_group=f.integer("n_group", 1, hi=max(1, n_exp)),
        topk_group=f.integer("topk_group", 1, hi=max(1, n_exp)),
    )
    rope = f.table("rope_parameters")
    key = "partial_rotary_factor"
    partial = (
        f.real(key, lo=0, hi=1, above=True)
        if f.has(key)
        else rope.real(key, lo=0, hi=1, above=True)
        if rope is not None and rope.has(key)
        else 0.5
    )
    return {"moe": moe, "qk_norm": f.flag("use_qk_norm", False), "partial_rotary": partial}


def _minimax_m2(f: Fields, n_layers: int) -> dict[str, Any]:
    """MiniMax-M2: every layer sparse (Mixtral's names), sigmoid scores chosen by score plus
    the layer's ``e_score_correction_bias`` and renormalised (GLM's router with one group),
    q/k RMSNorm over all heads at once, partial rotary (``rotary_dim`` of each head)."""
    n_exp = f.integer("num_local_experts", hi=MAX["experts"])
    moe = MoeConfig(
        router="sigmoid_group",
        experts="swiglu",
        n_experts=n_exp,
        top_k=_top_k(f, n_exp),
        expert_size=f.integer("intermediate_size", hi=MAX["ffn"]),
        sparse_layers=tuple(range(n_layers)),
        norm_topk_prob=True,
        names="mixtral",
        bias_in_gate=False,
    )
    rope = f.table("rope_parameters")
    key = "partial_rotary_factor"
    if rope is not None and rope.has(key):
        partial = rope.real(key, lo=0, hi=1, above=True)
    elif f.has("rotary_dim"):
        head_dim = f.integer("head_dim", hi=MAX["width"])
        partial = f.integer("rotary_dim", hi=head_dim) / head_dim
    else:
        partial = 1.0
    return {"moe": moe, "qk_norm_whole": True, "partial_rotary": partial}  # norms always there


#: transformers' defaults where a key is absent (``DeepseekV3Config``, ``GlmMoeDsaConfig``);
#: both default kv_lora_rank 512, qk_rope_head_dim 64, 256 experts of 2048, 8 a token, the
#: first 3 layers dense and a routed scaling of 2.5.
_MLA_DEFAULTS: dict[str, dict[str, int]] = {
    "deepseek_v3": {"q_lora_rank": 1536, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "n_group": 8, "topk_group": 4},
    "glm_moe_dsa": {"q_lora_rank": 2048, "qk_nope_head_dim": 192, "v_head_dim": 256,
                    "n_group": 1, "topk_group": 1},
}  # fmt: skip


def _deepseek_v3(f: Fields, n_layers: int, arch: str = "deepseek_v3") -> dict[str, Any]:
    """DeepSeek-V3 as transformers' ``DeepseekV3Config`` reads it (its defaults where a key is
    absent), each field typed and bounded (``Fields``); the MLA shape's consistency is checked
    by ``ModelConfig``. ``arch``: whose defaults (``_MLA_DEFAULTS``)."""
    defaults = _MLA_DEFAULTS[arch]
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = f.text(key, want)
        if got != want:
            raise f.error(key, f"DeepSeek-V3's {want!r}", got)
    if f.integer("moe_layer_freq", 1, hi=MAX["layers"]) != 1:
        raise f.error(
            "moe_layer_freq", "1 (every layer after the dense ones)", f.raw("moe_layer_freq")
        )
    width = MAX["width"]
    # q_lora_rank null: a plain q_proj; absent: transformers' default
    absent = f.raw("q_lora_rank", _ABSENT) is _ABSENT
    q_rank = defaults["q_lora_rank"] if absent else f.opt_integer("q_lora_rank", hi=width)
    mla = MlaConfig(
        q_lora_rank=q_rank,
        kv_lora_rank=f.integer("kv_lora_rank", 512, hi=width),
        qk_nope_head_dim=f.integer("qk_nope_head_dim", defaults["qk_nope_head_dim"], hi=width),
        qk_rope_head_dim=f.integer("qk_rope_head_dim", 64, hi=width),
        v_head_dim=f.integer("v_head_dim", defaults["v_head_dim"], hi=width),
        rope_interleave=f.flag("rope_interleave", True),
    )
    n_exp = f.integer("n_routed_experts", 256, hi=MAX["experts"])
    moe = MoeConfig(
        router="sigmoid_group",
        experts="swiglu",
        n_experts=n_exp,
        top_k=f.integer("num_experts_per_tok", 8, hi=max(1, n_exp)),
        expert_size=f.integer("moe_intermediate_size", 2048, hi=MAX["ffn"]),
        sparse_layers=tuple(
            range(f.integer("first_k_dense_replace", 3, lo=0, hi=n_layers), n_layers)
        ),
        norm_topk_prob=f.flag("norm_topk_prob", True),
        n_shared_experts=f.integer("n_shared_experts", 1, lo=0, hi=MAX["experts"]),
        routed_scaling_factor=f.real("routed_scaling_factor", 2.5, lo=0, above=True),
        n_group=f.integer("n_group", defaults["n_group"], hi=max(1, n_exp)),
        topk_group=f.integer("topk_group", defaults["topk_group"], hi=max(1, n_exp)),
    )
    rope = f.table("rope_scaling") or f.table("rope_parameters")  # as config._from_hf
    scale = mla.qk_head_dim**-0.5
    if rope is not None and (rope.text("rope_type") or rope.text("type") or "default") != "default":
        # transformers' ``yarn_apply_mscale``: the softmax scale of every dimension, not only
        # the rotated ones, grows by YaRN's mscale(factor, mscale_all_dim) squared
        all_dim = rope.real("mscale_all_dim", 0.0, lo=0)
        if all_dim:
            m = yarn_mscale(rope.real("factor", 1.0, lo=0, above=True), all_dim)
            scale = scale * m * m
    return {"mla": mla, "moe": moe, "head_dim": mla.qk_rope_head_dim, "attn_scale": scale}


def _glm_moe_dsa(f: Fields, n_layers: int) -> dict[str, Any]:
    """GLM-5 as transformers' ``GlmMoeDsaConfig`` reads it: DeepSeek-V3's MLA and MoE with
    GLM's defaults, dense layers by ``mlp_layer_types`` (else the first
    ``first_k_dense_replace``), and the DSA indexer (``DsaConfig``) in every layer.

    transformers' GLM-5 rotates interleaved whatever ``rope_interleave`` or
    ``indexer_rope_interleave`` say, and its indexer reads the low-rank query: a config that
    asks otherwise, or whose ``indexer_types`` share one layer's selection with the next
    (``"shared"``), is refused rather than run as something else."""
    for key in ("rope_interleave", "indexer_rope_interleave"):
        if not f.flag(key, True):
            raise f.error(key, "true (transformers' GLM-5 always interleaves)", False)
    if f.raw("q_lora_rank", 0) is None:
        raise f.error("q_lora_rank", "an integer (GLM-5's indexer reads the low-rank query)", None)
    out = _deepseek_v3(f, n_layers, "glm_moe_dsa")
    kinds = f.texts("mlp_layer_types", most=MAX["layers"])
    if kinds is not None:
        if len(kinds) != n_layers or not set(kinds) <= {"dense", "sparse"}:
            raise f.error("mlp_layer_types", f"{n_layers} of 'dense' / 'sparse'", list(kinds))
        sparse = tuple(i for i, kind in enumerate(kinds) if kind == "sparse")
        out["moe"] = attrs.evolve(out["moe"], sparse_layers=sparse)
    shared = [i for i, kind in enumerate(_indexer_types(f, n_layers)) if kind != "full"]
    if shared:
        raise ModelLoadError(
            f"{f.where}: indexer_types {shared[:4]}... are 'shared' (a layer reusing an "
            "earlier layer's top-k); shard runs every layer's own indexer only"
        )
    out["dsa"] = DsaConfig(
        index_n_heads=f.integer("index_n_heads", 32, hi=MAX["heads"]),
        index_head_dim=f.integer("index_head_dim", 128, hi=MAX["width"]),
        index_topk=f.integer("index_topk", 2048, hi=MAX["positions"]),
    )
    return out


def _indexer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    """``indexer_types`` as ``GlmMoeDsaConfig`` fills them: given; else from
    ``index_topk_pattern`` (``"FSS..."``: full / shared); else every ``index_topk_freq``-th
    layer from ``index_skip_topk_offset`` on is full (the defaults: every layer)."""
    given = f.texts("indexer_types", most=MAX["layers"])
    pattern = f.raw("index_topk_pattern")
    if given is None and isinstance(pattern, str) and len(pattern) <= MAX["layers"]:
        given = tuple({"F": "full", "S": "shared"}.get(c, c) for c in pattern)
    elif given is None and pattern is not None:
        given = f.texts("index_topk_pattern", most=MAX["layers"])
    if given is not None:
        if len(given) != n_layers or not set(given) <= {"full", "shared"}:
            raise f.error("indexer_types", f"{n_layers} of 'full' / 'shared'", list(given))
        return given
    freq = f.integer("index_topk_freq", 1, lo=0, hi=MAX["layers"])
    offset = f.integer("index_skip_topk_offset", 2, lo=0, hi=MAX["layers"])
    return tuple(
        "full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(n_layers)
    )


_ABSENT = object()
