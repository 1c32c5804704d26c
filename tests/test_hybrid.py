"""The hybrid draft: prompt lookup over long matches, a model elsewhere, per position."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from shard.decode.draft import NGramProposer
from shard.decode.hybrid import HybridProposer


class Counting:
    """A model proposer that guesses ``1000 + len(context)`` and records what it was asked."""

    name = "model"
    computes = False
    features = 3
    feature_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.asked: list[list[int]] = []
        self.observed: list[tuple[int, torch.Tensor]] = []

    def observe(self, position: int, features: torch.Tensor) -> None:
        self.observed.append((position, features))

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self.asked.append(list(context))
        return [1000 + len(context) + i for i in range(k)]

    def feedback(self, drafted: int, accepted: int) -> None:
        return None


class Scripted(Counting):
    """Guesses the scripted tokens in turn (then nothing)."""

    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.script = script

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self.asked.append(list(context))
        return [self.script.pop(0)] if self.script else []


def test_the_model_guesses_until_a_long_match_then_the_span_is_copied_in_one_chunk() -> None:
    """Inside one chunk: a 3-token match is not trusted (min_match 4), so the model guesses;
    its guess makes the suffix line up over 4 tokens, and the span after it is copied."""
    context = [10, 11, 12, 13, 14, 15, 16, 99, 10, 11, 12]
    model = Scripted([13])
    hybrid = HybridProposer(model, min_match=4)
    assert hybrid.propose(context, 4) == [13, 14, 15, 16]
    assert hybrid.names == ["model", "ngram", "ngram", "ngram"]
    assert model.asked == [context]
    trusting = HybridProposer(Scripted([]), min_match=3)  # 3 tokens now suffice: all copied
    assert trusting.propose(context, 4) == [13, 14, 15, 16]
    assert trusting.names == ["ngram"] * 4


def test_no_match_is_all_model_and_the_model_sees_each_token_it_drafted() -> None:
    model = Counting()
    hybrid = HybridProposer(model)
    assert hybrid.propose([1, 2, 3], 3) == [1003, 1004, 1005]
    assert model.asked == [[1, 2, 3], [1, 2, 3, 1003], [1, 2, 3, 1003, 1004]]


def test_a_model_with_no_guess_ends_the_draft() -> None:
    class Silent(Counting):
        def propose(self, context: Sequence[int], k: int) -> list[int]:
            return []

    assert HybridProposer(Silent()).propose([1, 2, 3], 4) == []


def test_lookup_reports_how_long_its_match_is() -> None:
    ngram = NGramProposer(tolerant=False)
    assert ngram.lookup([5, 6, 7, 1, 5, 6, 7], 2) == ([1, 5], 3)
    assert ngram.lookup([1, 2, 3], 2) == ([], 0)
    assert ngram.propose([5, 6, 7, 1, 5, 6, 7], 2) == [1, 5]


def test_lookup_span_is_what_the_lookup_would_copy_before_the_model_drafts() -> None:
    """The span the controller prices: the copied tokens a proposal would start with (as
    many as follow the match, up to k), none for a match shorter than min_match."""
    context = [10, 11, 12, 13, 14, 15, 16, 99, 10, 11, 12, 13]
    hybrid = HybridProposer(Counting(), min_match=4)
    assert hybrid.lookup_span(context, 8) == 8  # 14 15 16 99 10 11 12 13 followed the match
    assert hybrid.lookup_span(context, 2) == 2
    assert hybrid.propose(context, 2) == [14, 15] and hybrid.names == ["ngram"] * 2
    assert HybridProposer(Counting(), min_match=5).lookup_span(context, 8) == 0
    assert hybrid.lookup_span([1, 2, 3], 8) == 0


def test_min_match_must_be_positive() -> None:
    with pytest.raises(ValueError, match="min_match"):
        HybridProposer(Counting(), min_match=0)


def test_the_model_reads_the_features() -> None:
    """The hybrid asks for the model's feature window and hands it every observation."""
    model = Counting()
    hybrid = HybridProposer(model)
    rows = torch.ones(2, 4)
    hybrid.observe(7, rows)
    assert hybrid.features == 3 and model.observed == [(7, rows)]
