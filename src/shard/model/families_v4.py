"""DeepSeek-V4's declared differences (``deepseek_v4``), read as transformers'
``DeepseekV4Config`` reads them.

V4 is not a Llama with a twist: its residual is ``hc_mult`` streams mixed by hyper-connections,
its attention is one shared K=V head over a sliding window plus compressed entries (CSA with a
lightning indexer, or HCA), its first layers route experts by token id. ``V4Config`` holds all
of it; ``shard.model.deepseek_v4`` acts on it. The legacy keys DeepSeek's own ``config.json``
ships (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, a flat ``rope_scaling``)
fold in as transformers folds them. This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import Any

import attrs

from shard.model.config_fields import MAX, Fields, ModelLoadError
from shard.model.rope_config import RopeScaling, rope_scaling

__all__ = ["KINDS", "V4Config", "deepseek_v4_fields"]

#: Attention kinds by layer (transformers' ``layer_types``), and the legacy ratio of each.
KINDS = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")


@attrs.frozen
class V4Config:
    """DeepSeek-V4 beyond ``ModelConfig``'s common fields (module docstring).

    ``kinds``: each layer's attention (a ``KINDS`` key); ``ratios``: the compression rate of
    each kind (``compress_rates``); ``hash_layers``: the layers whose experts are chosen by
    ``tid2eid[token id]``; ``compress_theta`` / ``compress_scaling``: the rope of compressed
    layers, their compressors and indexer (sliding layers use ``ModelConfig.rope_theta``)."""

    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    kinds: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    hash_layers: tuple[int, ...]
    compress_theta: float
    compress_scaling: RopeScaling | None
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    top_k: int
    expert_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring: str

    def ratio(self, layer: int) -> int:
        """Layer ``layer``'s compression rate (0: sliding window only)."""
        kind = self.kinds[layer]
        return 0 if kind == "sliding_attention" else (
            self.csa_ratio if kind == "compressed_sparse_attention" else self.hca_ratio
        )  # fmt: skip

    def state_width(self, head_dim: int) -> int:
        """Numbers a layer's compressor state takes per position in ``KVCache.v``
        (``shard.model.v4_attention``): CSA ``5 head_dim + 5 index_head_dim``, HCA
        ``3 head_dim``; the widest kind present (at least 1)."""
        widths = {
            "sliding_attention": 1,
            "compressed_sparse_attention": 5 * head_dim + 5 * self.index_head_dim,
            "heavily_compressed_attention": 3 * head_dim,
        }
        return max(widths[k] for k in self.kinds)


def deepseek_v4_fields(f: Fields, n_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a DeepSeek-V4 ``config.json`` (``v4`` and the common
    fields V4 sets its own way); ``ModelLoadError`` (one line) for what shard does not run."""
    width = MAX["width"]
    kinds = _kinds(f, n_layers)
    hash_layers = _hash_layers(f, n_layers)
    head_dim = f.integer("head_dim", 512, hi=width)
    rope = f.table("rope_parameters")
    partial = _partial(f, rope, head_dim)
    compress = rope.table("compress") if rope is not None else None
    flat = f.table("rope_scaling") or (rope if rope is not None and compress is None else None)
    scaling_table = compress if compress is not None else flat
    compress_theta = (
        compress.real("rope_theta", lo=0, above=True)
        if compress is not None and compress.has("rope_theta")
        else f.real("compress_rope_theta", 160000.0, lo=0, above=True)
    )
    scaling = rope_scaling(scaling_table, f.integer("max_position_embeddings", hi=MAX["positions"]))
    if scaling is not None and scaling.kind == "yarn" and compress is None:
        scaling = attrs.evolve(scaling, attention_factor=1.0)  # transformers forces it
    if scaling is not None and scaling.kind != "yarn":
        raise f.error("rope_scaling", "yarn or none (DeepSeek-V4's compressed rope)", scaling.kind)
    rates = f.table("compress_rates")
    scoring = f.text("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise f.error("scoring_func", f"one of {SCORING}", scoring)
    if f.integer("n_shared_experts", 1, lo=0, hi=MAX["experts"]) != 1:
        raise f.error(
            "n_shared_experts", "1 (transformers' V4 builds one)", f.raw("n_shared_experts")
        )
    n_exp = f.integer("n_routed_experts", 256, hi=MAX["experts"])
    heads = f.integer("num_attention_heads", hi=MAX["heads"])
    v4 = V4Config(
        hc_mult=f.integer("hc_mult", 4, hi=64),
        hc_sinkhorn_iters=f.integer("hc_sinkhorn_iters", 20, hi=1000),
        hc_eps=f.real("hc_eps", 1e-6, lo=0, hi=1, above=True),
        kinds=kinds,
        csa_ratio=rates.integer("compressed_sparse_attention", 4, hi=MAX["positions"])
        if rates is not None else f.integer("compress_rate_csa", 4, hi=MAX["positions"]),
        hca_ratio=rates.integer("heavily_compressed_attention", 128, hi=MAX["positions"])
        if rates is not None else f.integer("compress_rate_hca", 128, hi=MAX["positions"]),
        hash_layers=hash_layers,
        compress_theta=compress_theta,
        compress_scaling=scaling,
        q_lora_rank=f.integer("q_lora_rank", 1024, hi=width),
        o_groups=f.integer("o_groups", 8, hi=heads),
        o_lora_rank=f.integer("o_lora_rank", 1024, hi=width),
        index_n_heads=f.integer("index_n_heads", 64, hi=MAX["heads"]),
        index_head_dim=f.integer("index_head_dim", 128, hi=width),
        index_topk=f.integer("index_topk", 512, hi=MAX["positions"]),
        n_experts=n_exp,
        top_k=f.integer("num_experts_per_tok", 6, hi=n_exp),
        expert_size=f.integer("moe_intermediate_size", 2048, hi=MAX["ffn"]),
        routed_scaling_factor=f.real("routed_scaling_factor", 1.5, lo=0, above=True),
        swiglu_limit=f.real("swiglu_limit", 10.0, lo=0, above=True),
        scoring=scoring,
    )  # fmt: skip
    if heads % v4.o_groups:
        raise f.error("o_groups", f"a divisor of num_attention_heads ({heads})", v4.o_groups)
    if int(head_dim * partial) > min(head_dim, v4.index_head_dim):
        raise f.error("qk_rope_head_dim", "at most head_dim and index_head_dim", head_dim * partial)
    return {
        "v4": v4,
        "head_dim": head_dim,
        "partial_rotary": partial,
        "intermediate_size": v4.expert_size,
        "sliding_window": f.integer("sliding_window", 128, hi=MAX["positions"]),
        "attention_sinks": True,
        "rope_scaling": None,  # the sliding layers' ("main") rope is never scaled
    }


def _kinds(f: Fields, n_layers: int) -> tuple[str, ...]:
    """``layer_types``, else legacy ``compress_ratios`` (0 / 4 / 128 a layer, extra entries
    for the MTP layer dropped), else transformers' default (2 HCA, then CSA / HCA)."""
    given = f.texts("layer_types", most=MAX["layers"] + 8)
    if given is None and f.has("compress_ratios"):
        ratios = f.integers("compress_ratios", lo=0, hi=MAX["positions"], most=MAX["layers"] + 8)
        names = {v: k for k, v in KINDS.items()}
        if ratios is None or any(r not in names for r in ratios):
            raise f.error("compress_ratios", "entries of 0, 4 or 128", f.raw("compress_ratios"))
        given = tuple(names[r] for r in ratios)
    if given is None:
        rest = ("compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(n_layers - 2, 0)))  # fmt: skip
        given = ("heavily_compressed_attention",) * min(n_layers, 2) + tuple(rest)
    given = given[:n_layers]
    if len(given) != n_layers or not set(given) <= set(KINDS):
        raise f.error("layer_types", f"{n_layers} of {sorted(KINDS)}", list(given))
    return given


def _hash_layers(f: Fields, n_layers: int) -> tuple[int, ...]:
    kinds = f.texts("mlp_layer_types", most=MAX["layers"] + 8)
    if kinds is None:
        n_hash = f.integer("num_hash_layers", 3, lo=0, hi=MAX["layers"])
        return tuple(range(min(n_hash, n_layers)))
    kinds = kinds[:n_layers]
    if len(kinds) != n_layers or not set(kinds) <= {"hash_moe", "moe"}:
        raise f.error("mlp_layer_types", f"{n_layers} of 'hash_moe' / 'moe'", list(kinds))
    return tuple(i for i, k in enumerate(kinds) if k == "hash_moe")


def _partial(f: Fields, rope: Fields | None, head_dim: int) -> float:
    """The rotated fraction of a head: ``partial_rotary_factor``, else legacy
    ``qk_rope_head_dim / head_dim``, else transformers' default 64 / 512."""
    if f.raw("partial_rotary_factor") is not None:
        return f.real("partial_rotary_factor", lo=0, hi=1, above=True)
    if f.has("qk_rope_head_dim"):
        return f.integer("qk_rope_head_dim", hi=head_dim) / head_dim
    main = rope.table("main") if rope is not None else None
    if main is not None and main.has("partial_rotary_factor"):
        return main.real("partial_rotary_factor", lo=0, hi=1, above=True)
    return 64 / 512


def check_v4(v4: V4Config, n_layers: int, head_dim: int, rotary_dim: int) -> None:
    """``ModelConfig``'s checks of a V4 config; ``ModelLoadError`` (one line) if inconsistent."""
    if len(v4.kinds) != n_layers or any(not 0 <= i < n_layers for i in v4.hash_layers):
        raise ModelLoadError("invalid model config: V4 layer kinds must name every layer")
    if v4.top_k > v4.n_experts or v4.csa_ratio < 1 or v4.hca_ratio < 1:
        raise ModelLoadError("invalid model config: V4 top_k / compress rates out of range")
    if rotary_dim > head_dim or rotary_dim > v4.index_head_dim:
        raise ModelLoadError("invalid model config: V4 rope dims exceed a head")
