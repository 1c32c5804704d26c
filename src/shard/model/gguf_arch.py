"""What differs between GGUF architectures: tensor names, config keys, stored conventions.

``ARCHES[general.architecture]`` gives one ``GgufArch``: how llama.cpp names each block
tensor (``blk.N.<name>.weight``) against the Hugging Face name transformers uses, how the
``config.json`` is read from the ``<arch>.*`` metadata keys, and the two conventions
llama.cpp's ``convert_hf_to_gguf.py`` applies on the way in, which ``gguf_import`` undoes:

| architecture | Q/K rows permuted (``LlamaModel.permute``) | norm weights stored as  |
|--------------|--------------------------------------------|-------------------------|
| ``llama``    | yes (interleaved-pair rope)                | ``w``                   |
| ``gemma3``   | no (NeoX rope: halves, as transformers)    | ``1 + w`` (its converter) |
| ``qwen3``    | no (NeoX rope)                             | ``w``                   |
| ``qwen3moe`` | no (NeoX rope)                             | ``w``                   |
| ``llama`` with experts (Mixtral) | yes                    | ``w``                   |
| ``gpt-oss``  | no (NeoX rope)                             | ``w``                   |
| ``glm4moe``  | no (NeoX rope, on the rotated part)        | ``w``                   |

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

Gemma 3's GGUF leaves out most of what its ``config.json`` declares; llama.cpp fills it in at
load (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``), and so does this module, the same way: every
sixth layer is full attention, the others slide (``sliding_window_pattern`` 6), sliding
layers use rope base 10000, and the query scale is ``head_dim ** -0.5`` (``(hidden /
heads) ** -0.5`` for the 62-layer 27B). Keys a newer converter writes win over these
defaults (``attention.sliding_window_pattern``, ``rope.freq_base_swa``, ``attention.scale``,
``final_logit_softcapping``, ``rope.scaling.*``). This module imports neither torch nor
safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import gguf
import numpy as np


class ConvertError(Exception):
    """A GGUF file cannot be converted; the message says why and what to do."""


def meta(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """The metadata value under ``key``; ``ConvertError`` when absent and no default given."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ConvertError(f"GGUF metadata has no {key!r}; the file is incomplete")
        return default
    return field.contents()


def f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 (9.999999747e-06 -> 1e-05)."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


ConfigReader = Callable[[gguf.GGUFReader, int], dict[str, Any]]


@attrs.frozen
class GgufArch:
    """One GGUF architecture: ``blocks`` maps llama.cpp's block tensor names to the Hugging
    Face module path; ``permuted_qk``: Q/K rows were permuted for interleaved rope;
    ``norm_plus_one``: norm weights are stored as ``1 + w``; ``config(reader, vocab_rows)``
    reads ``config.json`` (``tie_word_embeddings`` is set by the caller); ``experts`` maps
    a fused 3-D expert tensor's name to the per-expert projection under ``experts_prefix``.E.

    A ``blocks`` key is a tensor's short name (``attn_q``: its ``.weight`` and ``.bias`` map to
    the module's) or a short name with its suffix (``attn_sinks.weight``), whose value is then
    the whole Hugging Face name. ``fused``: the experts are gpt-oss's (``FUSED_EXPERTS``).
    ``extra_blocks``: the metadata key counting trailing blocks shard does not run (GLM's
    multi-token prediction), or None."""

    blocks: dict[str, str]
    config: ConfigReader
    permuted_qk: bool
    norm_plus_one: bool
    experts: dict[str, str] = attrs.field(factory=dict)
    experts_prefix: str = "mlp.experts"
    fused: bool = False
    extra_blocks: str | None = None


GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LLAMA_BLOCKS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GEMMA3_BLOCKS = {
    **_LLAMA_BLOCKS,
    "ffn_norm": "pre_feedforward_layernorm",  # before the MLP; after attention comes:
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _common(
    reader: gguf.GGUFReader,
    arch: str,
    vocab_rows: int,
    ffn_default: Any = ...,
    *,
    partial: bool = False,
) -> dict[str, Any]:
    """The keys every decoder shares, read from ``<arch>.*`` (``partial``: the family may
    rotate part of each head, read by the caller)."""
    hidden = int(meta(reader, f"{arch}.embedding_length"))
    n_head = int(meta(reader, f"{arch}.attention.head_count"))
    head_dim = int(meta(reader, f"{arch}.attention.key_length", hidden // n_head))
    if not partial and int(meta(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ConvertError(f"partial rotary embeddings are not supported for {arch} GGUFs")
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(meta(reader, f"{arch}.feed_forward_length", ffn_default)),
        "num_hidden_layers": int(meta(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta(reader, f"{arch}.context_length")),
        "rms_norm_eps": f32(meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "attention_bias": False,
        "vocab_size": vocab_rows,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def llama_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` from the ``llama.*`` metadata keys; Llama
    3.x's rope scaling from its ``rope_freqs`` tensor (``llama3_scaling``), linear scaling
    from ``rope.scaling.*``."""
    common = _common(reader, "llama", vocab_rows)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    scaling = _linear_scaling(reader, "llama")
    if freqs is not None:
        if scaling is not None:
            raise ConvertError("a llama GGUF with both rope_freqs and rope.scaling.type")
        scaling = llama3_scaling(np.asarray(freqs.data, np.float32).reshape(-1), reader, common)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rope_scaling": scaling,
        "mlp_bias": False,
        **common,
    }
    first = [k for k in _LLAMA_ORDER if k in config]  # the key order of converter version 2
    return {**{k: config[k] for k in first}, **config}


ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency rope divisors (Llama 3.x); read into ``rope_scaling``, not a
model tensor."""


def llama3_scaling(
    factors: np.ndarray, reader: gguf.GGUFReader, common: dict[str, Any]
) -> dict[str, Any] | None:
    """Llama 3.x ``rope_scaling`` from the ``rope_freqs`` a llama.cpp converter computed
    (``LlamaModel.generate_extra_tensors``: per frequency 1, ``factor``, or the smooth blend
    between, from ``factor``, ``low_freq_factor``, ``high_freq_factor`` and the original context;
    llama.cpp divides each frequency by it). The file keeps only the divisors, so the four
    values are found: ``factor`` is the largest divisor, the others the candidates (low 1 or 2,
    high 4 or 8, the original context a power of two or ``rope.scaling.original_context_length``)
    whose divisors equal the stored ones in float32. None when every divisor is 1; a
    ``ConvertError`` when no Llama 3 curve gives them."""
    head_dim, theta = common["head_dim"], common["rope_theta"]
    rotary = int(meta(reader, "llama.rope.dimension_count", head_dim))
    if factors.shape != (rotary // 2,) or not np.isfinite(factors).all():
        raise ConvertError(f"rope_freqs has {factors.size} values; expected {rotary // 2}")
    if (factors == 1).all():
        return None
    factor = float(factors.max())
    freqs = 1.0 / (theta ** (np.arange(0, rotary, 2, dtype=np.float32) / rotary))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    given = meta(reader, "llama.rope.scaling.original_context_length", None)
    contexts = ([int(given)] if given else []) + [2**k for k in range(4, 21)]
    for context in contexts:
        for low, high in ((1.0, 4.0), (1.0, 8.0), (2.0, 4.0), (2.0, 8.0)):
            smooth = (context / wavelen - low) / (high - low)
            blend = 1 / ((1 - smooth) / factor + smooth)
            want = np.where(
                wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blend)
            ).astype(np.float32)
            if np.allclose(want, factors, rtol=1e-6, atol=0):
                return {
                    "rope_type": "llama3",
                    "factor": f32(factor),
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": context,
                }
    raise ConvertError(
        "rope_freqs does not follow Llama 3's rope scaling for any usual setting; this "
        "converter handles Llama 3.x's rope_freqs only"
    )


_LLAMA_ORDER = (
    *("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers"),
    *("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act"),
    *("max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling"),
    *("attention_bias", "mlp_bias", "vocab_size", "torch_dtype"),
)


def gemma3_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Gemma3ForCausalLM`` (``gemma3_text``) from ``gemma3.*``, with
    llama.cpp's defaults for what the file leaves out (module docstring)."""
    common = _common(reader, "gemma3", vocab_rows)
    if meta(reader, "gemma3.attn_logit_softcapping", None) is not None:
        raise ConvertError("attention logit softcapping is not supported (Gemma 3 has none)")
    n_layers = common["num_hidden_layers"]
    pattern = meta(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        if len(pattern) != n_layers:
            raise ConvertError("attention.sliding_window_pattern does not list every layer")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n_layers)]
    scale = meta(reader, "gemma3.attention.scale", None)
    if scale is not None:
        scalar = float(scale) ** -2
    elif n_layers == 62:  # llama.cpp's LLM_TYPE_27B rule
        scalar = common["hidden_size"] / common["num_attention_heads"]
    else:
        scalar = common["head_dim"]
    cap = meta(reader, "gemma3.final_logit_softcapping", None)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta(reader, "gemma3.attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": f32(meta(reader, "gemma3.rope.freq_base_swa", 10000.0)),
        "rope_scaling": _linear_scaling(reader, "gemma3"),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None if cap is None else f32(cap),
        "attn_logit_softcapping": None,
        **common,
    }


def _linear_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` for linear scaling (Gemma 3 4B and up, full layers only), or None."""
    kind = meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ConvertError(f"rope scaling {kind!r} is not supported for {arch}; only 'linear'")
    return {"rope_type": "linear", "factor": f32(meta(reader, f"{arch}.rope.scaling.factor"))}


_QWEN3_BLOCKS = {
    **_LLAMA_BLOCKS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

_QWEN3MOE_BLOCKS = {**_QWEN3_BLOCKS, "ffn_gate_inp": "mlp.gate"}

_QWEN3MOE_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


def _no_scaling(reader: gguf.GGUFReader, arch: str) -> None:
    scaling = meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConvertError(f"rope scaling {scaling!r} is not supported for {arch} GGUFs")


def qwen3_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Qwen3ForCausalLM`` from the ``qwen3.*`` metadata keys."""
    _no_scaling(reader, "qwen3")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rope_scaling": None,
        **_common(reader, "qwen3", vocab_rows),
    }


def qwen3moe_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Qwen3MoeForCausalLM`` from the ``qwen3moe.*`` metadata keys
    (module docstring: top-k renormalised, layers without a router dense)."""
    _no_scaling(reader, "qwen3moe")
    expert_size = int(meta(reader, "qwen3moe.expert_feed_forward_length"))
    common = _common(reader, "qwen3moe", vocab_rows, ffn_default=expert_size)
    routed = {t.name.split(".")[1] for t in reader.tensors if ".ffn_gate_inp." in t.name}
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "rope_scaling": None,
        "num_experts": int(meta(reader, "qwen3moe.expert_count")),
        "num_experts_per_tok": int(meta(reader, "qwen3moe.expert_used_count")),
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph hard-codes it (norm_w)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(common["num_hidden_layers"]) if str(i) not in routed],
        **common,
    }


def mixtral_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``MixtralForCausalLM`` from a ``llama`` GGUF with experts (its
    ``feed_forward_length`` is each expert's size, as Mixtral's ``intermediate_size``)."""
    _no_scaling(reader, "llama")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "rope_scaling": None,
        "sliding_window": None,
        "num_local_experts": int(meta(reader, "llama.expert_count")),
        "num_experts_per_tok": int(meta(reader, "llama.expert_used_count")),
        **_common(reader, "llama", vocab_rows),
    }


def gpt_oss_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``GptOssForCausalLM`` from the ``gpt-oss.*`` keys (module
    docstring: alternating windows from layer 0, YaRN, llama.cpp's SwiGLU clamp)."""
    a = "gpt-oss"
    ffn = meta(reader, f"{a}.expert_feed_forward_length", None)
    if ffn is None:
        ffn = meta(reader, f"{a}.feed_forward_length")
    common = {**_common(reader, a, vocab_rows, ffn_default=ffn), "intermediate_size": int(ffn)}
    n_layers = common["num_hidden_layers"]
    kind = meta(reader, f"{a}.rope.scaling.type", "none")
    if kind != "yarn":
        raise ConvertError(f"a gpt-oss GGUF must declare YaRN rope scaling, not {kind!r}")
    yarn = {
        "rope_type": "yarn",
        "rope_theta": common["rope_theta"],
        "factor": f32(meta(reader, f"{a}.rope.scaling.factor")),
        "beta_fast": f32(meta(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": f32(meta(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
        "original_max_position_embeddings": int(
            meta(reader, f"{a}.rope.scaling.original_context_length")
        ),
        "truncate": False,
    }
    limit = meta(reader, f"{a}.swiglu_clamp_exp", None)
    if isinstance(limit, list):  # one per layer; gpt-oss uses one value
        if len(set(limit)) != 1:
            raise ConvertError("a per-layer swiglu_clamp_exp is not supported for gpt-oss")
        limit = limit[0]
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_act": "silu",
        "num_local_experts": int(meta(reader, f"{a}.expert_count")),
        "num_experts_per_tok": int(meta(reader, f"{a}.expert_used_count")),
        "sliding_window": int(meta(reader, f"{a}.attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ],
        "rope_scaling": yarn,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0 if limit is None else f32(limit),
        **common,
        "attention_bias": True,
    }


def glm4moe_config(reader: gguf.GGUFReader, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Glm4MoeForCausalLM`` from the ``glm4moe.*`` keys and the tensors
    present (q/k norms, attention biases); module docstring for the MTP layers left out."""
    a = "glm4moe"
    _no_scaling(reader, a)
    common = _common(reader, a, vocab_rows, partial=True)
    gating = int(meta(reader, f"{a}.expert_gating_func", 2))
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ConvertError(f"GLM-4.5 routes with a sigmoid (expert_gating_func 2), not {gating}")
    nextn = int(meta(reader, f"{a}.nextn_predict_layers", 0))
    n_layers = common["num_hidden_layers"] - nextn
    if n_layers < 1:
        raise ConvertError(f"{a}.nextn_predict_layers {nextn} leaves no decoder layer")
    rotary = int(meta(reader, f"{a}.rope.dimension_count", common["head_dim"]))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_act": "silu",
        "rope_scaling": None,
        **common,
        "num_hidden_layers": n_layers,
        "partial_rotary_factor": rotary / common["head_dim"],
        "attention_bias": "blk.0.attn_q.bias" in names,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        "moe_intermediate_size": int(meta(reader, f"{a}.expert_feed_forward_length")),
        "n_routed_experts": int(meta(reader, f"{a}.expert_count")),
        "num_experts_per_tok": int(meta(reader, f"{a}.expert_used_count")),
        "n_shared_experts": int(meta(reader, f"{a}.expert_shared_count", 1)),
        "first_k_dense_replace": int(meta(reader, f"{a}.leading_dense_block_count", 1)),
        "routed_scaling_factor": f32(meta(reader, f"{a}.expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta(reader, f"{a}.expert_weights_norm", True)),
        "n_group": int(meta(reader, f"{a}.expert_group_count", 1)),
        "topk_group": int(meta(reader, f"{a}.expert_group_used_count", 1)),
        "num_nextn_predict_layers": 0,
    }


_MIXTRAL_BLOCKS = {**_LLAMA_BLOCKS, "ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}

_GPT_OSS_BLOCKS = {
    **{k: v for k, v in _LLAMA_BLOCKS.items() if not k.startswith("ffn_")},
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
"""A ``llama`` GGUF with experts (``arch_of``)."""


def arch_of(reader: gguf.GGUFReader) -> tuple[str, GgufArch | None]:
    """``general.architecture`` and its ``GgufArch`` (None: not supported); a ``llama`` file
    with ``llama.expert_count`` is Mixtral."""
    name = str(meta(reader, "general.architecture"))
    if name == "llama" and int(meta(reader, "llama.expert_count", 0) or 0) > 0:
        return "llama (Mixtral)", MIXTRAL
    return name, ARCHES.get(name)


ARCHES: dict[str, GgufArch] = {
    "llama": GgufArch(_LLAMA_BLOCKS, llama_config, permuted_qk=True, norm_plus_one=False),
    "gemma3": GgufArch(_GEMMA3_BLOCKS, gemma3_config, permuted_qk=False, norm_plus_one=True),
    "qwen3": GgufArch(_QWEN3_BLOCKS, qwen3_config, permuted_qk=False, norm_plus_one=False),
    "qwen3moe": GgufArch(
        _QWEN3MOE_BLOCKS,
        qwen3moe_config,
        permuted_qk=False,
        norm_plus_one=False,
        experts=_QWEN3MOE_EXPERTS,
    ),
    "gpt-oss": GgufArch(
        _GPT_OSS_BLOCKS, gpt_oss_config, permuted_qk=False, norm_plus_one=False, fused=True
    ),
    "glm4moe": GgufArch(
        _GLM4MOE_BLOCKS,
        glm4moe_config,
        permuted_qk=False,
        norm_plus_one=False,
        experts=_QWEN3MOE_EXPERTS,
        extra_blocks="glm4moe.nextn_predict_layers",
    ),
}
"""The architectures ``gguf_import`` converts, by ``general.architecture``."""
