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


def test_lookup_span_follows_a_copy_past_the_end_of_the_context_as_the_draft_does() -> None:
    """A list whose next line repeats the last: the match's continuation runs into the
    context's end after 4 tokens, and the draft looks up again and goes on copying; the span
    the controller prices is the draft's, all k tokens, not the 4 the first lookup gave
    (before the change, 4)."""
    line = [7, 8, 9, 5]
    context = [1, 2, *line, *line, *line]
    hybrid = HybridProposer(Counting(), min_match=2)
    assert hybrid.propose(context, 10) == [7, 8, 9, 5, 7, 8, 9, 5, 7, 8]
    assert hybrid.names == ["ngram"] * 10
    assert hybrid.lookup_span(context, 10) == 10
    assert hybrid.lookup_span(context, 3) == 3
    tail = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 21, 22]  # the span 23..29 21 22 hits the end
    row = [23, 24, 25, 26, 27, 28, 29]
    assert hybrid.propose(tail, 16) == [*row, 21, 22, *row]
    assert hybrid.names == ["ngram"] * 16 and hybrid.lookup_span(tail, 16) == 16
    # a match it does not trust is no span, however far the copy would run
    assert HybridProposer(Counting(), min_match=9).lookup_span(context, 10) == 0  # lines up 8


def test_lookup_span_is_the_drafts_leading_copied_run_on_any_context() -> None:
    """Over 400 seeded contexts drawn from 4 tokens (so matches of every length abound, and
    spans that run into the context's end): the span equals the run of copied guesses that
    ``propose`` starts its draft with, for both match thresholds."""
    import random

    rng = random.Random(29)
    for _ in range(400):
        context = [rng.randrange(4) for _ in range(rng.randrange(2, 30))]
        k = rng.randrange(1, 20)
        for min_match in (1, 2, 3):
            hybrid = HybridProposer(Counting(), min_match=min_match)
            hybrid.propose(context, k)
            lead = next((i for i, n in enumerate(hybrid.names) if n != "ngram"), len(hybrid.names))
            assert hybrid.lookup_span(context, k) == lead, (context, k, min_match)


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


# Structured text: blocks (u, v, 7, 8) with u and v new each time, so at every 7 after the
# first the lookup lines up exactly one token (even allowing one miss) and guesses 8, rightly;
# it ends in such a 7. Prose-like: the same, but what follows each 7 is new (never right).
STRUCTURED = [t for b in range(6) for t in (20 + 2 * b, 21 + 2 * b, 7, 8)] + [40, 41, 7]
LOOSE = [t for b in range(6) for t in (20 + 2 * b, 21 + 2 * b, 7, 50 + b)] + [40, 41, 7]


def test_settle_scores_short_matches_on_the_settled_text() -> None:
    """Each position whose suffix lines up exactly 1 token with earlier text is scored on
    whether the lookup's guess was the next settled token; the prior weighs 4 tokens at 0.1."""
    structured = HybridProposer(Counting())
    structured.settle(STRUCTURED, 0.5)
    # the 7s of blocks 2 to 6 (the last 7 has no next token yet): all right
    assert structured.short_rate == pytest.approx((5 + 0.4) / (5 + 4))
    loose = HybridProposer(Counting())
    loose.settle(LOOSE, 0.5)
    assert loose.short_rate == pytest.approx((0 + 0.4) / (5 + 4))
    # settling the same text again scores nothing twice; one more token scores one more
    structured.settle(STRUCTURED, 0.5)
    assert structured.short_rate == pytest.approx(5.4 / 9)
    structured.settle([*STRUCTURED, 8], 0.5)  # the last 7, now followed by 8: right
    assert structured.short_rate == pytest.approx(6.4 / 10)


def test_a_short_match_goes_first_only_where_it_beats_the_model_on_this_text() -> None:
    """The context ends in a 1-token match (7, then 8 in STRUCTURED). Unsettled, or where the
    model's acceptance is above the scored rate, the model drafts; below it, the lookup copies."""
    fresh = HybridProposer(Counting())
    assert fresh.propose(STRUCTURED, 1) == [1000 + len(STRUCTURED)]
    assert fresh.names == ["model"]
    sure = HybridProposer(Counting())
    sure.settle(STRUCTURED, 0.9)  # the model is right 90 % of the time: above 0.6
    assert sure.propose(STRUCTURED, 1) == [1000 + len(STRUCTURED)]
    assert sure.lookup_span(STRUCTURED, 4) == 0
    missing = HybridProposer(Counting())
    missing.settle(STRUCTURED, 0.3)  # below the scored 0.6: the lookup goes first
    assert missing.propose(STRUCTURED, 1) == [8]
    assert missing.names == ["ngram"]
    assert missing.lookup_span(STRUCTURED, 4) > 0
    loose = HybridProposer(Counting())
    loose.settle(LOOSE, 0.3)  # scored 0.04: the model goes first even at 0.3
    assert loose.propose(LOOSE, 1) == [1000 + len(LOOSE)]


def test_settle_scores_a_bounded_window_of_a_long_prompt() -> None:
    """At most SCORE_WINDOW positions are scored at the start, however long the prompt."""
    from shard.decode import hybrid as module

    long = STRUCTURED * 30  # 810 tokens
    h = HybridProposer(NGramProposer(tolerant=False))
    seen: list[int] = []
    h._lookup = Recording(seen)
    h.settle(long, 0.5)
    assert len(seen) == module.SCORE_WINDOW
    assert max(seen) <= module.SCORE_CONTEXT


class Recording(NGramProposer):
    """A lookup that records the length of each context it searched."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.seen = seen

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        self.seen.append(len(context))
        return super().lookup(context, k)


def test_a_copy_task_trusts_a_short_match_where_the_target_realigned_after_its_own_edit() -> None:
    """The output repeats the prompt word for word, then the target drops a token (an edit
    of its own) and the lookup lines up only one token again. A request whose settled output
    was mostly guessed by trusted matches is a copy task: the short match goes first however
    sure the model is. Prose-like output (nothing copied) is not, and the model goes first."""
    prompt = list(range(100, 130))  # 30 distinct tokens
    copying = HybridProposer(Counting())
    copying.settle(prompt, 0.9)  # before any output: the prompt alone
    assert not copying.copy_task
    # 12 tokens copied, then the target's edit: 112 becomes 999 and 113 goes (two edits, so
    # even the tolerant lookup lines up only the last token, 114)
    output = [*prompt[:12], 999, 114]
    copying.settle(prompt + output, 0.9)
    assert copying._copied == [14, 10]  # 101..111 were guessed by matches of 2+ tokens
    assert copying.copy_task
    context = prompt + output
    assert NGramProposer().lookup(context, 3) == ([115, 116, 117], 1)
    assert copying.propose(context, 3) == [115, 116, 117]
    assert copying.names == ["ngram"] * 3
    prose = HybridProposer(Counting())
    prose.settle(prompt, 0.9)
    prose.settle([*prompt, *range(200, 212), 113], 0.9)  # 13 new tokens, then a 1-token match
    assert not prose.copy_task
    assert prose.propose([*prompt, *range(200, 212), 113], 1) == [1000 + len(prompt) + 13]
    early = HybridProposer(Counting())
    early.settle(prompt, 0.9)
    early.settle(prompt + prompt[:3] + prompt[4:5], 0.9)  # copied, but only 4 output tokens
    assert not early.copy_task


def test_a_short_match_rides_as_a_branch_until_the_reply_shows_whether_it_copies() -> None:
    """A reply that starts by copying the prompt from one token (a number, then directions):
    the model goes first, and ``branch`` hands the lookup's continuation to send beside it.
    Not where the match is trusted (the chunk copies it already), not once COPY_TASK_AFTER
    output tokens are settled (the copy-task rule decides from then on), not with no match,
    and not when branches are off."""
    from shard.decode import hybrid as module

    prompt = [*range(100, 120), 7, 8, 9, 10, 11, *range(130, 140)]
    context = [*prompt, 7]  # the reply's first token lines up one token: 7 -> 8 9 10
    h = HybridProposer(Counting())
    h.settle(context, 0.5)
    assert h.propose(context, 3) == [1000 + len(context) + i for i in range(3)]  # the model
    assert h.branch(context, 3) == [8, 9, 10]
    assert HybridProposer(Counting(), branch=False).branch(context, 3) == []
    h.settle([*prompt, 500], 0.5)
    assert h.branch([*prompt, 500], 3) == []  # no match
    trusted = HybridProposer(Counting())
    trusted.settle([*context, 8], 0.5)
    assert trusted.branch([*context, 8], 3) == []  # two tokens line up: the chunk copies
    late = HybridProposer(Counting())
    late.settle([*prompt, 500], 0.5)
    output = [500 + i for i in range(module.COPY_TASK_AFTER)]
    late.settle([*prompt, *output, 7], 0.5)
    assert late.branch([*prompt, *output, 7], 3) == []
    early = HybridProposer(Counting())
    early.settle([*prompt, 500], 0.5)
    early.settle([*prompt, *output[:-1], 7], 0.5)
    assert early.branch([*prompt, *output[:-1], 7], 3) == [8, 9, 10]
