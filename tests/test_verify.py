"""The target's choice and the acceptance rule (pure functions)."""

from __future__ import annotations

import pytest
import torch

from shard.messages import Sampling
from shard.verify import choose_token, filter_logits, make_generator, verify_chunk

GREEDY = Sampling()


def one_hot_rows(ids: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax at row i is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    for row, token in enumerate(ids):
        logits[row, token] = 5.0
    return logits


def test_greedy_choice_is_argmax() -> None:
    """Temperature 0 picks the argmax and needs no generator."""
    assert choose_token(torch.tensor([0.1, 3.0, -1.0]), GREEDY, None) == 1


def test_sampling_needs_a_generator() -> None:
    """Sampling without a generator is a programming error, said plainly."""
    with pytest.raises(ValueError, match="generator"):
        choose_token(torch.zeros(4), Sampling(temperature=1.0), None)


def test_seeded_draws_repeat() -> None:
    """The same seed gives the same sequence of draws."""
    sampling = Sampling(temperature=1.0, seed=7)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    first = [
        choose_token(logits, sampling, g) for g in [make_generator(sampling)] for _ in range(20)
    ]
    second = [
        choose_token(logits, sampling, g) for g in [make_generator(sampling)] for _ in range(20)
    ]
    assert first == second
    assert len(set(first)) > 1


def test_top_k_and_top_p_restrict_support() -> None:
    """top-k keeps k tokens; top-p keeps the smallest prefix reaching the mass."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (filter_logits(logits, Sampling(temperature=1.0, top_k=2)) > 0).sum() == 2
    probs = filter_logits(logits, Sampling(temperature=1.0, top_p=0.75))
    assert (probs > 0).tolist() == [True, True, False, False]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_all_drafts_accepted_gets_bonus_token() -> None:
    """When every draft matches, the verdict holds K+1 target ids."""
    verdict = verify_chunk(one_hot_rows([3, 4, 5, 6]), [3, 4, 5], GREEDY, None)
    assert verdict.target_ids == (3, 4, 5, 6)
    assert verdict.accepted == 3


def test_first_mismatch_stops_and_corrects() -> None:
    """At the first disagreement the target's token replaces the draft and the walk stops."""
    verdict = verify_chunk(one_hot_rows([3, 7, 5, 6]), [3, 4, 5], GREEDY, None)
    assert verdict.target_ids == (3, 7)
    assert verdict.accepted == 1


def test_no_draft_is_one_decode_step() -> None:
    """An empty draft is plain decoding: one target token, nothing accepted."""
    verdict = verify_chunk(one_hot_rows([2]), [], GREEDY, None)
    assert verdict == verdict.__class__(target_ids=(2,), accepted=0)


def test_logits_must_fit_the_draft() -> None:
    """A logits block of the wrong length is refused."""
    with pytest.raises(ValueError, match="do not fit"):
        verify_chunk(one_hot_rows([1, 2]), [1, 2], GREEDY, None)
