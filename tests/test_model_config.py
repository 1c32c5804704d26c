"""ModelConfig from Hugging Face config.json dicts, both layouts, and back."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs
import pytest

from shard.model.config import ModelConfig, ModelLoadError, RopeScaling
from shard.model.hf_config import to_hf

LLAMA_32_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
}

QWEN2_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_llama3_config() -> None:
    """A Llama 3.2 config parses: GQA, head_dim, llama3 rope scaling, several eos ids."""
    c = ModelConfig.from_hf(LLAMA_32_1B)
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 16, 32, 8, 64)
    assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert c.tie_word_embeddings
    assert not c.attention_bias


def test_qwen2_config_has_biases_and_derived_head_dim() -> None:
    """Qwen2 always has q/k/v biases; head_dim defaults to hidden/heads; sliding window off."""
    c = ModelConfig.from_hf(QWEN2_05B)
    assert c.attention_bias
    assert c.head_dim == 64
    assert c.sliding_window is None
    assert c.eos_token_ids == (151645,)
    assert c.bos_token_id == 151643


def test_transformers5_rope_parameters_layout() -> None:
    """``rope_parameters`` (rope_theta inside it) parses the same as the classic layout."""
    d = {k: v for k, v in LLAMA_32_1B.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {**LLAMA_32_1B["rope_scaling"], "rope_theta": 500000.0}
    assert ModelConfig.from_hf(d) == ModelConfig.from_hf(LLAMA_32_1B)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    c = ModelConfig.from_hf(d)
    assert c.rope_scaling is None
    assert c.rope_theta == 1e6


def test_arch_from_architectures_when_model_type_missing() -> None:
    """Without ``model_type`` the ``architectures`` list decides."""
    d = {k: v for k, v in QWEN2_05B.items() if k != "model_type"}
    assert ModelConfig.from_hf(d).arch == "qwen2"


@pytest.mark.parametrize("d", [LLAMA_32_1B, QWEN2_05B])
def test_to_hf_round_trips(d: dict[str, Any]) -> None:
    """``from_hf(to_hf(c)) == c``."""
    c = ModelConfig.from_hf(d)
    assert ModelConfig.from_hf(to_hf(c)) == c
    mistral = attrs.evolve(c, arch="mistral", attention_bias=False, sliding_window=4096)
    assert ModelConfig.from_hf(to_hf(mistral)) == mistral


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope' is not supported"),
        ({"num_key_value_heads": 5}, "multiple of n_kv_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_size": None}, "missing required field .hidden_size."),
    ],
)
def test_unsupported_or_broken_configs(change: dict[str, Any], message: str) -> None:
    """Features shard does not implement are refused with a ModelLoadError, never ignored."""
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf({**LLAMA_32_1B, **change})


def test_qwen2_sliding_window_is_refused() -> None:
    """Qwen2 with use_sliding_window=true is refused rather than silently computed wrong."""
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        ModelConfig.from_hf({**QWEN2_05B, "use_sliding_window": True})


def test_config_module_does_not_import_torch() -> None:
    """The coordinator can read configs without torch: ``shard.model.config`` is light."""
    code = "import sys, shard.model.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_family_configs_are_not_rewritten_by_to_hf() -> None:
    """to_hf refuses a family beyond llama/qwen2/mistral rather than drop its differences."""
    gemma = ModelConfig.from_hf(
        {
            **LLAMA_32_1B,
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "hidden_act": "gelu_pytorch_tanh",
        }
    )
    assert gemma.norm_unit_offset and gemma.layer_types is not None
    with pytest.raises(ValueError, match="gemma3_text"):
        to_hf(gemma)
