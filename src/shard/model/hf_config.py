"""A ``ModelConfig`` written back as a Hugging Face ``config.json`` (Llama, Qwen2, Mistral).

What a draft head's file and the test checkpoints carry as their target's shape. Other
families are refused: their checkpoints carry their own ``config.json``, and writing one
would drop their declared differences. This module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import Any

from shard.model.config import ModelConfig

__all__ = ["to_hf"]


def to_hf(c: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers' ``*ForCausalLM`` classes accept;
    ``ValueError`` for a family other than Llama, Qwen2 and Mistral."""
    if c.arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"to_hf writes llama/qwen2/mistral configs only, not {c.arch!r}")
    d: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": _one_or_list(c.eos_token_ids),
        "torch_dtype": "float32",
    }
    if c.rope_scaling is not None:
        rs = c.rope_scaling
        d["rope_scaling"] = {
            "rope_type": rs.kind,
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    if c.arch == "llama":
        d["attention_bias"] = c.attention_bias
        d["mlp_bias"] = False
    elif c.arch == "qwen2":
        d["use_sliding_window"] = False
        d["sliding_window"] = None
    else:
        d["sliding_window"] = c.sliding_window
    return d


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)
