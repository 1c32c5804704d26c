"""Rotary frequency scaling read from a ``config.json``'s ``rope_scaling`` / ``rope_parameters``.

``RopeScaling`` is the typed record ``ModelConfig.rope_scaling`` holds; ``rope_scaling`` reads it
through ``Fields`` (each field typed and bounded), with YaRN's ``mscale`` / ``mscale_all_dim``
turned into the cos/sin factor as transformers computes it (DeepSeek-V3). This module imports
neither torch nor safetensors.
"""

from __future__ import annotations

import math

import attrs

from shard.model.config_fields import MAX, Fields, ModelLoadError

__all__ = ["RopeScaling", "rope_scaling"]


@attrs.frozen
class RopeScaling:
    """Rotary frequency scaling: ``kind`` is HF's ``rope_type`` — ``"llama3"`` (Llama 3.x),
    ``"yarn"`` (gpt-oss; ``beta_*``, ``truncate``, ``attention_factor``) or ``"linear"``
    (positions divided by ``factor``). Fields another kind does not use keep their defaults."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


def rope_scaling(f: Fields | None, max_pos: int) -> RopeScaling | None:
    """Parse a ``rope_scaling`` / ``rope_parameters`` table (``llama3``, ``yarn``, ``linear``)."""
    if f is None:
        return None
    kind = f.text("rope_type") or f.text("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "yarn", "linear"):
        raise ModelLoadError(
            f"rope scaling type {kind!r} is not supported; shard implements 'llama3', 'yarn' "
            "and 'linear'"
        )
    attn_factor = f.opt_real("attention_factor", lo=0, above=True)
    factor = f.real("factor", lo=0, above=True)
    if kind == "yarn" and attn_factor is None:
        attn_factor = _yarn_attention_factor(
            factor,
            f.opt_real("mscale", lo=0),
            f.opt_real("mscale_all_dim", lo=0),
        )
    return RopeScaling(
        factor=factor,
        low_freq_factor=f.real("low_freq_factor", 1.0, lo=0, above=True),
        high_freq_factor=f.real("high_freq_factor", 4.0, lo=0, above=True),
        original_max_position_embeddings=f.integer(
            "original_max_position_embeddings", max_pos, hi=MAX["positions"]
        ),
        kind=kind,
        beta_fast=f.real("beta_fast", 32.0, lo=0, above=True),
        beta_slow=f.real("beta_slow", 1.0, lo=0, above=True),
        truncate=f.flag("truncate", True),
        attention_factor=attn_factor,
    )


def _yarn_attention_factor(
    factor: float, mscale: float | None, mscale_all_dim: float | None
) -> float | None:
    """The cos/sin scale transformers' ``_compute_yarn_parameters`` derives from ``mscale``
    and ``mscale_all_dim`` when both are set (DeepSeek): mscale(f, mscale) / mscale(f,
    mscale_all_dim); None (the plain YaRN factor) otherwise."""
    if not (mscale and mscale_all_dim):
        return None
    return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``): transformers'
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
