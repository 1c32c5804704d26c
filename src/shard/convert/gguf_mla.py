"""llama.cpp's ``deepseek2`` GGUFs (DeepSeek-V3, Kimi K2: MLA and DeepSeekMoE) read as shard's
``deepseek_v3`` family: the ``config.json`` reader, the tensor names, which tensors each block
needs and their shapes, and the one tensor rebuilt on the way in (``kv_b_proj``).

Verified against llama.cpp's own sources (``conversion/deepseek.py``'s ``DeepseekV2Model``,
``conversion/base.py``'s ``TextModel.set_gguf_parameters``, ``src/models/deepseek2.cpp``, the
deepseek2 hparams loader and ``llama-context.cpp``'s YaRN setup, ``gguf-py``'s
``MODEL_TENSORS[DEEPSEEK2]``):

- Names: ``attn_q`` (no low-rank query) or ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``,
  ``attn_kv_a_mqa`` (``kv_a_proj_with_mqa``: the latent, then the shared rotary key),
  ``attn_kv_a_norm``, ``attn_output``; the experts fused ``ffn_*_exps``, shared experts
  ``ffn_*_shexp``, the router ``ffn_gate_inp``, its correction bias ``exp_probs_b.bias``; the
  first ``leading_dense_block_count`` layers dense. Nothing is permuted: llama.cpp rotates
  interleaved pairs for ``deepseek2`` (``LLAMA_ROPE_TYPE_NORM``), which is transformers'
  ``rope_interleave`` true on the checkpoint's own rows (a GGUF cannot say otherwise).
- ``kv_b_proj`` ``[H (nope + v), r]``: older converters store it whole (``attn_kv_b``); newer
  ones split it per head into ``attn_k_b`` — the key rows *transposed*, ``[H, r, nope]`` in
  numpy order — and ``attn_v_b`` ``[H, v, r]``, write ``head_count_kv`` 1 (MQA over the
  latent), ``key_length`` ``r + rope``, ``value_length`` ``r`` and the per-head sizes in
  ``key_length_mla`` / ``value_length_mla``. ``join_kv_b`` puts the split form back (float32:
  the transposed key's blocks run along ``nope``, not along the latent). A file holding both
  forms of a layer is read from ``attn_kv_b`` (the halves, shape-checked, are a copy).
- Routing: ``expert_gating_func`` 2 (sigmoid, DeepSeek-V3's); llama.cpp reads a file without it
  as softmax (DeepSeek-V2), which shard's ``deepseek_v3`` does not run, so it is refused.
  ``expert_weights_scale`` absent means 1, ``expert_weights_norm`` absent means false.
- YaRN: the converter writes ``rope.scaling.yarn_log_multiplier`` as ``0.1 * mscale_all_dim``
  and drops ``mscale``; llama.cpp divides by 0.1 and, for ``deepseek2``, takes ``mscale``
  equal to ``mscale_all_dim`` (cos/sin unscaled, softmax scale times ``mscale(factor,
  mscale_all_dim)^2``), which is transformers' model with both set to that value. A YaRN file
  without the multiplier, or with ``yarn_attn_factor`` / ``yarn_ext_factor``, is refused (the
  two runtimes disagree on it). The latent norms keep transformers' fixed 1e-6 (llama.cpp uses
  ``layer_norm_rms_epsilon`` there; DeepSeek-V3's is 1e-6 too).

Multi-token-prediction layers are not in a ``deepseek2`` GGUF (the converter skips them).
This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from shard.convert.gguf_common import (
    LLAMA_BLOCKS,
    MAX_EXPERTS,
    MAX_WIDTH,
    ConvertError,
    GgufArch,
    common,
    count,
    f32,
    meta,
    positive,
)

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile
    from shard.convert.gguf_plan import Planned

__all__ = ["DEEPSEEK2", "SPLIT_KV", "join_kv_b", "mla_needs", "mla_shapes"]

_A = "deepseek2"

SPLIT_KV = ("attn_k_b", "attn_v_b")
"""The two halves newer converters split ``kv_b_proj`` into (module docstring)."""


def deepseek2_config(reader: GgufFile, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``DeepseekV3ForCausalLM`` from the ``deepseek2.*`` keys (module
    docstring: both attention forms, sigmoid routing, YaRN's mscale)."""
    expert_size = count(reader, f"{_A}.expert_feed_forward_length", most=MAX_WIDTH)
    keys = common(reader, _A, vocab_rows, ffn_default=expert_size, partial=True)
    n_head = keys["num_attention_heads"]
    rope, nope, v, rank = _latent(reader, keys)
    q_rank = None
    if reader.get_field(f"{_A}.attention.q_lora_rank") is not None:
        q_rank = count(reader, f"{_A}.attention.q_lora_rank", most=MAX_WIDTH)
    _check_query_form(reader, q_rank)
    gating = count(reader, f"{_A}.expert_gating_func", 0, least=0, most=1 << 16)
    if gating != 2:  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ConvertError(
            f"{_A}.expert_gating_func: {gating or 'absent'}; DeepSeek-V3 routes with a sigmoid "
            "(2) — a softmax router (DeepSeek-V2, also what llama.cpp reads when absent) is not "
            "supported"
        )
    n_exp = count(reader, f"{_A}.expert_count", most=MAX_EXPERTS)
    groups = count(reader, f"{_A}.expert_group_count", 1, most=n_exp)
    n_layers = keys["num_hidden_layers"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_act": "silu",
        **keys,
        "num_key_value_heads": n_head,  # transformers' MLA: every head reads the one latent
        "head_dim": rope,
        "q_lora_rank": q_rank,
        "kv_lora_rank": rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "rope_interleave": True,
        "rope_scaling": _yarn(reader, keys["rope_theta"]),
        "n_routed_experts": n_exp,
        "num_experts_per_tok": count(reader, f"{_A}.expert_used_count", most=n_exp),
        "moe_intermediate_size": expert_size,
        "n_shared_experts": count(reader, f"{_A}.expert_shared_count", 0, least=0, most=n_exp),
        "first_k_dense_replace": count(
            reader, f"{_A}.leading_dense_block_count", least=0, most=n_layers
        ),
        "routed_scaling_factor": positive(reader, f"{_A}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta(reader, f"{_A}.expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": count(reader, f"{_A}.expert_group_used_count", groups, most=groups),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
    }


def _latent(reader: GgufFile, keys: dict[str, Any]) -> tuple[int, int, int, int]:
    """``(rope, nope, v, kv_lora_rank)``: per-head sizes from ``key_length_mla`` /
    ``value_length_mla`` (MQA form: one KV head over ``r + rope``) or else ``key_length`` /
    ``value_length`` (MHA form: a KV head per query head)."""
    n_head, n_kv, key_length = (
        keys["num_attention_heads"], keys["num_key_value_heads"], keys["head_dim"]
    )  # fmt: skip
    rank = count(reader, f"{_A}.attention.kv_lora_rank", most=MAX_WIDTH)
    rope = count(reader, f"{_A}.rope.dimension_count", least=2, most=MAX_WIDTH)
    value_length = count(reader, f"{_A}.attention.value_length", most=MAX_WIDTH)
    if reader.get_field(f"{_A}.attention.key_length_mla") is not None:
        if n_kv != 1:
            raise ConvertError(
                f"{_A}.attention.head_count_kv: {n_kv}; a GGUF with key_length_mla holds the "
                "latent as one KV head (1)"
            )
        if (key_length, value_length) != (rank + rope, rank):
            raise ConvertError(
                f"{_A}.attention.key_length / value_length: {key_length} / {value_length} "
                f"contradict kv_lora_rank {rank} and rope.dimension_count {rope} (expected "
                f"{rank + rope} / {rank})"
            )
        qk = count(reader, f"{_A}.attention.key_length_mla", most=MAX_WIDTH)
        v = count(reader, f"{_A}.attention.value_length_mla", most=MAX_WIDTH)
    else:
        if n_kv != n_head:
            raise ConvertError(
                f"{_A}.attention.head_count_kv: {n_kv}; without key_length_mla an MLA GGUF "
                f"has one KV head per query head ({n_head})"
            )
        qk, v = key_length, value_length
    if qk <= rope:
        raise ConvertError(
            f"{_A}: a query head of {qk} leaves no unrotated part beside the {rope} rotated"
        )
    return rope, qk - rope, v, rank


def _check_query_form(reader: GgufFile, q_rank: int | None) -> None:
    """A plain ``attn_q`` and the low-rank ``attn_q_a`` each need their metadata (one form)."""
    unwanted = "attn_q.weight" if q_rank is not None else "attn_q_a.weight"
    for t in reader.tensors:
        if t.name.endswith(f".{unwanted}"):
            raise ConvertError(
                f"tensor {t.name!r}: the metadata "
                f"{'gives' if q_rank is not None else 'has no'} attention.q_lora_rank, so the "
                f"query is {'low-rank' if q_rank is not None else 'one plain attn_q'}"
            )


def _yarn(reader: GgufFile, theta: float) -> dict[str, Any] | None:
    """``rope_scaling`` from ``rope.scaling.*`` (module docstring), or None without scaling."""
    kind = meta(reader, f"{_A}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ConvertError(f"{_A}.rope.scaling.type: {kind!r}; only 'yarn' is supported")
    for extra in ("yarn_attn_factor", "yarn_ext_factor"):
        if reader.get_field(f"{_A}.rope.scaling.{extra}") is not None:
            raise ConvertError(f"{_A}.rope.scaling.{extra}: not supported for {_A} GGUFs")
    key = f"{_A}.rope.scaling.yarn_log_multiplier"
    if reader.get_field(key) is None:
        raise ConvertError(
            f"{key}: absent; DeepSeek's YaRN needs it (0.1 * mscale_all_dim) — without it "
            "llama.cpp and transformers scale attention differently"
        )
    all_dim = f32(positive(reader, key) / 0.1)  # of the shortest decimals: 0.08 -> 0.8
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": positive(reader, f"{_A}.rope.scaling.factor"),
        "original_max_position_embeddings": count(
            reader, f"{_A}.rope.scaling.original_context_length", most=1 << 20
        ),
        "beta_fast": positive(reader, f"{_A}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": positive(reader, f"{_A}.rope.scaling.yarn_beta_slow", 1.0),
        "mscale": all_dim,
        "mscale_all_dim": all_dim,
    }


def mla_needs(config: dict[str, Any], layer: int, present: Mapping[str, Any]) -> list[str]:
    """The tensor names (less ``blk.N.``) block ``layer`` of a ``deepseek2`` GGUF needs:
    its query form, ``attn_kv_b`` or both split halves, dense or routed and shared experts."""
    names = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
    names += ["attn_q"] if config["q_lora_rank"] is None else ["attn_q_a", "attn_q_a_norm"]
    names += [] if config["q_lora_rank"] is None else ["attn_q_b"]
    whole = f"blk.{layer}.attn_kv_b.weight" in present
    names += ["attn_kv_b"] if whole else list(SPLIT_KV)
    if layer < config["first_k_dense_replace"]:
        names += ["ffn_gate", "ffn_up", "ffn_down"]
    else:
        names += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        if config["n_shared_experts"]:
            names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    suffixed = [f"{n}.weight" for n in names]
    return suffixed + ([] if layer < config["first_k_dense_replace"] else ["exp_probs_b.bias"])


def mla_shapes(config: dict[str, Any]) -> dict[str, tuple[int | None, ...]]:
    """The attention tensors' shapes (numpy order) a ``deepseek_v3`` ``config`` implies."""
    if "kv_lora_rank" not in config:
        return {}
    d, h, r = config["hidden_size"], config["num_attention_heads"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    out: dict[str, tuple[int | None, ...]] = {
        "attn_q.weight": (h * (nope + rope), d),
        "attn_kv_a_mqa.weight": (r + rope, d),
        "attn_kv_a_norm.weight": (r,),
        "attn_kv_b.weight": (h * (nope + v), r),
        "attn_k_b.weight": (h, r, nope),
        "attn_v_b.weight": (h, v, r),
        "attn_output.weight": (d, h * v),
    }
    if config["q_lora_rank"] is not None:
        q = config["q_lora_rank"]
        out |= {
            "attn_q_a.weight": (q, d),
            "attn_q_a_norm.weight": (q,),
            "attn_q_b.weight": (h * (nope + rope), q),
        }
    return out


def join_kv_b(layer: int, parts: dict[str, gguf.ReaderTensor]) -> Planned:
    """``kv_b_proj`` of block ``layer`` from its split halves (``parts``: ``attn_k_b`` and
    ``attn_v_b`` by short name, shapes already checked): planned as one float32 tensor."""
    from shard.convert.gguf_plan import Planned

    missing = [n for n in SPLIT_KV if n not in parts]
    if missing:
        raise ConvertError(f"tensor 'blk.{layer}.{missing[0]}.weight': missing; incomplete")
    k, v = parts["attn_k_b"], parts["attn_v_b"]
    h, r, nope = (int(x) for x in reversed(k.shape.tolist()))
    v_dim = int(v.shape.tolist()[1])
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    return Planned(name, (h * (nope + v_dim), r), k, None, up=v, latent=True)


def join_arrays(k: np.ndarray, v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``kv_b_proj`` from ``k`` ``[H, r, nope]`` and ``v`` ``[H, v, r]`` (float32): per head the
    key rows (``k`` transposed back), then the value rows — transformers' layout."""
    return np.concatenate([k.swapaxes(1, 2), v], axis=1).reshape(shape)  # [H, nope + v, r]


_BLOCKS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    **{k: v for k, v in LLAMA_BLOCKS.items() if k.startswith("ffn_") and k != "ffn_norm"},
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}

DEEPSEEK2 = GgufArch(
    _BLOCKS,
    deepseek2_config,
    permuted_qk=False,
    norm_plus_one=False,
    experts={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
)
"""``deepseek2`` (DeepSeek-V3, Kimi K2) as shard's ``deepseek_v3``."""
