"""The target's choice and the acceptance rule (pure functions)."""

from __future__ import annotations

import math

import pytest
import torch

from shard.decode.state import MIN_TEMPERATURE
from shard.decode.verify import check_q, choose_token, filter_logits, verify_chunk
from shard.messages import DraftQ, Sampling

GREEDY = Sampling()


def one_hot_rows(ids: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax at row i is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    for row, token in enumerate(ids):
        logits[row, token] = 5.0
    return logits


def test_greedy_choice_is_argmax() -> None:
    """Temperature 0 picks the argmax."""
    assert choose_token(torch.tensor([0.1, 3.0, -1.0]), GREEDY, 0) == 1


def test_draws_are_keyed_by_seed_and_position() -> None:
    """A draw depends only on (seed, position): repeatable, and varying with either."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(temperature=1.0, seed=7)
    first = [choose_token(logits, sampling, pos) for pos in range(40)]
    again = [choose_token(logits, sampling, pos) for pos in reversed(range(40))][::-1]
    assert first == again  # the order of draws does not matter
    assert len(set(first)) > 1
    other = [choose_token(logits, Sampling(temperature=1.0, seed=8), pos) for pos in range(40)]
    assert other != first


def test_sampling_follows_the_distribution() -> None:
    """Across positions, draws follow softmax(logits / T) within a few standard deviations."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sampling = Sampling(temperature=1.0, seed=3)
    n = 4000
    draws = torch.tensor([choose_token(logits, sampling, pos) for pos in range(n)])
    counts = torch.bincount(draws, minlength=4).float()
    expected = torch.softmax(logits, dim=-1) * n
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)


def test_top_k_and_top_p_restrict_support() -> None:
    """top-k keeps k tokens; top-p keeps the smallest prefix reaching the mass."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (filter_logits(logits, Sampling(temperature=1.0, top_k=2)) > 0).sum() == 2
    probs = filter_logits(logits, Sampling(temperature=1.0, top_p=0.75))
    assert (probs > 0).tolist() == [True, True, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_all_drafts_accepted_gets_bonus_token() -> None:
    """When every draft matches, the verdict holds K+1 target ids."""
    verdict = verify_chunk(one_hot_rows([3, 4, 5, 6]), [3, 4, 5], GREEDY, 10)
    assert verdict.target_ids == (3, 4, 5, 6)
    assert verdict.accepted == 3


def test_first_mismatch_stops_and_corrects() -> None:
    """At the first disagreement the target's token replaces the draft and the walk stops."""
    verdict = verify_chunk(one_hot_rows([3, 7, 5, 6]), [3, 4, 5], GREEDY, 10)
    assert verdict.target_ids == (3, 7)
    assert verdict.accepted == 1


def test_no_draft_is_one_decode_step() -> None:
    """An empty draft is plain decoding: one target token, nothing accepted."""
    verdict = verify_chunk(one_hot_rows([2]), [], GREEDY, 10)
    assert verdict == verdict.__class__(target_ids=(2,), accepted=0)


def test_logits_must_fit_the_draft() -> None:
    """A logits block of the wrong length is refused."""
    with pytest.raises(ValueError, match="do not fit"):
        verify_chunk(one_hot_rows([1, 2]), [1, 2], GREEDY, 10)


def test_sampled_verification_is_lossless_for_a_one_hot_draft() -> None:
    """Sampled verify_chunk accepts a draft d at rate p(d); a rejection's correction follows p
    restricted to tokens != d (chi-square), so the output is distributed as p."""
    logits = torch.tensor([1.5, 0.5, 0.0, -0.5, 1.0])
    p = torch.softmax(logits, dim=-1)
    rows = torch.stack([logits, logits])  # [K+1 = 2, V]
    sampling = Sampling(temperature=1.0, seed=11)
    draft, n = 4, 20000
    corrections = torch.zeros(len(p), dtype=torch.float64)
    accepted = 0
    for position in range(n):
        verdict = verify_chunk(rows, [draft], sampling, position)
        accepted += verdict.accepted
        if verdict.accepted == 0:
            corrections[verdict.target_ids[0]] += 1
    p_d = float(p[draft])
    assert abs(accepted / n - p_d) < 4 * (p_d * (1 - p_d) / n) ** 0.5
    assert corrections[draft] == 0
    others = [t for t in range(len(p)) if t != draft]
    expected = p.double()[others] / (1 - p_d) * (n - accepted)
    stat = float((((corrections[others] - expected) ** 2) / expected).sum())
    # chi-square, 3 dof: the 99.99th percentile is 21.1.
    assert stat < 21.1, (corrections, expected)


def test_chunk_verdicts_equal_token_by_token_choice() -> None:
    """Verifying in chunks picks the same token at each position as choosing one at a time, so
    a seeded run's output does not depend on where chunks begin or how much was drafted."""
    gen = torch.Generator().manual_seed(2)
    sampling = Sampling(temperature=0.8, top_k=6, seed=5)
    logits = torch.randn(30, 8, generator=gen)  # [positions, V]
    one_by_one = [choose_token(logits[i], sampling, 100 + i) for i in range(30)]
    for k in (1, 3, 5):
        out: list[int] = []
        rejected = 0
        while len(out) < 25:
            i = len(out)
            draft = one_by_one[i : i + k]  # a perfect draft, except where a slot is forced wrong
            if i % 7 == 3:
                draft = [(draft[0] + 1) % 8, *draft[1:]]
            verdict = verify_chunk(logits[i : i + len(draft) + 1], draft, sampling, 100 + i)
            assert len(verdict.target_ids) == verdict.accepted + 1
            rejected += verdict.accepted < len(draft)
            out.extend(verdict.target_ids)
        assert rejected > 0, k
        assert out[:25] == one_by_one[:25], k


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1e-40, seed=1),
        Sampling(temperature=5e-324, seed=1),
        Sampling(temperature=1.0, top_p=5e-324, seed=1),
        Sampling(temperature=1e-40, top_p=1e-40, seed=1),
        Sampling(temperature=1e-4, top_p=1e-9, top_k=1, seed=1),
        Sampling(temperature=1e4, seed=1),
        Sampling(temperature=1e300, seed=1),
        Sampling(temperature=math.inf, top_p=math.nan, seed=1),
    ],
)
def test_extreme_sampling_values_give_a_distribution(sampling: Sampling) -> None:
    """Tiny or huge temperature / top-p never put inf or NaN into the draw."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 30
    probs = filter_logits(logits, sampling)
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    token = choose_token(logits, sampling, 5)
    assert 0 <= token < 64
    if sampling.temperature < MIN_TEMPERATURE or sampling.top_p < 1e-8:
        assert token == int(torch.argmax(logits))  # greedy, or the nucleus is one token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hostile_logits_give_a_token(temperature: float) -> None:
    """NaN and infinite logits (a broken block) still give a token, never an exception."""
    sampling = Sampling(temperature=temperature, top_p=0.9, top_k=3, seed=2)
    rows = [
        torch.full((16,), math.nan),
        torch.tensor([math.inf, -math.inf] * 8),
        torch.tensor([math.nan, 1.0, math.inf, -math.inf] * 4),
        torch.full((16,), -math.inf),
        torch.tensor([3.4e38, -3.4e38] * 8),
    ]
    for row in rows:
        assert 0 <= choose_token(row, sampling, 0) < 16
        probs = filter_logits(row, sampling)
        assert bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0
    one_inf = torch.tensor([0.0] * 15 + [math.inf])
    assert choose_token(one_inf, sampling, 0) == 15  # +inf is the likeliest token


def test_tiny_temperature_is_greedy() -> None:
    """A temperature below MIN_TEMPERATURE decides exactly like temperature 0."""
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(4))
    for row in logits:
        assert choose_token(row, Sampling(temperature=1e-40, seed=9), 3) == choose_token(
            row, GREEDY, 3
        )


def _q(probs: dict[int, float]) -> DraftQ:
    return DraftQ(ids=tuple(probs), probs=tuple(probs.values()))


def test_sampled_draft_with_q_is_lossless_and_accepts_more() -> None:
    """A draft that samples d ~ q and sends q: the general rule commits a token distributed as
    p (chi-square over the first committed token), accepts at rate sum(min(p, q)) — above the
    one-hot rule's sum(q * p) for the same drafts — and never accepts what q could not draw."""
    logits = torch.tensor([1.5, 0.5, 0.0, -0.5, 1.0])
    p = torch.softmax(logits, dim=-1).double()
    q = {0: 0.5, 4: 0.3, 1: 0.2}  # near p, but missing tokens 2 and 3
    dq = _q(q)
    qd = torch.zeros(5, dtype=torch.float64)
    for t, v in q.items():
        qd[t] = v
    rows = torch.stack([logits, logits])  # [K+1 = 2, V]
    sampling = Sampling(temperature=1.0, seed=5)
    drafts = torch.Generator().manual_seed(1)
    n, accepted, one_hot = 20000, 0, 0
    firsts = torch.zeros(5, dtype=torch.float64)
    for position in range(n):
        d = int(torch.multinomial(qd.float(), 1, generator=drafts))
        verdict = verify_chunk(rows, [d], sampling, position, (dq,))
        accepted += verdict.accepted
        one_hot += verify_chunk(rows, [d], sampling, position).accepted
        firsts[verdict.target_ids[0]] += 1
    rate = float(torch.minimum(p, qd).sum())
    assert abs(accepted / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    assert accepted > one_hot  # sum(min(p, q)) = 0.83 > sum(q * p) = 0.33 here
    expected = p * n
    stat = float((((firsts - expected) ** 2) / expected).sum())
    assert stat < 23.5, (firsts, expected)  # chi-square, 4 dof: the 99.99th percentile


def test_q_rule_is_reproducible_and_greedy_ignores_q() -> None:
    """The same seed and draft give the same verdict every run; a greedy request decides by
    argmax whatever q says."""
    logits = torch.tensor([[0.2, 1.0, 0.1], [0.0, 0.3, 0.9]])
    dq = _q({1: 0.6, 2: 0.4})
    sampled = Sampling(temperature=0.7, seed=3)
    runs = {verify_chunk(logits, [2], sampled, 40, (dq,)) for _ in range(5)}
    assert len(runs) == 1
    assert verify_chunk(logits, [2], GREEDY, 40, (dq,)) == verify_chunk(logits, [2], GREEDY, 40)
    with pytest.raises(ValueError, match="draft distributions"):
        verify_chunk(logits, [2], sampled, 40, (dq, dq))


@pytest.mark.parametrize(
    ("q", "draft", "why"),
    [
        ((_q({1: 1.0}), _q({1: 1.0})), [1], "2 draft distributions for 1"),
        ((DraftQ(),), [1], "non-empty"),
        ((DraftQ(ids=(1, 1), probs=(0.5, 0.5)),), [1], "distinct"),
        ((DraftQ(ids=(1, 2), probs=(1.0,)),), [1], "paired"),
        ((_q({9: 1.0}),), [9], "out of range"),
        ((_q({1: math.nan, 2: 1.0}),), [1], "finite"),
        ((_q({1: -0.5, 2: 1.5}),), [1], ">= 0"),
        ((_q({1: 0.5, 2: 0.6}),), [1], "sum to 1.1"),
        ((_q({1: 0.0, 2: 1.0}),), [1], "probability 0"),
        ((_q({2: 1.0}),), [1], "probability 0"),
    ],
)
def test_check_q_names_what_is_wrong(q: tuple[DraftQ, ...], draft: list[int], why: str) -> None:
    assert why in (check_q(q, draft, vocab=8) or "")


def test_check_q_accepts_a_real_distribution() -> None:
    assert check_q((), [1, 2], vocab=8) is None
    assert check_q((_q({1: 0.25, 3: 0.75}),), [3], vocab=8) is None
