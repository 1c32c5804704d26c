"""What every GGUF architecture's reader shares (``shard.convert.gguf_arch``): the error, metadata
access, the ``GgufArch`` record, the names every decoder shares, the common ``config.json`` keys
and the rope-scaling keys. This module imports neither torch nor safetensors.

A GGUF comes from strangers, so the values the converter uses are read typed and bounded
(``count``, ``positive``): a block or head count is one integer in its range, not a string,
an array, a float or zero; an epsilon, rope base or scale is a finite positive number (also in
float32, as it is written); the context length is at most ``MAX_CONTEXT`` (the runtime's rope
table is that long). A refusal names the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs
import gguf
import numpy as np

from shard.convert.gguf_scan import ConvertError as ConvertError  # re-exported: the error

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile
    from shard.convert.gguf_scan import GgufField


def meta(reader: GgufFile, key: str, default: Any = ...) -> Any:
    """The metadata value under ``key``; ``ConvertError`` when absent and no default given."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ConvertError(f"GGUF metadata has no {key!r}; the file is incomplete")
        return default
    return field.contents()


MAX_BLOCKS: Final = 4096
MAX_WIDTH: Final = 1 << 16
"""Embedding width, feed-forward width and head size (real models: under 55,000)."""
MAX_HEADS: Final = 1024
MAX_EXPERTS: Final = 4096
MAX_CONTEXT: Final = 1 << 20
"""Context length: the runtime builds its rope table that long at load (512 MiB at 2^20
positions and head size 128); real GGUFs declare up to 262,144."""

INTEGER_TYPES: Final = frozenset(
    {
        gguf.GGUFValueType.UINT8,
        gguf.GGUFValueType.INT8,
        gguf.GGUFValueType.UINT16,
        gguf.GGUFValueType.INT16,
        gguf.GGUFValueType.UINT32,
        gguf.GGUFValueType.INT32,
        gguf.GGUFValueType.UINT64,
        gguf.GGUFValueType.INT64,
    }
)
NUMBER_TYPES: Final = INTEGER_TYPES | {
    gguf.GGUFValueType.FLOAT32,
    gguf.GGUFValueType.FLOAT64,
}  # metadata value types
FLOAT_TYPES: Final = frozenset({gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64})
_F32_MAX: Final = float(np.finfo(np.float32).max)


def count(reader: GgufFile, key: str, default: Any = ..., *, least: int = 1, most: int) -> int:
    """The integer under ``key`` (one scalar of an integer type) in ``[least, most]``;
    ``default`` (returned as is) when absent. Errors: ``ConvertError`` naming the key."""
    field = reader.get_field(key)
    if field is None:
        return int(meta(reader, key, default))
    if len(field.types) != 1 or field.types[0] not in INTEGER_TYPES:
        raise ConvertError(f"{key}: must be one integer, not {_kind(field)}")
    value = int(field.contents())
    if not least <= value <= most:
        raise ConvertError(f"{key}: {value} is outside {least}..{most}")
    return value


def positive(reader: GgufFile, key: str, default: Any = ...) -> float:
    """The number under ``key`` as the shortest float32 decimal (``f32``), finite and above
    zero; ``default`` when absent. Errors: ``ConvertError`` naming the key."""
    field = reader.get_field(key)
    if field is None:
        value = meta(reader, key, default)
    elif len(field.types) != 1 or field.types[0] not in NUMBER_TYPES:
        raise ConvertError(f"{key}: must be one number, not {_kind(field)}")
    else:
        value = field.contents()
    return finite_positive(key, value)


def finite_positive(key: str, value: float) -> float:
    """``f32(value)``, which must be finite and above zero (``ConvertError`` naming ``key``)."""
    if not (math.isfinite(value) and value > 0):
        raise ConvertError(f"{key}: {value} is not a finite positive number")
    rounded = f32(value) if value <= _F32_MAX else math.inf
    if not (math.isfinite(rounded) and rounded > 0):
        raise ConvertError(f"{key}: {value} does not fit a float32")
    return rounded


def _kind(field: GgufField) -> str:
    names = [t.name.lower() for t in field.types]
    return " of ".join(names) if names else "nothing"


def f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 (9.999999747e-06 -> 1e-05)."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


ConfigReader = Callable[["GgufFile", int], dict[str, Any]]


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
    multi-token prediction), or None. ``bare``: block tensors stored without a ``.weight``
    suffix (qwen3next's ``ssm_a``) by short name, each with its whole Hugging Face name;
    ``plain_norms``: the ``*norm.weight`` tensors (with suffix) not stored as ``1 + w``."""

    blocks: dict[str, str]
    config: ConfigReader
    permuted_qk: bool
    norm_plus_one: bool
    experts: dict[str, str] = attrs.field(factory=dict)
    experts_prefix: str = "mlp.experts"
    fused: bool = False
    extra_blocks: str | None = None
    bare: dict[str, str] = attrs.field(factory=dict)
    plain_norms: tuple[str, ...] = ()


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
    reader: GgufFile,
    arch: str,
    vocab_rows: int,
    ffn_default: Any = ...,
    *,
    partial: bool = False,
) -> dict[str, Any]:
    """The keys every decoder shares, read from ``<arch>.*`` (``partial``: the family may
    rotate part of each head, read by the caller)."""
    hidden = count(reader, f"{arch}.embedding_length", most=MAX_WIDTH)
    n_head = count(reader, f"{arch}.attention.head_count", most=min(MAX_HEADS, hidden))
    if reader.get_field(f"{arch}.attention.key_length") is None and hidden % n_head:
        raise ConvertError(
            f"{arch}.attention.head_count: {n_head} heads do not divide the embedding width "
            f"{hidden} (and no attention.key_length gives the head size)"
        )
    n_kv = count(reader, f"{arch}.attention.head_count_kv", n_head, most=n_head)
    if n_head % n_kv:
        raise ConvertError(
            f"{arch}.attention.head_count_kv: {n_kv} does not divide the {n_head} query heads"
        )
    head_dim = count(reader, f"{arch}.attention.key_length", hidden // n_head, most=MAX_WIDTH)
    rotary = count(reader, f"{arch}.rope.dimension_count", head_dim, least=2, most=head_dim)
    if not partial and rotary != head_dim:
        raise ConvertError(
            f"{arch}.rope.dimension_count: {rotary} of a head of {head_dim}; partial rotary "
            f"embeddings are not supported for {arch} GGUFs"
        )
    if rotary % 2:
        raise ConvertError(f"{arch}.rope.dimension_count: {rotary} is odd; rope rotates pairs")
    ffn = count(reader, f"{arch}.feed_forward_length", ffn_default, most=MAX_WIDTH)
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": count(reader, f"{arch}.block_count", most=MAX_BLOCKS),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": count(reader, f"{arch}.context_length", most=MAX_CONTEXT),
        "rms_norm_eps": positive(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": positive(reader, f"{arch}.rope.freq_base", 10000.0),
        "attention_bias": False,
        "vocab_size": vocab_rows,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        name = f"tokenizer.ggml.{key}_token_id"
        if reader.get_field(name) is not None:
            token_id = count(reader, name, least=0, most=vocab_rows - 1)
            config[f"{'pad' if key == 'padding' else key}_token_id"] = token_id
    return config


def linear_scaling(reader: GgufFile, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` for linear scaling (Gemma 3 4B and up, full layers only), or None."""
    kind = meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ConvertError(
            f"{arch}.rope.scaling.type: {kind!r} is not supported for {arch}; only 'linear'"
        )
    return {"rope_type": "linear", "factor": positive(reader, f"{arch}.rope.scaling.factor")}


def no_scaling(reader: GgufFile, arch: str) -> None:
    scaling = meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConvertError(
            f"{arch}.rope.scaling.type: {scaling!r} is not supported for {arch} GGUFs"
        )
