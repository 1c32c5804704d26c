"""The linear-attention hybrids' declared differences: Qwen3-Next and Qwen3.5-MoE.

Both interleave Gated DeltaNet layers (``shard.model.deltanet``; ``LinearAttnConfig``) with
gated full attention (every ``full_attention_interval``-th layer by default, 4): the query
projection is twice as wide and its second half gates the attention output through a
sigmoid (``attn_output_gate``), q/k are RMS-normed per head, every norm scales by
``1 + weight`` in fp32 (``norm_unit_offset``, as Gemma) and a quarter of each head is
rotated (``partial_rotary_factor``). Their MoE is Qwen3-MoE's softmax router plus one shared
expert whose output a sigmoid gate scales (``MoeConfig.shared_gate``).

| ``model_type``       | a DeltaNet layer's projections         | sparse layers                  |
|----------------------|----------------------------------------|--------------------------------|
| ``qwen3_next``       | ``in_proj_qkvz``, ``in_proj_ba``       | ``decoder_sparse_step``,       |
|                      | (grouped per key head)                 | ``mlp_only_layers``            |
| ``qwen3_5_moe_text`` | ``in_proj_qkv``, ``_z``, ``_b``, ``_a`` | every layer (top-k renormed)   |

(The published Qwen3.5 checkpoints are multimodal, ``qwen3_5_moe`` with the text model's
config under ``text_config`` and its weights under ``model.language_model``; shard runs the
text model's own layout, ``Qwen3_5MoeForCausalLM``'s, which transformers' ``save_pretrained``
writes.) This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import Any

import attrs

from shard.model.config_fields import MAX, Fields
from shard.model.families import MoeConfig, layer_types_of

__all__ = ["HYBRIDS", "LinearAttnConfig", "hybrid_fields"]

#: The ``model_type`` s read here.
HYBRIDS = ("qwen3_next", "qwen3_5_moe_text")

#: The longest short convolution accepted (4 in every published config).
MAX_KERNEL = 64


@attrs.frozen
class LinearAttnConfig:
    """A Gated DeltaNet layer's shape: ``n_k_heads`` query/key heads of ``k_head_dim``, each
    serving ``n_v_heads / n_k_heads`` value heads of ``v_head_dim``, a causal convolution of
    ``conv_kernel`` taps; ``grouped``: Qwen3-Next's fused, per-key-head projections."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    grouped: bool

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: the queries, keys and values of every head."""
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    @property
    def state_elements(self) -> int:
        """Numbers in one session's recurrent state of one layer (``[Hv, Dk, Dv]``)."""
        return self.n_v_heads * self.k_head_dim * self.v_head_dim


def hybrid_fields(arch: str, f: Fields, n_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of ``arch`` (one of ``HYBRIDS``) beyond a Llama's, read as
    transformers' ``Qwen3NextConfig`` / ``Qwen3_5MoeTextConfig`` read them (their defaults
    where a key is absent), each typed and bounded."""
    width, heads = MAX["width"], MAX["heads"]
    la = LinearAttnConfig(
        n_k_heads=f.integer("linear_num_key_heads", 16, hi=heads),
        n_v_heads=f.integer("linear_num_value_heads", 32, hi=heads),
        k_head_dim=f.integer("linear_key_head_dim", 128, hi=width),
        v_head_dim=f.integer("linear_value_head_dim", 128, hi=width),
        conv_kernel=f.integer("linear_conv_kernel_dim", 4, hi=MAX_KERNEL),
        grouped=arch == "qwen3_next",
    )
    if la.n_v_heads % la.n_k_heads:
        raise f.error(
            "linear_num_value_heads", f"a multiple of linear_num_key_heads ({la.n_k_heads})",
            la.n_v_heads,
        )  # fmt: skip
    interval = f.integer("full_attention_interval", 4, hi=MAX["layers"])
    kinds = layer_types_of(f, n_layers, None) if f.has("layer_types") else tuple(
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
    )  # fmt: skip
    bad = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if bad or len(kinds) != n_layers:
        raise f.error("layer_types", f"{n_layers} of 'linear_attention' / 'full_attention'", bad)
    n_exp = f.integer("num_experts", 512 if arch == "qwen3_next" else 256, lo=0, hi=MAX["experts"])
    if arch == "qwen3_next":
        step = f.integer("decoder_sparse_step", 1, hi=MAX["layers"])
        dense = set(f.integers("mlp_only_layers", lo=0, hi=n_layers - 1, most=n_layers) or ())
        sparse = tuple(
            i for i in range(n_layers) if i not in dense and n_exp > 0 and (i + 1) % step == 0
        )
        norm_topk = f.flag("norm_topk_prob", True)
    else:
        sparse, norm_topk = tuple(range(n_layers)) if n_exp else (), True
    expert_size = f.integer("moe_intermediate_size", 512, hi=MAX["ffn"])
    out: dict[str, Any] = {
        "linear_attn": la,
        "layer_types": kinds,
        "qk_norm": True,
        "norm_unit_offset": True,
        "attn_output_gate": True,
        "partial_rotary": _partial_rotary(f),
    }
    if not f.has("intermediate_size"):  # Qwen3.5-MoE: every layer sparse, no dense size
        out["intermediate_size"] = expert_size
    if sparse:
        out["moe"] = MoeConfig(
            router="softmax",
            experts="swiglu",
            n_experts=n_exp,
            top_k=f.integer("num_experts_per_tok", 10 if arch == "qwen3_next" else 8,
                            hi=max(1, n_exp)),
            expert_size=expert_size,
            sparse_layers=sparse,
            norm_topk_prob=norm_topk,
            cast_weights=True,
            shared_gate=True,
            shared_size=f.integer("shared_expert_intermediate_size", 512, lo=0, hi=MAX["ffn"]),
        )  # fmt: skip
    return out


def _partial_rotary(f: Fields) -> float:
    key = "partial_rotary_factor"
    rope = f.table("rope_parameters")
    if rope is not None and rope.has(key):
        return rope.real(key, lo=0, hi=1, above=True)
    return f.real(key, 0.25, lo=0, hi=1, above=True)
