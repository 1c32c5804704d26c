"""Draft heads: the module, its proposer (rollback, pipelining, sampling), checkpoints.

Everything runs on tiny random checkpoints (a 4-layer target), in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shard.decode.head.model import CONFIG_FILE, WEIGHTS_FILE, DraftHead, HeadError
from shard.decode.head.proposer import HeadProposer
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.training.distill.data import hidden_states

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def target(tiny_checkpoint: Callable[..., Path]) -> StageModel:
    return load_stage(tiny_checkpoint(n_layers=4), 0, 4)


def make_head(target: StageModel, *, layers: int = 1, window: int = 6) -> DraftHead:
    """A random head whose layers are scaled up so its drafts vary with their inputs."""
    shortlist = torch.arange(0, target.config.vocab_size, 3)
    head = DraftHead.from_target(target, layers=layers, window=window, shortlist=shortlist)
    with torch.no_grad():
        for p in head.trainable():
            if p.dim() == 2:
                p.mul_(4.0)
    return head.eval()


def stream(target: StageModel, n: int, seed: int = 1) -> tuple[list[int], torch.Tensor]:
    """Random token ids ``[n]`` and the target's features at each position ``[n, D]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, n), generator=gen)
    with torch.inference_mode():
        return ids[0].tolist(), hidden_states(target, ids)[0]


def test_forward_shapes(target: StageModel) -> None:
    """``unrolled`` gives one ``[B, S, D]`` per pass; the readout spans the shortlist."""
    head = make_head(target)
    feats = torch.randn(2, 10, target.config.hidden_size)
    ids = torch.randint(0, target.config.vocab_size, (2, 10))
    outs = head.unrolled(feats, ids, passes=3)
    assert [tuple(g.shape) for g in outs] == [(2, 10, target.config.hidden_size)] * 3
    assert head.logits(outs[0]).shape == (2, 10, len(head.shortlist))
    cache = head.new_cache(16)
    g = head.step(feats[:1, :4], ids[:1, :4], 0, cache)
    assert g.shape == (1, 4, target.config.hidden_size)


@pytest.mark.parametrize("layers", [1, 2])
def test_training_forward_is_what_drafting_computes(target: StageModel, layers: int) -> None:
    """Pass p of ``unrolled`` equals drafting p tokens ahead with the cached ``step``."""
    head = make_head(target, layers=layers, window=5)
    ids, feats = stream(target, 20)
    x = torch.tensor([ids])
    with torch.inference_mode():
        outs = head.unrolled(feats[None, :-1], x[:, 1:], passes=3)
        m = 12  # features f_0..f_{m-1} are real, tokens up to x_m known
        cache = head.new_cache(32)
        g = head.step(feats[None, :m], x[:, 1 : m + 1], 0, cache)
        close = {"rtol": 1e-4, "atol": 1e-4}  # batched vs one-row matmuls round differently
        torch.testing.assert_close(g, outs[0][:, :m], **close)
        for p in (2, 3):  # chain on the prediction, with the true next token
            t = m + p - 2
            g = head.step(g[:, -1:], x[:, t + 1 : t + 2], t, cache)
            torch.testing.assert_close(g[0, 0], outs[p - 1][0, t], **close)


def test_save_load_round_trip(target: StageModel, tmp_path: Path) -> None:
    """A saved head loads with the same config, shortlist and outputs."""
    head = make_head(target)
    head.save(tmp_path)
    loaded = DraftHead.load(tmp_path)
    assert loaded.config == head.config
    assert torch.equal(loaded.shortlist, head.shortlist)
    feats = torch.randn(1, 7, target.config.hidden_size)
    ids = torch.randint(0, target.config.vocab_size, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(loaded.unrolled(feats, ids)[0], head.unrolled(feats, ids)[0])


def test_load_refuses_damaged_checkpoints(target: StageModel, tmp_path: Path) -> None:
    """A missing, truncated or mismatched checkpoint is a ``HeadError``, never a crash."""
    with pytest.raises(HeadError, match="cannot read"):
        DraftHead.load(tmp_path)
    head = make_head(target)
    head.save(tmp_path)
    weights = (tmp_path / WEIGHTS_FILE).read_bytes()
    (tmp_path / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])
    with pytest.raises(HeadError):
        DraftHead.load(tmp_path)
    (tmp_path / WEIGHTS_FILE).write_bytes(weights)
    config = (tmp_path / CONFIG_FILE).read_text()
    (tmp_path / CONFIG_FILE).write_text(config.replace('"window": 6', '"window": "x"'))
    with pytest.raises(HeadError, match="not a head config"):
        DraftHead.load(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(config.replace('"layers": 1', '"layers": 2'))
    with pytest.raises(HeadError, match="does not match"):
        DraftHead.load(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(config.replace('"head_version": 1', '"head_version": 9'))
    with pytest.raises(HeadError, match="version"):
        DraftHead.load(tmp_path)


def fed(head: DraftHead, feats: torch.Tensor, upto: int, max_len: int = 40) -> HeadProposer:
    """A fresh proposer that has observed the features of positions ``[0, upto)``."""
    proposer = HeadProposer(head, max_len=max_len)
    proposer.observe(0, feats[:upto])
    return proposer


def test_proposer_is_deterministic(target: StageModel) -> None:
    """Two proposers fed the same features and context draft the same tokens."""
    head = make_head(target)
    ids, feats = stream(target, 24)
    a, b = fed(head, feats, 15), fed(head, feats, 15)
    assert a.propose(ids[:16], 5) == b.propose(ids[:16], 5)
    assert len(a.propose(ids[:16], 5)) == 5
    assert a.features == head.config.window  # one layer


def test_propose_after_a_shorter_context_is_a_fresh_proposal(target: StageModel) -> None:
    """Rollback by position: drafting on, then from an earlier context, is like a fresh start."""
    head = make_head(target)
    ids, feats = stream(target, 30)
    proposer = fed(head, feats, 20)
    proposer.propose(ids[:21], 6)  # caches the drafted positions 20..24
    other = [*ids[:18], (ids[18] + 1) % target.config.vocab_size]  # diverges at x_18
    proposer.observe(17, feats[17:18])  # the verdict: committed up to 17, 18.. unknown
    assert proposer.propose(other, 4) == fed(head, feats, 18).propose(other, 4)
    assert proposer.propose(ids[:21], 4) == fed(head, feats, 18).propose(ids[:21], 4)
    assert proposer.propose(ids[:15], 4) == fed(head, feats, 18).propose(ids[:15], 4)


def test_observe_overwrites_an_earlier_position(target: StageModel) -> None:
    """New features for an earlier position replace the old ones and what followed them."""
    head = make_head(target)
    ids, feats = stream(target, 30)
    _, wrong = stream(target, 30, seed=7)
    proposer = HeadProposer(head, max_len=40)
    proposer.observe(0, wrong[:20])
    proposer.propose(ids[:21], 3)
    proposer.observe(0, feats[:12])  # a rejection: positions 0..11 recommitted, 12.. dropped
    proposer.observe(12, feats[12:20])
    assert proposer.propose(ids[:21], 4) == fed(head, feats, 20).propose(ids[:21], 4)


def test_drafting_past_the_observed_features_chains(target: StageModel) -> None:
    """A context longer than the features (pipelining) drafts on the head's own predictions,
    and the real features replace them when they arrive."""
    head = make_head(target)
    ids, feats = stream(target, 30)
    x = torch.tensor([ids])
    proposer = fed(head, feats, 15)
    got = proposer.propose(ids[:19], 3)  # positions 15..17 have no feature yet
    with torch.inference_mode():  # what chaining from the real f_14 computes
        cache = head.new_cache(40)
        g = head.step(feats[None, :15], x[:, 1:16], 0, cache)[:, -1:]
        for t in range(15, 18):
            g = head.step(g, x[:, t + 1 : t + 2], t, cache)
        first = int(head.to_vocab(head.logits(g[0, 0]).argmax()))
    assert got[0] == first
    proposer.observe(15, feats[15:18])
    assert proposer.propose(ids[:19], 3) == fed(head, feats, 18).propose(ids[:19], 3)


def test_no_features_no_guess(target: StageModel) -> None:
    """Without observed features (or with no head position to read them) there is no draft."""
    head = make_head(target)
    ids, feats = stream(target, 10)
    assert HeadProposer(head, max_len=20).propose(ids, 3) == []
    proposer = fed(head, feats, 5)
    assert proposer.propose(ids[:1], 3) == []
    assert proposer.propose(ids[:6], 0) == []


def test_observe_rejects_malformed_features(target: StageModel) -> None:
    """Features of the wrong shape or outside the session are a ``HeadError``."""
    proposer = HeadProposer(make_head(target), max_len=10)
    d = target.config.hidden_size
    with pytest.raises(HeadError, match="features must be"):
        proposer.observe(0, torch.zeros(3, d + 1))
    with pytest.raises(HeadError, match="features must be"):
        proposer.observe(0, torch.zeros(3))
    with pytest.raises(HeadError, match="outside"):
        proposer.observe(8, torch.zeros(3, d))
    with pytest.raises(HeadError, match="outside"):
        proposer.observe(-1, torch.zeros(1, d))


def test_sampled_drafts_are_reproducible(target: StageModel) -> None:
    """The same generator seed gives the same draws and the same q; q is a distribution
    over shortlist tokens that holds the drawn token."""
    head = make_head(target)
    ids, feats = stream(target, 24)

    def draw(seed: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        gen = torch.Generator().manual_seed(seed)
        return fed(head, feats, 15).propose_sampled(ids[:16], 4, gen, temperature=1.5)

    (tokens, qs), (again, qs2) = draw(3), draw(3)
    assert tokens == again and len(qs) == 4
    for (i1, p1), (i2, p2), token in zip(qs, qs2, tokens, strict=True):
        assert torch.equal(i1, i2) and torch.equal(p1, p2)
        assert math.isclose(float(p1.sum()), 1.0, rel_tol=1e-5)
        assert token in i1.tolist() and bool(torch.isin(i1, head.shortlist).all())
    assert any(draw(s)[0] != tokens for s in range(4, 12))


def test_sampled_drafts_follow_q(target: StageModel, report: Callable[[str], None]) -> None:
    """Draws of the first draft follow the q returned with them (chi-square, 4 tokens)."""
    head = make_head(target)
    ids, feats = stream(target, 24)
    proposer = HeadProposer(head, max_len=40, top_k=4)
    proposer.observe(0, feats[:15])
    gen = torch.Generator().manual_seed(0)
    counts: dict[int, int] = {}
    q: tuple[torch.Tensor, torch.Tensor] | None = None
    n = 4000
    for _ in range(n):
        tokens, qs = proposer.propose_sampled(ids[:16], 1, gen, temperature=3.0)
        counts[tokens[0]] = counts.get(tokens[0], 0) + 1
        if q is not None:
            assert torch.equal(qs[0][0], q[0]) and torch.equal(qs[0][1], q[1])
        q = qs[0]
    assert q is not None
    expected = {int(t): float(p) * n for t, p in zip(*q, strict=True)}
    assert set(counts) <= set(expected)
    assert min(expected.values()) > 20, "q too peaked for the test; raise the temperature"
    chi2 = sum((counts.get(t, 0) - e) ** 2 / e for t, e in expected.items())
    report(f"head q chi-square {chi2:.2f} (3 dof), q {sorted(expected.values())}")
    assert chi2 < 16.27  # p = 0.001 at 3 degrees of freedom


def test_sampling_needs_a_positive_temperature(target: StageModel) -> None:
    """Temperature 0 is greedy drafting's job (``propose``), not a sampling setting."""
    ids, feats = stream(target, 12)
    with pytest.raises(HeadError, match="temperature"):
        fed(make_head(target), feats, 5).propose_sampled(ids[:6], 2, torch.Generator(), 0.0)


def test_ranked_puts_the_greedy_draft_first(target: StageModel) -> None:
    """``ranked`` (what β is measured with) lists distinct tokens, best first: the first is
    the greedy draft; nothing before any feature is observed."""
    head = make_head(target)
    ids, feats = stream(target, 24)
    proposer = fed(head, feats, 15)
    top = proposer.ranked(ids[:16], 5)
    assert len(top) == len(set(top)) == 5
    assert top[0] == fed(head, feats, 15).propose(ids[:16], 1)[0]
    assert HeadProposer(head, max_len=40).ranked(ids[:16], 5) == []
