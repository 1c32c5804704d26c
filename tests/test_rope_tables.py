"""Rope tables grow with the sessions that need them, keeping their first rows' bits."""

from __future__ import annotations

import torch
from tests.test_model_config import LLAMA_32_1B

from shard.model.attention import ROPE_START, rope_tables
from shard.model.config import ModelConfig
from shard.model.llama import StageModel


def _config(**change: object) -> ModelConfig:
    small = {
        **LLAMA_32_1B,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return ModelConfig.from_hf({**small, **change})


def test_a_longer_table_starts_with_the_same_bits() -> None:
    """A row of a rope table is the same bits at every table length (so growing is exact)."""
    config = _config(max_position_embeddings=1 << 16)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            long_cos, long_sin = rope_tables(config, length=20011)
            for n in (1, 7, ROPE_START, 9001):
                cos, sin = rope_tables(config, length=n)
                assert torch.equal(cos, long_cos[:n]) and torch.equal(sin, long_sin[:n])
    finally:
        torch.set_num_threads(before)


def test_a_huge_declared_context_costs_nothing_until_used() -> None:
    """A model declaring 2^24 positions builds ROPE_START rows; a longer session grows them."""
    config = _config(max_position_embeddings=1 << 24)
    stage = StageModel(config, 0, 2)
    assert stage.rope_cos.shape[0] == ROPE_START
    stage.new_cache(ROPE_START + 5)
    assert stage.rope_cos.shape[0] == 2 * ROPE_START
    want, _ = rope_tables(config, length=2 * ROPE_START)
    assert torch.equal(stage.rope_cos, want)
