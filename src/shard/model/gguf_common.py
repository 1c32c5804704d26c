"""What every GGUF architecture's reader shares (``shard.model.gguf_arch``): the error, metadata
access, the ``GgufArch`` record, the names every decoder shares, the common ``config.json`` keys
and the rope-scaling keys. This module imports neither torch nor safetensors.
"""

from __future__ import annotations

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

LLAMA_BLOCKS = {
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

QK_NORM_BLOCKS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def common(
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


def linear_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` for linear scaling (Gemma 3 4B and up, full layers only), or None."""
    kind = meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ConvertError(f"rope scaling {kind!r} is not supported for {arch}; only 'linear'")
    return {"rope_type": "linear", "factor": f32(meta(reader, f"{arch}.rope.scaling.factor"))}


def no_scaling(reader: gguf.GGUFReader, arch: str) -> None:
    scaling = meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConvertError(f"rope scaling {scaling!r} is not supported for {arch} GGUFs")
