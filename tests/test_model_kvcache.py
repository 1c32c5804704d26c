"""The static KV cache: rollback by overwrite, chunked prefill, and its bounds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shard.model.llama import KVCache, StageModel
from shard.model.loader import load_stage

PROMPT = [
    12,
    200,
    7,
    99,
    260,
    31,
    31,
    5,
    140,
    8,
    64,
    222,
    17,
    3,
    150,
    81,
    44,
    9,
    2,
    270,
    120,
    6,
    58,
]
MAX_LEN = 48
#: Chunked and one-shot prefill run different matmul shapes, so they agree to rounding only
#: (measured ~1e-5 on logits of std ~3).
CHUNK_ATOL = 1e-4


@pytest.fixture
def model(tiny_checkpoint: Callable[..., Path]) -> StageModel:
    return load_stage(tiny_checkpoint(arch="qwen2"), 0, 4)


def decode(model: StageModel, cache: KVCache, start: int, tokens: list[int]) -> list[torch.Tensor]:
    """Feed ``tokens`` one position at a time from ``start``; each step's logits ``[1, 1, V]``."""
    return [model(torch.tensor([[t]]), start + i, cache) for i, t in enumerate(tokens)]


def test_rejected_chunk_leaves_no_trace(model: StageModel) -> None:
    """Garbage written past the frontier (a rejected draft) and then overwritten changes nothing."""
    n, steps = len(PROMPT), [44, 2, 190, 13]
    clean = model.new_cache(MAX_LEN)
    model(torch.tensor([PROMPT]), 0, clean)
    expected = decode(model, clean, n, steps)

    dirty = model.new_cache(MAX_LEN)
    model(torch.tensor([PROMPT]), 0, dirty)
    model(torch.tensor([[250, 1, 77, 3, 90, 91]]), n, dirty)  # rejected: positions n..n+5
    assert not torch.equal(dirty.k[:, :, :, n : n + 6], clean.k[:, :, :, n : n + 6])
    got = decode(model, dirty, n, steps)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_rejected_chunk_on_a_middle_stage_leaves_no_trace(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """A hidden-state stage rolls back the same way: stale positions are never read."""
    model_dir = tiny_checkpoint(arch="llama")
    head, middle = load_stage(model_dir, 0, 1), load_stage(model_dir, 1, 3)
    caches = {name: (head.new_cache(MAX_LEN), middle.new_cache(MAX_LEN)) for name in "ab"}
    hidden = head(torch.tensor([PROMPT]), 0, caches["a"][0])
    step = head(torch.tensor([[42]]), len(PROMPT), caches["a"][0])
    out = {}
    for name, (_, cache) in caches.items():
        middle(hidden, 0, cache)
        if name == "b":
            middle(torch.randn(1, 5, 64) * 100, len(PROMPT), cache)  # rejected chunk
        out[name] = middle(step, len(PROMPT), cache)
    assert torch.equal(out["a"], out["b"])


def test_forward_never_reads_at_or_past_the_chunk_end(model: StageModel) -> None:
    """NaN everywhere in the cache beyond ``start+S`` does not reach the output."""
    cache = model.new_cache(MAX_LEN)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    logits = model(torch.tensor([PROMPT]), 0, cache)
    logits = model(torch.tensor([[5, 6]]), len(PROMPT), cache)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_chunked_prefill_matches_one_shot(model: StageModel, chunk: int) -> None:
    """Prefill in chunks of 1/3/5/8 gives the one-shot logits (to rounding) and the same argmax."""
    one_cache = model.new_cache(MAX_LEN)
    one = model(torch.tensor([PROMPT]), 0, one_cache)
    cache = model.new_cache(MAX_LEN)
    parts = [
        model(torch.tensor([PROMPT[s : s + chunk]]), s, cache) for s in range(0, len(PROMPT), chunk)
    ]
    chunked = torch.cat(parts, dim=1)
    torch.testing.assert_close(chunked, one, rtol=0, atol=CHUNK_ATOL)
    assert torch.equal(chunked.argmax(-1), one.argmax(-1))
    n = len(PROMPT)
    torch.testing.assert_close(
        decode(model, cache, n, [7])[0],
        decode(model, one_cache, n, [7])[0],
        rtol=0,
        atol=CHUNK_ATOL,
    )


def test_cache_shape_and_defaults(model: StageModel) -> None:
    """``new_cache`` is [layers, B, kv_heads, max_len, head_dim] in the model's dtype, zeroed."""
    cache = model.new_cache(MAX_LEN, batch=3)
    assert cache.k.shape == (4, 3, 2, MAX_LEN, 16) == cache.v.shape
    assert cache.max_len == MAX_LEN
    assert cache.dtype == torch.float32
    assert not cache.k.any()


def test_forward_rejects_positions_past_the_cache(model: StageModel) -> None:
    """start+S beyond max_len, or a negative start, is a ValueError naming the positions."""
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match=r"positions \[6, 9\)"):
        model(torch.tensor([[1, 2, 3]]), 6, cache)
    with pytest.raises(ValueError, match="positions"):
        model(torch.tensor([[1]]), -1, cache)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        model.new_cache(10_000)


def test_forward_rejects_wrong_inputs(
    model: StageModel, tiny_checkpoint: Callable[..., Path]
) -> None:
    """Hidden states to a first stage, ids to a later one, or another stage's cache: ValueError."""
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.zeros(1, 2, 64), 0, cache)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([1, 2]), 0, cache)
    middle = load_stage(tiny_checkpoint(arch="qwen2"), 1, 3)
    with pytest.raises(ValueError, match="hidden states"):
        middle(torch.tensor([[1, 2]]), 0, middle.new_cache(8))
    with pytest.raises(ValueError, match="hidden states"):
        middle(torch.zeros(1, 2, 32), 0, middle.new_cache(8))
    with pytest.raises(ValueError, match="KV cache"):
        middle(torch.zeros(1, 2, 64), 0, cache)  # 4-layer cache, 2-layer stage
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.tensor([[1], [2]]), 0, cache)  # batch 2 into a batch-1 cache
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.tensor([[1]]), 0, model.new_cache(8, dtype=torch.bfloat16))
