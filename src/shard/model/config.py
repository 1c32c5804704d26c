"""The model's shape, read from a Hugging Face ``config.json``.

``ModelConfig`` is the one typed view of a checkpoint's architecture that the runtime, the loader
and placement share. It is built at the edge (``from_hf`` / ``from_dir``) and validated there, so
everything downstream can trust it. This module imports neither torch nor safetensors: the
coordinator and the planner read configs without paying for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ARCHITECTURES", "ModelConfig", "ModelLoadError", "RopeScaling"]

#: HF ``model_type`` -> the ``architectures`` entry transformers uses for it.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


class ModelLoadError(Exception):
    """A checkpoint cannot be used: the message says what is wrong and what to do."""


@attrs.frozen
class RopeScaling:
    """Llama-3 style (``rope_type: "llama3"``) rotary frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM).

    ``sliding_window`` is Mistral's local attention span (``None``: full causal attention).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(self.arch in ARCHITECTURES, f"unsupported architecture {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads"):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _check(
            self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0,
            f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        _check(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim must be even, got {self.head_dim}",
        )
        _check(self.max_position_embeddings > 0, "max_position_embeddings must be positive")

    @property
    def architecture(self) -> str:
        """The transformers class name for this arch (``"LlamaForCausalLM"``, ...)."""
        return ARCHITECTURES[self.arch]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a HF ``config.json`` dict.

        Accepts both the classic layout (``rope_theta`` + ``rope_scaling``) and transformers 5's
        ``rope_parameters``. Raises ``ModelLoadError`` for an unsupported architecture or
        feature rather than silently computing something else.
        """
        try:
            return _from_hf(cls, d)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(
                f"config.json is not a usable Llama-family config ({type(e).__name__}: {e}); "
                "check that the checkpoint is a Llama, Qwen2 or Mistral causal LM"
            ) from e

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; ``ModelLoadError`` if it is missing or not JSON."""
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(
                f"no config.json in {path}: point at a Hugging Face checkpoint directory "
                "(config.json + *.safetensors)"
            )
        try:
            d = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {cfg}: {e}; re-download the checkpoint") from e
        if not isinstance(d, dict):
            raise ModelLoadError(f"{cfg} is not a JSON object; re-download the checkpoint")
        return cls.from_hf(d)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers' ``*ForCausalLM`` classes accept."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _one_or_list(self.eos_token_ids),
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **attrs.asdict(self.rope_scaling)}
        if self.arch == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        elif self.arch == "qwen2":
            d["use_sliding_window"] = False
            d["sliding_window"] = None
        else:
            d["sliding_window"] = self.sliding_window
        return d


def _from_hf(cls: type[ModelConfig], d: dict[str, Any]) -> ModelConfig:
    arch = _arch_of(d)
    n_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    rope = d.get("rope_parameters") or {}
    rope_theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = d.get("rope_scaling") or rope or None
    if d.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported; only bias-free MLPs are")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {d['hidden_act']!r} is not supported; only 'silu' is")
    sliding = None
    if arch == "mistral":
        sliding = d.get("sliding_window")
    elif arch == "qwen2" and d.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 use_sliding_window=true is not supported; set it to false")
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return cls(
        arch=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(scaling, int(d["max_position_embeddings"])),
        max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
        bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
        eos_token_ids=tuple(int(i) for i in eos_ids),
        sliding_window=None if sliding is None else int(sliding),
    )


def _arch_of(d: dict[str, Any]) -> str:
    """The arch key from ``model_type``, falling back to ``architectures``."""
    model_type = d.get("model_type")
    if model_type in ARCHITECTURES:
        return str(model_type)
    for name in d.get("architectures") or ():
        for arch, cls_name in ARCHITECTURES.items():
            if name == cls_name:
                return arch
    found = model_type or d.get("architectures")
    raise ModelLoadError(
        f"unsupported architecture {found!r}: shard runs {sorted(ARCHITECTURES)} "
        "(model_type in config.json); convert or pick a supported checkpoint"
    )


def _rope_scaling(d: dict[str, Any] | None, max_pos: int) -> RopeScaling | None:
    """Parse a ``rope_scaling`` / ``rope_parameters`` dict; only ``llama3`` scaling is supported."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(
            f"rope scaling type {kind!r} is not supported; shard implements 'llama3' only"
        )
    return RopeScaling(
        factor=float(d["factor"]),
        low_freq_factor=float(d["low_freq_factor"]),
        high_freq_factor=float(d["high_freq_factor"]),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", max_pos)),
    )


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ModelLoadError(f"invalid model config: {what}; fix config.json")
