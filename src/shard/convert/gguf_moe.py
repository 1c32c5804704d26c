"""GGUF architectures with experts (``shard.convert.gguf_arch`` assembles them): Qwen3-MoE,
Mixtral, gpt-oss, GLM-4.5 and MiniMax-M2 — their tensor names and ``config.json`` readers
(DeepSeek-V3's ``deepseek2``, with MLA: ``shard.convert.gguf_mla``).

Qwen3-MoE's experts are stored fused, one 3-D tensor per projection and layer
(``blk.N.ffn_{gate,up,down}_exps``, ``[n_expert, out, in]`` in numpy order); ``experts`` maps
each to the per-expert name shard's checkpoints use (``mlp.experts.E.gate_proj``), and
``gguf_import`` splits it expert by expert (a quantized one stays quantized: its blocks run
along ``in``). The router ``ffn_gate_inp`` is ``mlp.gate``. llama.cpp's ``qwen3moe`` graph
always renormalises the top-k weights (``norm_topk_prob``, whatever the metadata says;
transformers' GGUF loader sets the same) and makes every layer sparse; a layer without
``ffn_gate_inp`` (which llama.cpp itself would refuse) is written as a dense layer
(``mlp_only_layers``).

Mixtral is written as a ``llama`` GGUF with ``llama.expert_count``; its experts and router
become Mixtral's own names (``block_sparse_moe.experts.E.w1|w3|w2`` for gate/up/down,
``block_sparse_moe.gate``), and llama.cpp's llama graph renormalises the top-k weights as
Mixtral does.

gpt-oss's GGUF splits the fused, interleaved ``gate_up_proj`` ``[E, D, 2F]`` into
``ffn_gate_exps`` and ``ffn_up_exps`` (``[E, F, D]``, transposed: blocks along ``D``), with
biases, and transposes ``down_proj`` into ``ffn_down_exps`` ``[E, D, F]``; ``fused`` says so and
``gguf_import`` puts them back (``FUSED_EXPERTS``). Its experts are MXFP4 (kept stored as int8
groups of 32, exact). The sinks are ``attn_sinks.weight`` (``self_attn.sinks``), the router
``ffn_gate_inp`` with a bias (``mlp.router``). Every other layer slides, starting with layer 0
(llama.cpp's ``swa pattern`` 2, transformers' ``layer_types``); the rope is YaRN from
``rope.scaling.*``, ``truncate`` false as gpt-oss's own ``config.json`` sets (llama.cpp rounds
the correction range; the model is defined by its reference, transformers). The clamped SwiGLU's
alpha 1.702 and limit 7.0 are what llama.cpp hard-codes; ``swiglu_clamp_exp`` wins when set.

GLM-4.5's GGUF counts its multi-token-prediction layers in ``block_count``
(``glm4moe.nextn_predict_layers`` of them, last, with ``nextn.*`` tensors); shard does not run
them (docs/model.md, "not yet"), so they are left out and the model has ``block_count -
nextn`` layers. The correction bias is ``exp_probs_b.bias``, shared experts ``ffn_*_shexp``,
the first ``leading_dense_block_count`` layers dense, the rotated fraction
``rope.dimension_count / key_length``; the router must be sigmoid (``expert_gating_func`` 2).
Group-limited routing is read from ``expert_group_count`` / ``expert_group_used_count`` where a
file has them, else one group (GLM-4.5 and 4.5-Air use one).

MiniMax-M2 (``minimax-m2``; llama.cpp's ``conversion/minimax.py`` ``MiniMaxM2Model``,
``src/models/minimax-m2.cpp``) keeps Mixtral's expert names (``block_sparse_moe.experts.E.w1|w3|w2``
stacked into ``ffn_*_exps``, the router ``ffn_gate_inp``), its correction bias as
``exp_probs_b.bias``, and q/k RMSNorms over all heads at once (``attn_q_norm`` ``[H * D]``,
``attn_k_norm`` ``[Hkv * D]``, applied before the heads are split, as transformers does).
Nothing is permuted (llama.cpp's rope type for it is NeoX, transformers' rotate-half), the
rotated part is ``rope.dimension_count`` (``rotary_dim``), the top-k weights are always
renormalised (the graph passes ``norm_w`` true), and ``expert_feed_forward_length`` is each
expert's width (transformers' ``intermediate_size``). The router must be sigmoid
(``expert_gating_func`` 2, what the converter writes from ``scoring_func``; absent: taken as 2,
MiniMax-M2's only router), and routed weights unscaled.
This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import gguf

from shard.convert.gguf_common import (
    LLAMA_BLOCKS,
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_WIDTH,
    QK_NORM_BLOCKS,
    ConvertError,
    GgufArch,
    common,
    count,
    finite_positive,
    meta,
    no_scaling,
    positive,
)

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile

_QWEN3MOE_BLOCKS = {**LLAMA_BLOCKS, **QK_NORM_BLOCKS, "ffn_gate_inp": "mlp.gate"}

QWEN3MOE_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


def qwen3moe_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Qwen3MoeForCausalLM`` from the ``qwen3moe.*`` metadata keys
    (module docstring: top-k renormalised, layers without a router dense)."""
    no_scaling(reader, "qwen3moe")
    expert_size = count(reader, "qwen3moe.expert_feed_forward_length", most=MAX_WIDTH)
    keys = common(reader, "qwen3moe", vocab_rows, ffn_default=expert_size)
    routed = {t.name.split(".")[1] for t in reader.tensors if ".ffn_gate_inp." in t.name}
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "rope_scaling": None,
        **_experts(reader, "qwen3moe", "num_experts"),
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph hard-codes it (norm_w)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(keys["num_hidden_layers"]) if str(i) not in routed],
        **keys,
    }


def mixtral_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``MixtralForCausalLM`` from a ``llama`` GGUF with experts (its
    ``feed_forward_length`` is each expert's size, as Mixtral's ``intermediate_size``)."""
    no_scaling(reader, "llama")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rope_scaling": None,
        "sliding_window": None,
        **_experts(reader, "llama", "num_local_experts"),
        **common(reader, "llama", vocab_rows),
    }


def gpt_oss_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``GptOssForCausalLM`` from the ``gpt-oss.*`` keys (module
    docstring: alternating windows from layer 0, YaRN, llama.cpp's SwiGLU clamp)."""
    a = "gpt-oss"
    ffn_key = f"{a}.expert_feed_forward_length"
    if reader.get_field(ffn_key) is None:
        ffn_key = f"{a}.feed_forward_length"
    ffn = count(reader, ffn_key, most=MAX_WIDTH)
    keys = {**common(reader, a, vocab_rows, ffn_default=ffn), "intermediate_size": ffn}
    n_layers = keys["num_hidden_layers"]
    kind = meta(reader, f"{a}.rope.scaling.type", "none")
    if kind != "yarn":
        raise ConvertError(
            f"{a}.rope.scaling.type: a gpt-oss GGUF must declare YaRN rope scaling, not {kind!r}"
        )
    yarn = {
        "rope_type": "yarn",
        "rope_theta": keys["rope_theta"],
        "factor": positive(reader, f"{a}.rope.scaling.factor"),
        "beta_fast": positive(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": positive(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        "original_max_position_embeddings": count(
            reader, f"{a}.rope.scaling.original_context_length", most=MAX_CONTEXT
        ),
        "truncate": False,
    }
    limit = _clamp(reader, f"{a}.swiglu_clamp_exp")
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        **_experts(reader, a, "num_local_experts"),
        "sliding_window": count(reader, f"{a}.attention.sliding_window", most=MAX_CONTEXT),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ],
        "rope_scaling": yarn,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0 if limit is None else limit,
        **keys,
        "attention_bias": True,
    }


def glm4moe_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Glm4MoeForCausalLM`` from the ``glm4moe.*`` keys and the tensors
    present (q/k norms, attention biases); module docstring for the MTP layers left out."""
    a = "glm4moe"
    no_scaling(reader, a)
    keys = common(reader, a, vocab_rows, partial=True)
    gating = count(reader, f"{a}.expert_gating_func", 2, least=0, most=1 << 16)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ConvertError(
            f"{a}.expert_gating_func: GLM-4.5 routes with a sigmoid (2), not {gating}"
        )
    nextn = count(reader, f"{a}.nextn_predict_layers", 0, least=0, most=MAX_BLOCKS)
    n_layers = keys["num_hidden_layers"] - nextn
    if n_layers < 1:
        raise ConvertError(f"{a}.nextn_predict_layers {nextn} leaves no decoder layer")
    rotary = count(reader, f"{a}.rope.dimension_count", keys["head_dim"], most=keys["head_dim"])
    experts = _experts(reader, a, "n_routed_experts")
    groups = count(reader, f"{a}.expert_group_count", 1, most=experts["n_routed_experts"])
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_act": "silu",
        "rope_scaling": None,
        **keys,
        "num_hidden_layers": n_layers,
        "partial_rotary_factor": rotary / keys["head_dim"],
        "attention_bias": "blk.0.attn_q.bias" in names,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        "moe_intermediate_size": count(reader, f"{a}.expert_feed_forward_length", most=MAX_WIDTH),
        **experts,
        "n_shared_experts": count(reader, f"{a}.expert_shared_count", 1, least=0, most=MAX_EXPERTS),
        "first_k_dense_replace": count(
            reader, f"{a}.leading_dense_block_count", 1, least=0, most=n_layers
        ),
        "routed_scaling_factor": positive(reader, f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta(reader, f"{a}.expert_weights_norm", True)),
        "n_group": groups,
        "topk_group": count(reader, f"{a}.expert_group_used_count", 1, most=groups),
        "num_nextn_predict_layers": 0,
    }


def minimax_m2_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``MiniMaxM2ForCausalLM`` from the ``minimax-m2.*`` keys (module
    docstring: sigmoid router, renormalised, no scaling; the rotated part of each head)."""
    a = "minimax-m2"
    no_scaling(reader, a)
    gating = count(reader, f"{a}.expert_gating_func", 2, least=0, most=1 << 16)
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ConvertError(
            f"{a}.expert_gating_func: MiniMax-M2 routes with a sigmoid (2), not {gating}"
        )
    if positive(reader, f"{a}.expert_weights_scale", 1.0) != 1.0:
        raise ConvertError(
            f"{a}.expert_weights_scale: MiniMax-M2 does not scale its routed experts"
        )
    expert_size = count(reader, f"{a}.expert_feed_forward_length", most=MAX_WIDTH)
    keys = common(reader, a, vocab_rows, ffn_default=expert_size, partial=True)
    head_dim = keys["head_dim"]
    rotary = count(reader, f"{a}.rope.dimension_count", head_dim, least=2, most=head_dim)
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "hidden_act": "silu",
        **keys,
        "intermediate_size": expert_size,  # MiniMax-M2's intermediate_size is each expert's
        **_experts(reader, a, "num_local_experts"),
        "rotary_dim": rotary,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": keys["rope_theta"],
            "partial_rotary_factor": rotary / head_dim,
        },
    }


def _experts(reader: GgufFile, arch: str, name: str) -> dict[str, int]:
    """``{name: expert_count, "num_experts_per_tok": expert_used_count}``, each bounded."""
    n = count(reader, f"{arch}.expert_count", most=MAX_EXPERTS)
    return {name: n, "num_experts_per_tok": count(reader, f"{arch}.expert_used_count", most=n)}


def _clamp(reader: GgufFile, key: str) -> float | None:
    """gpt-oss's SwiGLU clamp: one finite positive number, or one per layer all equal (the
    model uses one value); None when absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types[:1] != [gguf.GGUFValueType.ARRAY]:
        return positive(reader, key)
    values = field.contents()
    if field.types[1:] not in ([gguf.GGUFValueType.FLOAT32], [gguf.GGUFValueType.FLOAT64]):
        raise ConvertError(f"{key}: must be numbers")
    if len(set(values)) != 1:
        raise ConvertError(f"{key}: a per-layer clamp is not supported for gpt-oss")
    return finite_positive(key, values[0])


_MIXTRAL_BLOCKS = {**LLAMA_BLOCKS, "ffn_gate_inp": "block_sparse_moe.gate"}
_MINIMAX_M2_BLOCKS = {
    **_MIXTRAL_BLOCKS,
    **QK_NORM_BLOCKS,
    "exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias",
}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}

_GPT_OSS_BLOCKS = {
    **{k: v for k, v in LLAMA_BLOCKS.items() if not k.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}

FUSED_EXPERTS = {
    "ffn_gate_exps": "gate_up_proj",
    "ffn_up_exps": "gate_up_proj",
    "ffn_down_exps": "down_proj",
}
"""gpt-oss: llama.cpp's expert tensors -> the fused weight each becomes part of
(``mlp.experts.<name>``; a bias ``<name>_bias``): gate and up interleave, gate first."""

_GLM4MOE_BLOCKS = {
    **_QWEN3MOE_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
del _GLM4MOE_BLOCKS["ffn_norm"]

MIXTRAL = GgufArch(
    _MIXTRAL_BLOCKS,
    mixtral_config,
    permuted_qk=True,
    norm_plus_one=False,
    experts=_MIXTRAL_EXPERTS,
    experts_prefix="block_sparse_moe.experts",
)
"""A ``llama`` GGUF with experts (``gguf_arch.arch_of``)."""

QWEN3MOE = GgufArch(
    _QWEN3MOE_BLOCKS,
    qwen3moe_config,
    permuted_qk=False,
    norm_plus_one=False,
    experts=QWEN3MOE_EXPERTS,
)
GPT_OSS = GgufArch(
    _GPT_OSS_BLOCKS, gpt_oss_config, permuted_qk=False, norm_plus_one=False, fused=True
)
GLM4MOE = GgufArch(
    _GLM4MOE_BLOCKS,
    glm4moe_config,
    permuted_qk=False,
    norm_plus_one=False,
    experts=QWEN3MOE_EXPERTS,
    extra_blocks="glm4moe.nextn_predict_layers",
)
MINIMAX_M2 = GgufArch(
    _MINIMAX_M2_BLOCKS,
    minimax_m2_config,
    permuted_qk=False,
    norm_plus_one=False,
    experts=_MIXTRAL_EXPERTS,
    experts_prefix="block_sparse_moe.experts",
)
