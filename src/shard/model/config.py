"""The model's shape, read from a Hugging Face ``config.json``.

``ModelConfig`` is the one typed view of a checkpoint's architecture that the runtime, the loader
and placement share. It is built at the edge (``from_hf`` / ``from_dir``) and validated there, so
everything downstream can trust it. This module imports neither torch nor safetensors: the
coordinator and the planner read configs without paying for them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from shard.model.config_fields import MAX, Fields, ModelLoadError
from shard.model.families import DsaConfig, MlaConfig, MoeConfig, family_fields
from shard.model.families_v4 import V4Config, check_v4
from shard.model.hybrid_config import HYBRIDS, LinearAttnConfig, hybrid_fields
from shard.model.jsonfile import read_json
from shard.model.rope_config import RopeScaling, rope_scaling

__all__ = [
    "ARCHITECTURES",
    "DsaConfig",
    "LinearAttnConfig",
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
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}

#: ``model_type`` s that publish another family's architecture under their own name, taken as
#: that family only when ``architectures`` names its class too (Kimi-K2 ships ``kimi_k2`` with
#: ``DeepseekV3ForCausalLM``: DeepSeek-V3's shapes, 384 experts).
ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}

#: The activations a feed-forward may use (HF ``hidden_act`` names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


#: The largest ``config.json`` read (real ones are a few KB; a Gemma 3's with its layer
#: types and vision tables is under 4 KB).
MAX_CONFIG_BYTES = 1 << 20


@attrs.frozen
class ModelConfig:
    """Architecture of a decoder: a Llama (Llama 2/3, Qwen2, Mistral, SmolLM) or one of the
    families of ``shard.model.families`` (Qwen3, Gemma 3, Mixtral, Qwen3-MoE, gpt-oss, GLM-4.5,
    MiniMax-M2, DeepSeek-V3, GLM-5; the linear-attention hybrids of
    ``shard.model.hybrid_config``: Qwen3-Next, Qwen3.5-MoE).

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
    qk_norm_whole: bool = False  # ... over all heads of q and of k at once (MiniMax-M2)
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
    dsa: DsaConfig | None = None  # DeepSeek sparse attention's indexer over MLA (GLM-5)
    linear_attn: LinearAttnConfig | None = None  # Gated DeltaNet layers (Qwen3-Next)
    attn_output_gate: bool = False  # q_proj's second half gates the attention output
    v4: V4Config | None = None  # DeepSeek-V4: hyper-connections, CSA/HCA, hash routing
    # FP8 block-scaled weights (``quantization_config``, ``shard.model.fp8``): [rows, cols]
    weight_block: tuple[int, int] | None = None

    def __attrs_post_init__(self) -> None:
        _check(self.arch in ARCHITECTURES, f"unsupported architecture {self.arch!r}")
        if self.mla is not None:  # first: its head_dim is derived from these fields
            self._check_mla(self.mla)
        _check(self.dsa is None or self.mla is not None, "the DSA indexer needs MLA")
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
            math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0,
            f"rms_norm_eps must be a finite positive number, got {self.rms_norm_eps}",
        )
        _check(
            math.isfinite(self.rope_theta) and self.rope_theta > 0,
            f"rope_theta must be a finite positive number, got {self.rope_theta}",
        )
        ids = (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,)))
        _check(
            all(0 <= i < self.vocab_size for i in ids),
            f"bos/eos token ids {ids} must lie in the vocabulary [0, {self.vocab_size})",
        )
        _check(self.sliding_window is None or self.sliding_window > 0, "sliding_window > 0")
        _check(
            self.hidden_act in ACTIVATIONS, f"hidden_act {self.hidden_act!r} not in {ACTIVATIONS}"
        )
        _check(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "the rotary part must be even")
        if self.layer_types is not None:
            _check(len(self.layer_types) == self.n_layers, "layer_types must name every layer")
            known = {"full_attention", "sliding_attention"}
            kinds = (
                set(self.layer_types)
                - known
                - ({"linear_attention"} if self.linear_attn is not None else set())
            )
            _check(not kinds, f"unknown layer_types {sorted(kinds)}")
            _check(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "sliding_attention layers need a sliding_window",
            )
        _check(
            self.linear_attn is None or self.layer_types is not None,
            "linear-attention layers are named by layer_types",
        )
        if self.v4 is not None:
            check_v4(self.v4, self.n_layers, self.head_dim, self.rotary_dim)
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
        if self.dsa is not None:
            _check(a.q_lora_rank is not None, "the DSA indexer reads a low-rank query")
            _check(
                self.dsa.index_head_dim >= a.qk_rope_head_dim,
                f"index_head_dim {self.dsa.index_head_dim} must hold the "
                f"qk_rope_head_dim {a.qk_rope_head_dim} rotated dims",
            )

    @property
    def kv_widths(self) -> tuple[int, int, int]:
        """What a layer's KV cache holds per position: ``(heads, key width, value width)`` —
        ``n_kv_heads`` keys and values of ``head_dim``, or MLA's one normed latent of
        ``kv_lora_rank`` beside one rotated key of ``qk_rope_head_dim``
        (``shard.model.mla``), followed by the DSA indexer's own key of ``index_head_dim``
        where there is one (``shard.model.dsa``)."""
        if self.mla is not None:
            index = 0 if self.dsa is None else self.dsa.index_head_dim
            return (1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim + index)
        if self.v4 is not None:  # K=V, then the compressors' state (shard.model.v4_attention)
            return (1, self.head_dim, self.v4.state_width(self.head_dim))
        return (self.n_kv_heads, self.head_dim, self.head_dim)

    @property
    def kv_elements(self) -> int:
        """Numbers a layer caches per position (``kv_widths``: heads times both widths)."""
        heads, k, v = self.kv_widths
        return heads * (k + v)

    @property
    def hidden_wire_width(self) -> int:
        """Numbers per row of the hidden state one stage hands the next: ``hidden_size``, or
        DeepSeek-V4's ``hc_mult`` streams then its ``id_digits`` (``shard.model.deepseek_v4``)."""
        if self.v4 is None:
            return self.hidden_size
        return self.v4.hc_mult * self.hidden_size + self.id_digits

    @property
    def id_digits(self) -> int:
        """Base-256 digits of each row's token id carried in the hidden state: DeepSeek-V4's
        hash-routed layers past the first read the ids on any stage (0: no such layer)."""
        if self.v4 is None or not any(i > 0 for i in self.v4.hash_layers):
            return 0
        digits = 1
        while 256**digits < self.vocab_size:
            digits += 1
        return digits

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

    def is_linear(self, layer: int) -> bool:
        """Whether (global) ``layer`` is a linear-attention (Gated DeltaNet) layer."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def is_sparse(self, layer: int) -> bool:
        """Whether (global) ``layer``'s feed-forward is a sparse mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def architecture(self) -> str:
        """The transformers class name for this arch (``"LlamaForCausalLM"``, ...)."""
        return ARCHITECTURES[self.arch]

    @classmethod
    def from_hf(cls, d: Any, where: str = "config.json") -> ModelConfig:
        """Build from a HF ``config.json`` dict (``where`` names the file in messages).

        Accepts both the classic layout (``rope_theta`` + ``rope_scaling``) and transformers 5's
        ``rope_parameters``. Every field used is checked for its type and range
        (``shard.model.config_fields``). Raises ``ModelLoadError`` (one line) for an
        unsupported architecture or feature, or a field that is missing, mistyped or out of
        range, rather than silently computing something else.
        """
        try:
            return _from_hf(cls, Fields(d, where))
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # a check this code missed
            raise ModelLoadError(
                f"{where} is not a usable config ({type(e).__name__}: {e}); check that the "
                f"checkpoint is a causal LM of a supported family: {sorted(ARCHITECTURES)}"
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
        d = read_json(cfg, max_bytes=MAX_CONFIG_BYTES, error=ModelLoadError, what="config.json")
        return cls.from_hf(d, str(cfg))


def _from_hf(cls: type[ModelConfig], f: Fields) -> ModelConfig:
    arch = _arch_of(f)
    n_heads = f.integer("num_attention_heads", hi=MAX["heads"])
    hidden = f.integer("hidden_size", hi=MAX["width"])
    n_layers = f.integer("num_hidden_layers", hi=MAX["layers"])
    vocab = f.integer("vocab_size", hi=MAX["vocab"])
    max_pos = f.integer("max_position_embeddings", hi=MAX["positions"])
    rope = f.table("rope_parameters")
    if rope is not None and rope.has("full_attention"):  # per layer type (Gemma 3, transformers 5)
        rope = rope.table("full_attention")
    rope_theta = (
        f.real("rope_theta", lo=0, above=True)
        if f.has("rope_theta")
        else rope.real("rope_theta", 10000.0, lo=0, above=True)
        if rope is not None
        else 10000.0
    )
    scaling = f.table("rope_scaling") or rope
    if f.flag("mlp_bias", False):
        raise ModelLoadError("mlp_bias=true is not supported; only bias-free MLPs are")
    act = f.text("hidden_activation") or f.text("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {act!r} is not supported; only {ACTIVATIONS} are")
    sliding = None
    if arch in ("mistral", "mixtral", "gemma3_text", "gpt_oss"):
        sliding = f.opt_integer("sliding_window", hi=MAX["positions"])
    elif f.flag("use_sliding_window", False):
        raise ModelLoadError(f"{arch} use_sliding_window=true is not supported; set it to false")
    family = (  # MLA sets head_dim itself; Qwen3.5-MoE its (unused) dense width
        hybrid_fields(arch, f, n_layers) if arch in HYBRIDS else family_fields(arch, f, n_layers)
    )
    head_dim = (
        family["head_dim"]
        if "head_dim" in family
        else f.integer("head_dim", hi=MAX["width"])
        if f.has("head_dim")
        else _divided(hidden, n_heads, f)
    )
    fields: dict[str, Any] = dict(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=family.get("intermediate_size")
        or f.integer("intermediate_size", hi=MAX["ffn"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=f.integer("num_key_value_heads", n_heads, hi=n_heads),
        head_dim=head_dim,
        rms_norm_eps=f.real("rms_norm_eps", 1e-6, lo=0, hi=1, above=True),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling(scaling, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or f.flag("attention_bias", arch == "gpt_oss"),
        bos_token_id=f.opt_integer("bos_token_id", lo=0, hi=vocab - 1),
        eos_token_ids=f.integers("eos_token_id", lo=0, hi=vocab - 1, most=64) or (),
        sliding_window=sliding,
        weight_block=_weight_block(f.table("quantization_config")),
    )
    return cls(**(fields | family))


def _weight_block(q: Fields | None) -> tuple[int, int] | None:
    """The block of an FP8 checkpoint's scales (``quantization_config``), or None.

    Another ``quant_method`` (gpt-oss's ``mxfp4``, GPTQ, AWQ) is not read here: its shapes
    still plan, and the loader refuses the tensors it cannot read (``*_blocks``, ``qweight``)
    by name."""
    if q is None or q.text("quant_method") != "fp8":
        return None
    fmt = q.text("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells it as torch's dtype
        raise q.error("fmt", "'e4m3'", fmt)
    block = q.integers("weight_block_size", lo=1, hi=MAX["width"], most=2)
    if block is None or len(block) != 2:
        raise q.error("weight_block_size", "[rows, cols] (per-tensor FP8 is not supported)", block)
    return block[0], block[1]


def _divided(hidden: int, n_heads: int, f: Fields) -> int:
    """``hidden // n_heads``, refused when the heads do not divide the width."""
    if hidden % n_heads:
        raise f.error(
            "num_attention_heads", f"a divisor of hidden_size ({hidden}) without head_dim", n_heads
        )
    return hidden // n_heads


def _arch_of(f: Fields) -> str:
    """The arch key from ``model_type``, else (no ``model_type``) from ``architectures``.

    A ``model_type`` shard does not know is refused even when ``architectures`` names a class
    it runs: the type says what the weights are, and guessing would compute something else."""
    model_type = f.text("model_type")
    if model_type in ARCHITECTURES:
        return str(model_type)
    if model_type in ALIASES and ARCHITECTURES[ALIASES[model_type]] in (
        f.texts("architectures", most=16) or ()
    ):
        return ALIASES[model_type]
    names = f.texts("architectures", most=16) or ()
    if model_type is None:
        for name in names:
            for arch, cls_name in ARCHITECTURES.items():
                if name == cls_name:
                    return arch
    found = model_type or list(names) or None
    raise ModelLoadError(
        f"{f.where}: unsupported architecture {found!r}: shard runs {sorted(ARCHITECTURES)} "
        "(model_type in config.json); convert or pick a supported checkpoint"
    )


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ModelLoadError(f"invalid model config: {what}; fix config.json")
