"""Which tensors a converted architecture needs, and the shapes its ``config.json`` implies.

A GGUF that leaves a tensor out, or gives one a shape its metadata contradicts, would
otherwise convert into a checkpoint that fails at load (or, for a missing norm, runs
silently wrong). ``check_tensors`` refuses it first, naming the tensor: every block's
attention, norms and feed-forward (dense, or router and experts, per layer as the family
lays them out) must be there, and every tensor's shape must agree with the hidden size, head
counts, head size, feed-forward widths and expert count (a shared expert's width is free).
This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gguf import GGMLQuantizationType as T

from shard.convert.gguf_common import ConvertError
from shard.convert.gguf_mla import mla_needs, mla_shapes
from shard.convert.gguf_next import gate_row, next_needs, next_shapes

__all__ = ["READABLE_TYPES", "check_tensors", "check_types"]

READABLE_TYPES: Final = frozenset(
    {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.NVFP4}
    | {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0}
    | {T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS}
)
"""The ggml types a tensor may have: those ``gguf.quants.dequantize`` decodes (a superset of
what ``shard.convert.quant_gguf`` keeps stored). The integer, F64, Q8_1, Q8_K and Q1_0 types
are no model weight's, and the gguf package cannot decode them."""

_ATTENTION: Final = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
_QK_NORM: Final = ("attn_q_norm", "attn_k_norm")
_DENSE: Final = ("ffn_gate", "ffn_up", "ffn_down")
_ROUTED: Final = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_SHARED: Final = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_DENSE_FAMILIES: Final = frozenset({"llama", "qwen3", "gemma3"})
# deepseek2's blocks and attention shapes: ``shard.convert.gguf_mla``; qwen3next's: ``gguf_next``
MAX_EXPERT_MATRICES: Final = 1 << 18
"""Experts times blocks: each is planned as its own output tensor, so this bounds the plan
(the largest real models have under 25,000)."""
_EXPERT_KEYS: Final = ("num_experts", "num_local_experts", "n_routed_experts")


def check_tensors(arch: str, config: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a GGUF of architecture ``arch`` (``gguf_arch.arch_of``'s name) whose tensors
    (``shapes``: name -> shape in numpy order) miss one its ``config`` needs or contradict
    it. Errors: ``ConvertError`` naming the tensor."""
    experts = _expert_count(config) * config["num_hidden_layers"]
    if experts > MAX_EXPERT_MATRICES:
        raise ConvertError(
            f"expert_count: {_expert_count(config)} experts in each of "
            f"{config['num_hidden_layers']} blocks are {experts} per projection; at most "
            f"{MAX_EXPERT_MATRICES} are converted"
        )
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in shapes:
            raise ConvertError(f"tensor {name!r}: missing; the file is incomplete")
    for layer in range(config["num_hidden_layers"]):
        for short in _block_needs(arch, config, layer, shapes):
            name = f"blk.{layer}.{short}"
            if name not in shapes:
                raise ConvertError(f"tensor {name!r}: missing; the file is incomplete")
    for name, shape in shapes.items():
        want = _expected(arch, config, name)
        shape = gate_row(name, shape) if arch == "qwen3next" else shape
        if want is not None and not _fits(shape, want):
            raise ConvertError(
                f"tensor {name!r}: shape {list(shape)} contradicts the metadata "
                f"(expected {['*' if d is None else d for d in want]})"
            )


def check_types(types: Mapping[str, T]) -> None:
    """Refuse a tensor (``types``: name -> ggml type) in a type the converter cannot read."""
    for name, qtype in types.items():
        if qtype not in READABLE_TYPES:
            raise ConvertError(
                f"tensor {name!r} type: {qtype.name} is not a weight type this converter "
                "reads (float, or one of llama.cpp's block quantizations)"
            )


def _block_needs(
    arch: str, config: dict[str, Any], layer: int, present: Mapping[str, Any]
) -> list[str]:
    """The tensor names (less ``blk.N.``) every block ``layer`` of ``arch`` has (``present``:
    the file's tensors, which say which form of ``kv_b_proj`` a ``deepseek2`` file holds)."""
    if arch == "deepseek2":
        return mla_needs(config, layer, present)
    if arch == "qwen3next":
        return next_needs(config, layer, present)
    names = list(_ATTENTION)
    if arch in ("qwen3", "gemma3", "qwen3moe", "minimax-m2") or config.get("use_qk_norm"):
        names += _QK_NORM
    if arch in ("gpt-oss", "glm4moe", "gemma3"):
        names.append("post_attention_norm")
    if arch not in ("gpt-oss", "glm4moe"):
        names.append("ffn_norm")
    if arch == "gemma3":
        names.append("post_ffw_norm")
    if arch in _DENSE_FAMILIES:
        names += _DENSE
    elif arch == "qwen3moe":
        names += _DENSE if layer in config["mlp_only_layers"] else _ROUTED
    elif arch == "glm4moe" and layer < config["first_k_dense_replace"]:
        names += _DENSE
    else:  # Mixtral, gpt-oss, MiniMax-M2, GLM's sparse layers
        names += _ROUTED
    if arch == "gpt-oss":
        names.append("attn_sinks")
    sparse_glm = arch == "glm4moe" and layer >= config["first_k_dense_replace"]
    if sparse_glm and config["n_shared_experts"]:
        names += _SHARED
    suffixed = [f"{n}.weight" for n in names]
    if sparse_glm or arch == "minimax-m2":
        suffixed.append("exp_probs_b.bias")
    return suffixed


def _expected(arch: str, config: dict[str, Any], name: str) -> tuple[int | None, ...] | None:
    """The shape ``name`` must have (None: any size there), or None when not checked here."""
    d, dh = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * dh, config["num_key_value_heads"] * dh
    ffn = config["intermediate_size"]
    short = name.split(".", 2)[2] if name.startswith("blk.") and name.count(".") > 1 else name
    table: dict[str, tuple[int | None, ...]] = {
        "token_embd.weight": (None, d),
        "output.weight": (config["vocab_size"], d),
        "output_norm.weight": (d,),
        "attn_q.weight": (q, d),
        "attn_k.weight": (kv, d),
        "attn_v.weight": (kv, d),
        "attn_output.weight": (d, q),
        "attn_q_norm.weight": (dh,),
        "attn_k_norm.weight": (dh,),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_output.bias": (d,),
        "attn_sinks.weight": (config["num_attention_heads"],),
        **{f"{n}.weight": (d,) for n in _NORMS},
        "ffn_gate.weight": (ffn, d),
        "ffn_up.weight": (ffn, d),
        "ffn_down.weight": (d, ffn),
        "ffn_gate_shexp.weight": (None, d),
        "ffn_up_shexp.weight": (None, d),
        "ffn_down_shexp.weight": (d, None),
        **_expert_shapes(config),
        **mla_shapes(config),
        **next_shapes(config),
    }
    if arch == "minimax-m2":  # its q/k norms span all heads at once
        table |= {"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)}
    return table.get(short)


def _expert_shapes(config: dict[str, Any]) -> dict[str, tuple[int | None, ...]]:
    """The router's and the fused experts' shapes (``[E, out, in]``), where ``config`` has
    experts: ``E`` their count, each ``moe_intermediate_size`` wide (Mixtral and gpt-oss:
    ``intermediate_size``)."""
    e = _expert_count(config)
    if not e:
        return {}
    d = config["hidden_size"]
    f = config.get("moe_intermediate_size", config["intermediate_size"])
    return {
        "ffn_gate_inp.weight": (e, d),
        "ffn_gate_inp.bias": (e,),
        "exp_probs_b.bias": (e,),
        "ffn_gate_exps.weight": (e, f, d),
        "ffn_up_exps.weight": (e, f, d),
        "ffn_down_exps.weight": (e, d, f),
        "ffn_gate_exps.bias": (e, f),
        "ffn_up_exps.bias": (e, f),
        "ffn_down_exps.bias": (e, d),
    }


_NORMS: Final = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")


def _expert_count(config: dict[str, Any]) -> int:
    """The experts per block (0: a dense model)."""
    return next((int(config[k]) for k in _EXPERT_KEYS if k in config), 0)


def _fits(shape: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    if len(shape) != len(want):
        return False
    return all(w is None or s == w for s, w in zip(shape, want, strict=True))
