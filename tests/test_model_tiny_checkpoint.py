"""shard.testing.make_tiny_checkpoint: deterministic, complete, and loadable by both sides."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from shard.model.config import ModelConfig
from shard.testing import SPECIAL_TOKENS, make_tiny_checkpoint


def file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    """Two checkpoints from one seed are byte-identical; another seed changes the weights."""
    a = make_tiny_checkpoint(tmp_path / "a", seed=7, arch="qwen2", sharded=True)
    b = make_tiny_checkpoint(tmp_path / "b", seed=7, arch="qwen2", sharded=True)
    c = make_tiny_checkpoint(tmp_path / "c", seed=8, arch="qwen2", sharded=True)
    assert file_bytes(a) == file_bytes(b)
    assert (
        file_bytes(a)["model-00001-of-00002.safetensors"]
        != file_bytes(c)["model-00001-of-00002.safetensors"]
    )


def test_sharded_layout(tmp_path: Path) -> None:
    """sharded=True writes two files and an index mapping every tensor to one of them."""
    d = make_tiny_checkpoint(tmp_path / "s", sharded=True, tie_word_embeddings=False)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert not (d / "model.safetensors").exists()
    for file in set(weight_map.values()):
        with safe_open(str(d / file), framework="pt") as f:
            assert set(f.keys()) == {n for n, v in weight_map.items() if v == file}
    assert "lm_head.weight" in weight_map


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_config_matches_arch(tmp_path: Path, arch: str) -> None:
    """config.json parses back to the requested arch; qwen2 has and writes q/k/v biases."""
    d = make_tiny_checkpoint(tmp_path / arch, arch=arch, n_layers=2, rope_scaling=True)
    c = ModelConfig.from_dir(d)
    assert (c.arch, c.n_layers, c.attention_bias) == (arch, 2, arch == "qwen2")
    assert c.rope_scaling is not None
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("model.layers.1.self_attn.k_proj.bias" in names) == (arch == "qwen2")


def test_tokenizer_round_trips_text_and_specials(tmp_path: Path) -> None:
    """Any text encodes and decodes losslessly; special tokens are single ids below vocab_size."""
    d = make_tiny_checkpoint(tmp_path / "t")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    config = ModelConfig.from_dir(d)
    text = "Héllo, the world! 你好 🙂\n\tthen"
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(" the").ids) == 1  # the merges apply
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert all(i is not None and i < config.vocab_size for i in ids)
    assert tok.get_vocab_size() <= config.vocab_size
    assert tok.encode("<|im_start|>user").ids[0] == ids[0]
    assert config.eos_token_ids == (tok.token_to_id("<|im_end|>"),)


def test_chat_template_renders(tmp_path: Path) -> None:
    """tokenizer_config.json carries a ChatML template that renders a conversation."""
    d = make_tiny_checkpoint(tmp_path / "t")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>"
    rendered = jinja2.Template(cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
