"""Tiny, deterministic, random-weight checkpoints for tests.

``make_tiny_checkpoint`` writes a complete Hugging Face checkpoint directory (config.json,
safetensors, tokenizer.json, tokenizer_config.json with a chat template) that both shard and
transformers load, so tests can compare the two on a model small enough for CPU in milliseconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shard.model.config import ModelConfig, RopeScaling
from shard.model.hf_config import to_hf

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "make_tiny_checkpoint",
    "scale_upper_layers",
    "tiny_tokenizer",
]

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

#: ChatML, as Qwen2 and SmolLM2 use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few English merges so that encoding is not purely byte-by-byte. Fixed, not learned: the
# tokenizer must be identical for every seed and every run.
_MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "a"),
    ("e", "n"),
    ("Ġ", "s"),
    ("o", "r"),
)


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE: token ``b`` is byte ``b`` (GPT-2 alphabet), then merges, then specials.

    Ids: 0-255 bytes, 256.. the merges in order, then ``SPECIAL_TOKENS`` in order.
    """
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def make_tiny_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    n_layers: int = 4,
    hidden_size: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    sharded: bool = False,
    rope_scaling: bool = False,
    max_position_embeddings: int = 512,
    sliding_window: int | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` into ``path`` (created) and return ``path``.

    Weights come from ``torch.Generator().manual_seed(seed)`` in a fixed order, scaled like a
    trained model's (unit-RMS residual stream, ~1/sqrt(fan_in) projections) so activations stay
    sane and greedy output varies with context. ``qwen2`` gets q/k/v biases; ``rope_scaling``
    turns on Llama-3 scaling with a small ``original_max_position_embeddings`` so all three
    frequency bands are exercised; ``sharded`` splits the weights over two files plus an index;
    ``sliding_window`` (mistral only) sets Mistral's attention window.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    config = _tiny_config(
        arch=arch,
        n_layers=n_layers,
        hidden_size=hidden_size,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
        vocab_size=tok.get_vocab_size(),
        special_ids=[_token_id(tok, t) for t in SPECIAL_TOKENS],
    )
    tensors = _random_weights(config, torch.Generator().manual_seed(seed))
    _write_json(path / "config.json", to_hf(config))
    _write_weights(path, tensors, config.n_layers, sharded=sharded)
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", _tokenizer_config(max_position_embeddings))
    return path


def scale_upper_layers(src: Path, dst: Path, *, from_layer: int, factor: float) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with what layers >= ``from_layer`` add to the residual
    stream scaled by ``factor`` (their ``o_proj`` and ``down_proj`` weights).

    Then "the first ``from_layer`` layers + head" is a draft whose agreement with the full
    model is tunable: factor 1 leaves it poor, factor -> 0 makes it exact. Deterministic tests
    of acceptance, rollback and pipelining at any α use this.
    """
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    for file in sorted(dst.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            parts = name.split(".")
            upper = parts[:2] == ["model", "layers"] and int(parts[2]) >= from_layer
            if upper and parts[-2] in ("o_proj", "down_proj"):
                tensors[name] = tensor * factor
        save_file(tensors, str(file))
    return dst


def _tiny_config(
    *, arch: str, rope_scaling: bool, special_ids: list[int], **kw: Any
) -> ModelConfig:
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"make_tiny_checkpoint: unknown arch {arch!r}")
    if kw["sliding_window"] is not None and arch != "mistral":
        raise ValueError("make_tiny_checkpoint: sliding_window is a mistral feature")
    _, im_end, endoftext = special_ids
    scaling = None
    if rope_scaling:
        scaling = RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
    return ModelConfig(
        arch=arch,
        vocab_size=kw["vocab_size"],
        hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"],
        n_layers=kw["n_layers"],
        n_heads=kw["n_heads"],
        n_kv_heads=kw["n_kv_heads"],
        head_dim=kw["hidden_size"] // kw["n_heads"],
        rms_norm_eps=1e-6 if arch == "qwen2" else 1e-5,
        rope_theta=500000.0 if rope_scaling else 10000.0,
        rope_scaling=scaling,
        max_position_embeddings=kw["max_position_embeddings"],
        tie_word_embeddings=kw["tie_word_embeddings"],
        attention_bias=arch == "qwen2",
        bos_token_id=endoftext,
        eos_token_ids=(im_end,),
        sliding_window=kw["sliding_window"],
    )


def _random_weights(c: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """HF-named tensors in a fixed order; projections ~ N(0, 1/fan_in), norms ~ 1 + noise.

    The embedding is small (std 0.1) and attention/MLP outputs doubled so that layers, not the
    current token's own embedding, dominate the residual stream: otherwise a tied head just
    repeats its input token. Sharper q/k make attention depend on context.
    """

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    d, f, dh = c.hidden_size, c.intermediate_size, c.head_dim
    q_out, kv_out = c.n_heads * dh, c.n_kv_heads * dh
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(c.vocab_size, d, std=0.1)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1.0 + normal(d, std=0.1)
        t[p + "self_attn.q_proj.weight"] = normal(q_out, d, std=2 * d**-0.5)
        t[p + "self_attn.k_proj.weight"] = normal(kv_out, d, std=2 * d**-0.5)
        t[p + "self_attn.v_proj.weight"] = normal(kv_out, d, std=d**-0.5)
        if c.attention_bias:
            t[p + "self_attn.q_proj.bias"] = normal(q_out, std=0.1)
            t[p + "self_attn.k_proj.bias"] = normal(kv_out, std=0.1)
            t[p + "self_attn.v_proj.bias"] = normal(kv_out, std=0.1)
        t[p + "self_attn.o_proj.weight"] = normal(d, q_out, std=2 * q_out**-0.5)
        t[p + "post_attention_layernorm.weight"] = 1.0 + normal(d, std=0.1)
        t[p + "mlp.gate_proj.weight"] = normal(f, d, std=d**-0.5)
        t[p + "mlp.up_proj.weight"] = normal(f, d, std=d**-0.5)
        t[p + "mlp.down_proj.weight"] = normal(d, f, std=2 * f**-0.5)
    # The final norm's gain sets the logit scale (std ~3): a trained model's confident margins,
    # so greedy choices are robust to float rounding.
    t["model.norm.weight"] = 4.0 * (1.0 + normal(d, std=0.1))
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = normal(c.vocab_size, d, std=0.1)
    return t


def _write_weights(
    path: Path, tensors: dict[str, torch.Tensor], n_layers: int, *, sharded: bool
) -> None:
    """One ``model.safetensors``, or two shards (embedding + first half of the layers, rest)
    plus ``model.safetensors.index.json``."""
    meta = {"format": "pt"}
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {name: files[_shard_of(name, n_layers)] for name in tensors}
    for file in files:
        part = {n: t for n, t in tensors.items() if weight_map[n] == file}
        save_file(part, str(path / file), metadata=meta)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)


def _shard_of(name: str, n_layers: int) -> int:
    if name == "model.embed_tokens.weight":
        return 0
    if name.startswith("model.layers."):
        return 0 if int(name.split(".")[2]) < max(1, n_layers // 2) else 1
    return 1


def _tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _token_id(tok: Tokenizer, token: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise AssertionError(f"tiny tokenizer lost special token {token!r}")
    return i


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
