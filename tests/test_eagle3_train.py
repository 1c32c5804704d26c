"""Training an EAGLE-3 head: the unrolled training forward (the training-time test) computes
exactly what ``Eagle3Head.step`` computes when a proposer drafts past its last real states,
step for step; a trained head's files load through the published-layout loader; and the
loss mask leaves out what no draft can be scored on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.eagle3_files import Eagle3Config
from shard.testing.eagle3 import eagle3_config
from shard.training.eagle3.build import head_config, new_head, save_head
from shard.training.eagle3.train import loss_mask, unrolled

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V, D, S = 64, 32, 12


def _head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    config = eagle3_config(vocab_size=V, hidden_size=D, draft_vocab_size=V // 2)
    head = Eagle3Head(Eagle3Config.from_json(config)).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.eval()


def _chained(
    head: Eagle3Head, states: torch.Tensor, nxt: torch.Tensor, p: int, j: int
) -> torch.Tensor:
    """``g`` at head position ``p`` when a proposer has real states up to ``p - j`` and
    chains ``j`` times, with the cache a proposer keeps."""
    cache = head.new_cache(S + 1)
    g = head.step(states[:, : p - j + 1], nxt[:, : p - j + 1], 0, cache)[:, -1:]
    for t in range(p - j + 1, p + 1):
        g = head.step(g, nxt[:, t : t + 1], t, cache)
    return g[0, 0]


@pytest.mark.parametrize("depth", [1, 3])
def test_unrolled_equals_the_proposers_chain(depth: int) -> None:
    head = _head()
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(2, S, head.feature_dim, generator=gen, dtype=torch.float64)
    nxt = torch.randint(V, (2, S), generator=gen)
    with torch.no_grad():
        outs = unrolled(head, states, nxt, depth)
    assert len(outs) == depth
    for j, g in enumerate(outs):
        for p in range(j, S):
            want = _chained(head, states[:1], nxt[:1], p, j)
            torch.testing.assert_close(g[0, p], want, rtol=1e-9, atol=1e-9)
    # step 0 is the plain cache-free forward
    with torch.no_grad():
        torch.testing.assert_close(outs[0], head(states, nxt), rtol=1e-9, atol=1e-9)


def test_unrolled_catches_a_slipped_chain() -> None:
    """A chain fed one position late differs: the check above is not vacuous."""
    head = _head()
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(1, S, head.feature_dim, generator=gen, dtype=torch.float64)
    nxt = torch.randint(V, (1, S), generator=gen)
    with torch.no_grad():
        g1 = unrolled(head, states, nxt, 2)[1]
    assert not torch.allclose(g1[0, 6], _chained(head, states, nxt, 6, 2), atol=1e-6)
    assert torch.allclose(g1[0, 6], _chained(head, states, nxt, 6, 1), atol=1e-9)


def test_loss_mask_skips_padding_and_after_a_stop() -> None:
    ids = torch.tensor([[5, 6, 2, 9, 9], [5, 6, 7, 8, 9]])
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    assert loss_mask(ids, valid, (2,)).tolist() == [
        [True, False, False, False],
        [True, True, True, False],
    ]


def test_a_new_head_is_written_in_the_published_layout(tmp_path: Path) -> None:
    target = {
        "hidden_size": D,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "vocab_size": V,
    }
    config = head_config(target, 16, (1, 2, 3))
    emb = torch.randn(V, D)
    draft_ids = torch.arange(0, V, 4)
    head = new_head(config, draft_ids, emb, emb * 2, torch.full((D,), 0.5), seed=0)
    save_head(head, config, tmp_path / "h", {"note": "test"})
    loaded = Eagle3Head.load(tmp_path / "h", embedding=emb)
    assert loaded.config.layer_ids == (1, 2, 3)
    assert loaded.to_vocab(torch.arange(16)).tolist() == draft_ids.tolist()
    torch.testing.assert_close(loaded.lm_head.weight, (emb * 2)[draft_ids].half().float())
    torch.testing.assert_close(loaded.embed_tokens.weight, emb)
