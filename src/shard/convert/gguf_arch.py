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
| ``minimax-m2`` | no (NeoX rope, on the rotated part)      | ``w``                   |
| ``deepseek2`` | no (interleaved rope on the checkpoint's own rows: ``rope_interleave``) | ``w`` |
| ``qwen3next`` | no (NeoX rope, on the rotated part) | ``1 + w`` (all but ``ssm_norm``) |

The architectures with experts (Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5, MiniMax-M2) are read by
``shard.convert.gguf_moe``; ``deepseek2`` (DeepSeek-V3, Kimi K2: MLA, whose split ``attn_k_b`` is
stored transposed and is joined back into ``kv_b_proj``) by ``shard.convert.gguf_mla``; what every
reader shares is ``shard.convert.gguf_common``; ``qwen3next`` (Qwen3-Next: Gated DeltaNet, whose
``A_log`` is stored as ``-exp(A_log)`` and ``in_proj_qkvz`` split in two) by
``shard.convert.gguf_next``, tested against the checkpoint it was written from
(``tests/test_gguf_next.py``: logits bit-identical; ``A_log`` and the (1+w) norms within their
float32 rounding, the model's ``-exp(A_log)`` and ``1 + w`` bit for bit). MiniMax-M2 and
``deepseek2`` are tested, as the other MoE architectures, on tiny GGUFs written as llama.cpp's
converter writes them, against transformers' model holding the weights the GGUF holds
(``tests/test_gguf_moe.py``; ``tests/test_gguf_mla.py``: both ``kv_b_proj`` forms, both query
forms, bit-exact in float32; lies refused: ``tests/test_gguf_hostile.py``).

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
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from shard.convert.gguf_common import (
    GLOBAL_NAMES,
    LLAMA_BLOCKS,
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_EXPERTS,
    QK_NORM_BLOCKS,
    ConvertError,
    GgufArch,
    common,
    count,
    f32,
    linear_scaling,
    meta,
    no_scaling,
    positive,
)
from shard.convert.gguf_mla import DEEPSEEK2
from shard.convert.gguf_moe import FUSED_EXPERTS, GLM4MOE, GPT_OSS, MINIMAX_M2, MIXTRAL, QWEN3MOE
from shard.convert.gguf_next import QWEN3NEXT

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile

__all__ = [
    "ARCHES",
    "FUSED_EXPERTS",
    "GLOBAL_NAMES",
    "ROPE_FREQS",
    "ConvertError",
    "GgufArch",
    "arch_of",
    "meta",
]

_GEMMA3_BLOCKS = {
    **LLAMA_BLOCKS,
    **QK_NORM_BLOCKS,
    "ffn_norm": "pre_feedforward_layernorm",  # before the MLP; after attention comes:
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def llama_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` from the ``llama.*`` metadata keys; Llama
    3.x's rope scaling from its ``rope_freqs`` tensor (``llama3_scaling``), linear scaling
    from ``rope.scaling.*``."""
    keys = common(reader, "llama", vocab_rows)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    scaling = linear_scaling(reader, "llama")
    if freqs is not None:
        if scaling is not None:
            raise ConvertError("a llama GGUF with both rope_freqs and rope.scaling.type")
        scaling = llama3_scaling(np.asarray(freqs.data, np.float32).reshape(-1), reader, keys)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rope_scaling": scaling,
        "mlp_bias": False,
        **keys,
    }
    first = [k for k in _LLAMA_ORDER if k in config]  # the key order of converter version 2
    return {**{k: config[k] for k in first}, **config}


ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency rope divisors (Llama 3.x); read into ``rope_scaling``, not a
model tensor."""


def llama3_scaling(
    factors: np.ndarray, reader: GgufFile, keys: dict[str, Any]
) -> dict[str, Any] | None:
    """Llama 3.x ``rope_scaling`` from the ``rope_freqs`` a llama.cpp converter computed
    (``LlamaModel.generate_extra_tensors``: per frequency 1, ``factor``, or the smooth blend
    between, from ``factor``, ``low_freq_factor``, ``high_freq_factor`` and the original context;
    llama.cpp divides each frequency by it). The file keeps only the divisors, so the four
    values are found: ``factor`` is the largest divisor, the others the candidates (low 1 or 2,
    high 4 or 8, the original context a power of two or ``rope.scaling.original_context_length``)
    whose divisors equal the stored ones in float32. None when every divisor is 1; a
    ``ConvertError`` when no Llama 3 curve gives them."""
    head_dim, theta = keys["head_dim"], keys["rope_theta"]
    rotary = count(reader, "llama.rope.dimension_count", head_dim, least=2, most=head_dim)
    if factors.shape != (rotary // 2,) or not np.isfinite(factors).all():
        raise ConvertError(f"rope_freqs has {factors.size} values; expected {rotary // 2}")
    if (factors == 1).all():
        return None
    factor = float(factors.max())
    freqs = 1.0 / (theta ** (np.arange(0, rotary, 2, dtype=np.float32) / rotary))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    key = "llama.rope.scaling.original_context_length"
    given = count(reader, key, None, most=MAX_CONTEXT) if reader.get_field(key) else None
    contexts = ([given] if given else []) + [2**k for k in range(4, 21)]
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


def gemma3_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Gemma3ForCausalLM`` (``gemma3_text``) from ``gemma3.*``, with
    llama.cpp's defaults for what the file leaves out (module docstring)."""
    keys = common(reader, "gemma3", vocab_rows)
    if meta(reader, "gemma3.attn_logit_softcapping", None) is not None:
        raise ConvertError(
            "gemma3.attn_logit_softcapping: attention logit softcapping is not supported "
            "(Gemma 3 has none)"
        )
    n_layers = keys["num_hidden_layers"]
    sliding = _gemma3_sliding(reader, n_layers)
    scale = meta(reader, "gemma3.attention.scale", None)
    if scale is not None:
        scalar = positive(reader, "gemma3.attention.scale") ** -2
    elif n_layers == 62:  # llama.cpp's LLM_TYPE_27B rule
        scalar = keys["hidden_size"] / keys["num_attention_heads"]
    else:
        scalar = keys["head_dim"]
    cap_key = "gemma3.final_logit_softcapping"
    cap = positive(reader, cap_key) if reader.get_field(cap_key) else None
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": count(reader, "gemma3.attention.sliding_window", most=MAX_CONTEXT),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": positive(reader, "gemma3.rope.freq_base_swa", 10000.0),
        "rope_scaling": linear_scaling(reader, "gemma3"),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": cap,
        "attn_logit_softcapping": None,
        **keys,
    }


def _gemma3_sliding(reader: GgufFile, n_layers: int) -> list[bool]:
    """Which layers slide: ``attention.sliding_window_pattern`` is one flag per layer (True:
    sliding) or a period (every ``pattern``-th layer is full)."""
    key = "gemma3.attention.sliding_window_pattern"
    field = reader.get_field(key)
    if field is not None and field.types[:1] == [gguf.GGUFValueType.ARRAY]:
        if field.types[1:] != [gguf.GGUFValueType.BOOL] or len(field.contents()) != n_layers:
            raise ConvertError(f"{key}: expected one bool per layer ({n_layers})")
        return [bool(p) for p in field.contents()]
    pattern = count(reader, key, 6, most=MAX_BLOCKS)
    return [(i + 1) % pattern != 0 for i in range(n_layers)]


_QWEN3_BLOCKS = {**LLAMA_BLOCKS, **QK_NORM_BLOCKS}


def qwen3_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Qwen3ForCausalLM`` from the ``qwen3.*`` metadata keys."""
    no_scaling(reader, "qwen3")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rope_scaling": None,
        **common(reader, "qwen3", vocab_rows),
    }


def arch_of(reader: GgufFile) -> tuple[str, GgufArch | None]:
    """``general.architecture`` and its ``GgufArch`` (None: not supported); a ``llama`` file
    with ``llama.expert_count`` is Mixtral."""
    name = str(meta(reader, "general.architecture"))
    if name == "llama" and count(reader, "llama.expert_count", 0, least=0, most=MAX_EXPERTS):
        return "llama (Mixtral)", MIXTRAL
    return name, ARCHES.get(name)


ARCHES: dict[str, GgufArch] = {
    "llama": GgufArch(LLAMA_BLOCKS, llama_config, permuted_qk=True, norm_plus_one=False),
    "gemma3": GgufArch(_GEMMA3_BLOCKS, gemma3_config, permuted_qk=False, norm_plus_one=True),
    "qwen3": GgufArch(_QWEN3_BLOCKS, qwen3_config, permuted_qk=False, norm_plus_one=False),
    "qwen3moe": QWEN3MOE,
    "gpt-oss": GPT_OSS,
    "glm4moe": GLM4MOE,
    "minimax-m2": MINIMAX_M2,
    "deepseek2": DEEPSEEK2,
    "qwen3next": QWEN3NEXT,
}
"""The architectures ``gguf_import`` converts, by ``general.architecture``."""
