"""llama.cpp's ``qwen3next`` GGUFs (Qwen3-Next: Gated DeltaNet layers around gated full
attention, MoE with a gated shared expert) read as shard's ``qwen3_next`` family: the
``config.json`` reader, the tensor names, which tensors each block needs and their shapes, and
the values llama.cpp's converter changed, put back.

Verified against llama.cpp's own sources (``conversion/qwen.py``'s ``Qwen3NextModel`` and its
base ``Qwen2MoeModel``, ``src/models/qwen3next.cpp``'s hparams, tensor loader and graph,
``src/llama-arch.cpp``'s key names, ``src/llama-model.cpp``'s rope type, ``gguf-py``'s
``MODEL_TENSORS[QWEN3NEXT]`` and tensor map):

- Values changed by the converter, undone here: ``A_log`` is stored as ``-exp(A_log)``
  (``ssm_a``, no ``.weight`` suffix; read back as ``log(-ssm_a)`` in float64, which must be
  negative and finite); every ``*norm.weight`` except the DeltaNet's gated ``linear_attn.norm``
  is stored as ``1 + w`` (the input, post-attention, final, q and k norms: transformers' (1+w)
  norms); ``conv1d.weight`` ``[C, 1, K]`` is squeezed to ``[C, K]``; ``dt_bias`` is renamed
  ``ssm_dt.bias``; ``in_proj_qkvz``, grouped per key head (``[q, k, v, z]`` of each), is split
  into ``attn_qkv`` (every head's q, then k, then v) and ``attn_gate`` (every z), which
  ``join_qkvz`` puts back. Older GGUFs keep it whole as ``ssm_in`` (llama.cpp's legacy path),
  read as is. Per key head the value heads keep their order (the converter's V-head reordering
  is ``_LinearAttentionVReorderBase``'s, for Qwen3.5, not Qwen3-Next).
- Kept as is: ``in_proj_ba`` (``ssm_ba``: per key head its betas, then its alphas, as the graph
  splits it), ``out_proj`` (``ssm_out``), the gated attention's ``q_proj`` (per head the query,
  then the gate: the graph's view of ``attn_q``), rope not permuted (``LLAMA_ROPE_TYPE_NEOX``,
  transformers' rotate-half) on ``rope.dimension_count`` of each head (the converter writes
  ``head_dim * partial_rotary_factor``), the shared expert's gate ``ffn_gate_inp_shexp``
  (``[1, D]`` as transformers stores it, or ``[D]``), experts stacked as ``ffn_*_exps``.
- Metadata: ``ssm.conv_kernel`` (taps), ``ssm.state_size`` (key head size),
  ``ssm.group_count`` (key heads), ``ssm.time_step_rank`` (value heads), ``ssm.inner_size``
  (value heads times value head size: the graph's value head is ``inner_size /
  time_step_rank``; llama.cpp's loader also assumes it equals the key head, every published
  Qwen3-Next's 128, which shard does not need), which layers are linear from
  ``attention.recurrent_layers`` (one flag per layer) or else ``full_attention_interval``
  (default 4: layer ``i`` is full when ``(i + 1) % interval == 0``), experts from
  ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length`` /
  ``expert_shared_feed_forward_length`` (absent: ``feed_forward_length``, as llama.cpp). The
  graph routes with a softmax and always renormalises the top-k weights.

A layer without ``ffn_gate_inp`` (which llama.cpp refuses: its tensor map for ``qwen3next``
has no dense feed-forward) is read, as for ``qwen3moe``, as a dense layer (``ffn_gate`` /
``ffn_up`` / ``ffn_down``; ``mlp_only_layers``). Multi-token-prediction layers are not in a
``qwen3next`` GGUF (the converter skips ``mtp.*``). This module imports neither torch nor
safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import numpy.typing as npt

from shard.convert.gguf_common import (
    INTEGER_TYPES,
    LLAMA_BLOCKS,
    MAX_BLOCKS,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_WIDTH,
    QK_NORM_BLOCKS,
    ConvertError,
    GgufArch,
    common,
    count,
    f32,
    meta,
    no_scaling,
)

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile
    from shard.convert.gguf_plan import Planned

__all__ = [
    "QKVZ_PARTS",
    "QWEN3NEXT",
    "a_log",
    "gate_row",
    "hf_shape",
    "join_qkvz",
    "next_needs",
    "next_shapes",
    "qkvz_arrays",
]

_A = "qwen3next"
MAX_KERNEL = 64
"""The longest short convolution (``shard.model.hybrid_config``'s bound; 4 in every model)."""

QKVZ_PARTS = ("attn_qkv", "attn_gate")
"""The two tensors today's converter splits ``in_proj_qkvz`` into (module docstring)."""


def qwen3next_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``Qwen3NextForCausalLM`` from the ``qwen3next.*`` keys (module
    docstring)."""
    no_scaling(reader, _A)
    expert_size = count(reader, f"{_A}.expert_feed_forward_length", most=MAX_WIDTH)
    keys = common(reader, _A, vocab_rows, ffn_default=expert_size, partial=True)
    head_dim, n_layers = keys["head_dim"], keys["num_hidden_layers"]
    value_length = count(reader, f"{_A}.attention.value_length", head_dim, most=MAX_WIDTH)
    if value_length != head_dim:
        raise ConvertError(
            f"{_A}.attention.value_length: {value_length}; Qwen3-Next's value heads are as wide "
            f"as its key heads ({head_dim})"
        )
    rotary = count(reader, f"{_A}.rope.dimension_count", least=2, most=head_dim)
    n_exp = count(reader, f"{_A}.expert_count", most=MAX_EXPERTS)
    for key, want in (("expert_weights_scale", 1.0), ("expert_gating_func", 1)):
        value = meta(reader, f"{_A}.{key}", want)
        if value != want:  # the graph routes with a softmax, weights unscaled
            raise ConvertError(f"{_A}.{key}: {value!r}; Qwen3-Next's is {want}")
    h = {t.name for t in reader.tensors}
    kinds = _layer_kinds(reader, n_layers)
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_act": "silu",
        **keys,
        "partial_rotary_factor": f32(rotary / head_dim),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": keys["rope_theta"],
            "partial_rotary_factor": f32(rotary / head_dim),
        },
        **_linear(reader),
        "layer_types": kinds,
        "num_experts": n_exp,
        "num_experts_per_tok": count(reader, f"{_A}.expert_used_count", most=n_exp),
        "moe_intermediate_size": expert_size,
        "shared_expert_intermediate_size": count(
            reader,
            f"{_A}.expert_shared_feed_forward_length",
            keys["intermediate_size"],
            most=MAX_WIDTH,
        ),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in h],
        "norm_topk_prob": True,
    }


def _linear(reader: GgufFile) -> dict[str, int]:
    """The DeltaNet layers' shape from the ``ssm.*`` keys, checked consistent."""
    n_k = count(reader, f"{_A}.ssm.group_count", most=MAX_HEADS)
    n_v = count(reader, f"{_A}.ssm.time_step_rank", most=MAX_HEADS)
    if n_v % n_k:
        raise ConvertError(
            f"{_A}.ssm.time_step_rank: {n_v} value heads are not a multiple of the "
            f"{n_k} key heads (ssm.group_count)"
        )
    inner = count(reader, f"{_A}.ssm.inner_size", most=MAX_WIDTH)
    if inner % n_v:
        raise ConvertError(
            f"{_A}.ssm.inner_size: {inner} is not a whole value head for each of the {n_v} "
            "value heads (ssm.time_step_rank)"
        )
    return {
        "linear_num_key_heads": n_k,
        "linear_num_value_heads": n_v,
        "linear_key_head_dim": count(reader, f"{_A}.ssm.state_size", most=MAX_WIDTH),
        "linear_value_head_dim": inner // n_v,
        "linear_conv_kernel_dim": count(reader, f"{_A}.ssm.conv_kernel", most=MAX_KERNEL),
    }


def _layer_kinds(reader: GgufFile, n_layers: int) -> list[str]:
    """``layer_types`` from ``attention.recurrent_layers`` (one flag per layer, true: linear),
    else from ``full_attention_interval`` (module docstring)."""
    key = f"{_A}.attention.recurrent_layers"
    field = reader.get_field(key)
    if field is not None:
        array = field.types[:1] == [gguf.GGUFValueType.ARRAY] and len(field.types) == 2
        values = field.contents() if array else []
        if not array or field.types[1] not in _FLAGS or len(values) != n_layers:
            raise ConvertError(f"{key}: expected one flag (0 or 1) per layer ({n_layers})")
        if set(values) - {0, 1}:
            raise ConvertError(f"{key}: expected one flag (0 or 1) per layer ({n_layers})")
        return ["linear_attention" if v else "full_attention" for v in values]
    interval = count(reader, f"{_A}.full_attention_interval", 4, most=MAX_BLOCKS)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]


_FLAGS = INTEGER_TYPES | {gguf.GGUFValueType.BOOL}

_ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_LINEAR = ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight", "ssm_norm.weight")
_SPARSE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp")
_SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def next_needs(config: dict[str, Any], layer: int, present: Mapping[str, Any]) -> list[str]:
    """The tensor names (less ``blk.N.``) block ``layer`` of a ``qwen3next`` GGUF needs: its
    full or linear attention (``in_proj_qkvz`` whole or split), dense or sparse feed-forward."""
    names = ["attn_norm.weight", "post_attention_norm.weight"]
    if config["layer_types"][layer] == "full_attention":
        names += [f"{n}.weight" for n in _ATTENTION]
    else:
        names += [*_LINEAR, "ssm_out.weight"]
        whole = f"blk.{layer}.ssm_in.weight" in present
        if whole and any(f"blk.{layer}.{n}.weight" in present for n in QKVZ_PARTS):
            raise ConvertError(
                f"tensor 'blk.{layer}.ssm_in.weight': block {layer} holds in_proj_qkvz twice "
                "(whole, and split into attn_qkv / attn_gate); a file has one form"
            )
        names += ["ssm_in.weight"] if whole else [f"{n}.weight" for n in QKVZ_PARTS]
    if layer in config["mlp_only_layers"]:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    else:
        names += [f"{n}.weight" for n in (*_SPARSE, *_SHARED)]
    return names


def next_shapes(config: dict[str, Any]) -> dict[str, tuple[int | None, ...]]:
    """The shapes (numpy order) a ``qwen3_next`` ``config`` implies for its own tensors."""
    if "linear_num_key_heads" not in config:
        return {}
    d, dh = config["hidden_size"], config["head_dim"]
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv = 2 * n_k * dk + n_v * dv
    shared = config["shared_expert_intermediate_size"]
    return {
        "attn_q.weight": (2 * config["num_attention_heads"] * dh, d),  # query and gate
        "ssm_in.weight": (conv + n_v * dv, d),
        "attn_qkv.weight": (conv, d),
        "attn_gate.weight": (n_v * dv, d),
        "ssm_conv1d.weight": (conv, config["linear_conv_kernel_dim"]),
        "ssm_dt.bias": (n_v,),
        "ssm_a": (n_v,),
        "ssm_ba.weight": (2 * n_v, d),
        "ssm_norm.weight": (dv,),
        "ssm_out.weight": (d, n_v * dv),
        "ffn_gate_inp_shexp.weight": (d,),  # or [1, D]: ``gate_row``
        "ffn_gate_shexp.weight": (shared, d),
        "ffn_up_shexp.weight": (shared, d),
        "ffn_down_shexp.weight": (d, shared),
    }


def join_qkvz(layer: int, parts: dict[str, gguf.ReaderTensor], config: dict[str, Any]) -> Planned:
    """``in_proj_qkvz`` of block ``layer`` from ``attn_qkv`` and ``attn_gate`` (``parts``, by
    short name, shapes already checked): planned as one float32 tensor."""
    from shard.convert.gguf_plan import Planned

    missing = [n for n in QKVZ_PARTS if n not in parts]
    if missing:
        raise ConvertError(f"tensor 'blk.{layer}.{missing[0]}.weight': missing; incomplete")
    qkv, z = parts["attn_qkv"], parts["attn_gate"]
    rows = int(qkv.shape[1]) + int(z.shape[1])
    name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    groups = (n_k, config["linear_key_head_dim"], n_v // n_k * config["linear_value_head_dim"])
    return Planned(name, (rows, int(qkv.shape[0])), qkv, None, up=z, qkvz=groups)


def a_log(ssm_a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``A_log`` from the stored ``ssm_a`` (``-exp(A_log)``): ``log(-ssm_a)`` in float64,
    rounded to float32; every value must be negative and finite."""
    if not (np.isfinite(ssm_a).all() and (ssm_a < 0).all()):
        raise ConvertError("tensor ssm_a: every value must be negative and finite (-exp(A_log))")
    return np.log(-ssm_a.astype(np.float64)).astype(np.float32)


def qkvz_arrays(
    qkv: npt.NDArray[np.float32], z: npt.NDArray[np.float32], groups: tuple[int, int, int]
) -> npt.NDArray[np.float32]:
    """``in_proj_qkvz`` from ``attn_qkv`` and ``attn_gate`` (float32): ``groups`` is ``(key
    heads, key head size, value rows per key head)``; per key head its q, k, v and z rows."""
    n_k, dk, _ = groups
    d = qkv.shape[-1]
    q, k, v = np.split(qkv, [n_k * dk, 2 * n_k * dk])
    grouped = [x.reshape(n_k, -1, d) for x in (q, k, v, z)]  # [Hk, rows per head, D] each
    return np.concatenate(grouped, axis=1).reshape(-1, d)  # per key head: q, k, v, z


def gate_row(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` of tensor ``name`` as checked: the shared expert's gate ``[1, D]`` (as the
    converter writes transformers' tensor) is read as ``[D]``."""
    if name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 2 and shape[0] == 1:
        return shape[1:]
    return shape


def hf_shape(short: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of block tensor ``short`` stored in ``shape`` (numpy order):
    ``conv1d`` gets its channel axis back, the shared expert's gate its output row."""
    if short == "ssm_conv1d.weight":
        return (shape[0], 1, shape[1])  # [C, K] -> [C, 1, K]
    if short == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
        return (1, shape[0])
    return shape


_BLOCKS = {
    **LLAMA_BLOCKS,
    **QK_NORM_BLOCKS,
    "post_attention_norm": "post_attention_layernorm",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_out": "linear_attn.out_proj",
    "ssm_norm": "linear_attn.norm",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
del _BLOCKS["ffn_norm"]  # the post-attention norm is post_attention_norm here

QWEN3NEXT = GgufArch(
    _BLOCKS,
    qwen3next_config,
    permuted_qk=False,
    norm_plus_one=True,
    experts={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
    bare={"ssm_a": "linear_attn.A_log"},
    plain_norms=("ssm_norm.weight",),
)
"""``qwen3next`` (Qwen3-Next) as shard's ``qwen3_next``."""
