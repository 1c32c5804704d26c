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

from shard.model.families import MlaConfig, MoeConfig, family_fields, yarn_mscale

__all__ = [
    "ARCHITECTURES",
    "MlaConfig",
    "ModelConfig",
    "ModelLoadError",
    "MoeConfig",
    "RopeScaling",
]

#: HF ``model_type`` -> the ``architectures`` entry transformers uses for it.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

#: The activations a feed-forward may use (HF ``hidden_act`` names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class ModelLoadError(Exception):
    """A checkpoint cannot be used: the message says what is wrong and what to do."""


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


@attrs.frozen
class ModelConfig:
    """Architecture of a decoder: a Llama (Llama 2/3, Qwen2, Mistral, SmolLM) or one of the
    families of ``shard.model.families`` (Qwen3, Gemma 3, Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5,
    DeepSeek-V3).

    ``sliding_window`` is the local attention span (``None``: full causal attention): of
    every layer when ``layer_types`` is ``None`` (Mistral), else of the ``"sliding_attention"``
    layers only (Gemma 3, gpt-oss). The fields after it are the families' declared differences
    (``shard.model.families``); their defaults are a plain Llama.
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
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # norms scale by (1 + weight), in fp32 (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden), in the model dtype (Gemma)
    hidden_act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] | None = None  # "full_attention" | "sliding_attention"
    rope_local_theta: float | None = None  # sliding layers' own rope base (Gemma 3)
    partial_rotary: float = 1.0  # fraction of each head that is rotated (GLM)
    attention_sinks: bool = False  # a learned logit per head in the softmax (gpt-oss)
    o_proj_bias: bool = False
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None  # multi-head latent attention (DeepSeek-V3)

    def __attrs_post_init__(self) -> None:
        _check(self.arch in ARCHITECTURES, f"unsupported architecture {self.arch!r}")
        if self.mla is not None:  # first: its head_dim is derived from these fields
            self._check_mla(self.mla)
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
        _check(
            self.hidden_act in ACTIVATIONS, f"hidden_act {self.hidden_act!r} not in {ACTIVATIONS}"
        )
        _check(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "the rotary part must be even")
        if self.layer_types is not None:
            _check(len(self.layer_types) == self.n_layers, "layer_types must name every layer")
            kinds = set(self.layer_types) - {"full_attention", "sliding_attention"}
            _check(not kinds, f"unknown layer_types {sorted(kinds)}")
            _check(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "sliding_attention layers need a sliding_window",
            )
        if self.moe is not None:
            m = self.moe
            _check(0 < m.top_k <= m.n_experts, f"top_k {m.top_k} of {m.n_experts} experts")
            _check(all(0 <= i < self.n_layers for i in m.sparse_layers), "sparse layer range")
            _check(m.n_experts % m.n_group == 0, "n_experts must be a multiple of n_group")
            _check(m.expert_size > 0, f"moe_intermediate_size {m.expert_size} must be positive")
            _check(m.n_shared_experts >= 0, f"n_shared_experts {m.n_shared_experts} < 0")
            _check(m.routed_scaling_factor > 0, "routed_scaling_factor must be positive")
            _check(0 < m.topk_group <= m.n_group, f"topk_group {m.topk_group} of {m.n_group}")
            if m.router == "sigmoid_group":
                per_group = m.n_experts // m.n_group
                _check(per_group >= 2, "a sigmoid_group router needs 2+ experts per group")
                _check(m.top_k <= m.topk_group * per_group, "top_k exceeds the kept groups")

    def _check_mla(self, a: MlaConfig) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check(getattr(a, name) > 0, f"{name} must be positive, got {getattr(a, name)}")
        _check(a.q_lora_rank is None or a.q_lora_rank > 0, "q_lora_rank must be null or > 0")
        _check(a.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim {a.qk_rope_head_dim} is odd")
        _check(self.head_dim == a.qk_rope_head_dim, "an MLA head_dim is its qk_rope_head_dim")
        _check(self.partial_rotary == 1.0, "MLA rotates the rope dims whole")

    @property
    def kv_widths(self) -> tuple[int, int, int]:
        """What a layer's KV cache holds per position: ``(heads, key width, value width)`` —
        ``n_kv_heads`` keys and values of ``head_dim``, or MLA's one normed latent of
        ``kv_lora_rank`` beside one rotated key of ``qk_rope_head_dim``
        (``shard.model.mla``)."""
        if self.mla is not None:
            return (1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)
        return (self.n_kv_heads, self.head_dim, self.head_dim)

    @property
    def kv_elements(self) -> int:
        """Numbers a layer caches per position (``kv_widths``: heads times both widths)."""
        heads, k, v = self.kv_widths
        return heads * (k + v)

    @property
    def rotary_dim(self) -> int:
        """How many dimensions of each head rotary embeddings turn (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of (global) ``layer``, or ``None`` for full causal attention."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` uses the sliding layers' own rope base (``rope_local_theta``)."""
        return self.rope_local_theta is not None and self.window_of(layer) is not None

    def is_sparse(self, layer: int) -> bool:
        """Whether (global) ``layer``'s feed-forward is a sparse mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

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
                f"config.json is not a usable Llama-family config ({type(e).__name__}: {e}); check "
                f"that the checkpoint is a causal LM of a supported family: {sorted(ARCHITECTURES)}"
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
        """A ``config.json`` dict that transformers' ``*ForCausalLM`` classes accept.

        Llama, Qwen2 and Mistral only: ``ValueError`` for another family (its checkpoints
        carry their own ``config.json``; writing one would drop its declared differences)."""
        if self.arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"to_hf writes llama/qwen2/mistral configs only, not {self.arch!r}")
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
            rs = self.rope_scaling
            d["rope_scaling"] = {
                "rope_type": rs.kind,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
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
    if "full_attention" in rope:  # per layer type (Gemma 3 in transformers 5)
        rope = rope["full_attention"] or {}
    rope_theta = float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = d.get("rope_scaling") or rope or None
    if d.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported; only bias-free MLPs are")
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {act!r} is not supported; only {ACTIVATIONS} are")
    sliding = None
    if arch in ("mistral", "mixtral", "gemma3_text", "gpt_oss"):
        sliding = d.get("sliding_window")
    elif d.get("use_sliding_window"):
        raise ModelLoadError(f"{arch} use_sliding_window=true is not supported; set it to false")
    n_layers = int(d["num_hidden_layers"])
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    fields: dict[str, Any] = dict(
        arch=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(scaling, int(d["max_position_embeddings"])),
        max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(d.get("attention_bias", arch == "gpt_oss")),
        bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
        eos_token_ids=tuple(int(i) for i in eos_ids),
        sliding_window=None if sliding is None else int(sliding),
    )
    return cls(**(fields | family_fields(arch, d, n_layers)))  # a family may set head_dim


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
    if kind not in ("llama3", "yarn", "linear"):
        raise ModelLoadError(
            f"rope scaling type {kind!r} is not supported; shard implements 'llama3', 'yarn' "
            "and 'linear'"
        )
    attn_factor = d.get("attention_factor")
    factor = float(d["factor"])
    if kind == "yarn" and attn_factor is None:
        attn_factor = _yarn_attention_factor(factor, d.get("mscale"), d.get("mscale_all_dim"))
    return RopeScaling(
        factor=factor,
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", max_pos)),
        kind=str(kind),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        truncate=bool(d.get("truncate", True)),
        attention_factor=None if attn_factor is None else float(attn_factor),
    )


def _yarn_attention_factor(factor: float, mscale: Any, mscale_all_dim: Any) -> float | None:
    """The cos/sin scale transformers' ``_compute_yarn_parameters`` derives from ``mscale``
    and ``mscale_all_dim`` when both are set (DeepSeek): mscale(f, mscale) / mscale(f,
    mscale_all_dim); None (the plain YaRN factor) otherwise."""
    for name, v in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        _check(
            v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v >= 0),
            f"rope {name} must be a number >= 0, got {v!r}",
        )
    if not (mscale and mscale_all_dim):
        return None
    return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ModelLoadError(f"invalid model config: {what}; fix config.json")
