"""NGramProposer: exact prompt lookup, and the tolerant match that survives one changed token."""

from __future__ import annotations

import pytest

from shard.decode.draft import NGramProposer

# A copied log: each line differs from the one before in its counter only.
#   item 4 1 2 , bolts , B \n item 4 1 3 , bolts , B \n item 4 1 4
ITEM, COMMA, BOLTS, B, NL = 100, 101, 102, 103, 104
LOG = [
    *(ITEM, 4, 1, 2, COMMA, BOLTS, COMMA, B, NL),
    *(ITEM, 4, 1, 3, COMMA, BOLTS, COMMA, B, NL),
    *(ITEM, 4, 1, 4),
]


def test_exact_match_continues_the_most_recent_repeat() -> None:
    ngram = NGramProposer(tolerant=False)
    # "1 2" and later "1 3": the suffix "4 1" last continued with 3.
    assert ngram.propose([*LOG[:-1]], 3) == [3, COMMA, BOLTS]
    assert ngram.propose([5, 6, 7, 8, 5, 6], 2) == [7, 8]


def test_never_more_than_k_and_nothing_without_a_repeat() -> None:
    ngram = NGramProposer()
    assert ngram.propose([1, 2, 3, 4], 5) == []
    assert ngram.propose([], 5) == []
    assert ngram.propose([7], 5) == []
    assert len(ngram.propose(LOG * 3, 4)) == 4
    assert ngram.propose([5, 6, 7, 8, 5, 6], 0) == []


def test_a_changed_counter_no_longer_loses_the_line() -> None:
    """After "item 4 1 4" the exact suffix "4" matches anywhere (a 1-gram); the tolerant match
    lines the context up with "item 4 1 3" (one token differs) and continues the line."""
    line_rest = [COMMA, BOLTS, COMMA, B]
    assert NGramProposer().propose(LOG, 4) == line_rest
    assert NGramProposer(tolerant=False).propose(LOG, 4) == [1, 4]  # the 1-gram "4"
    # One token past the change, the exact suffix "4 ," still has no earlier occurrence: the
    # 1-gram "," last continued with "B".
    assert NGramProposer().propose([*LOG, COMMA], 3) == line_rest[1:]
    assert NGramProposer(tolerant=False).propose([*LOG, COMMA], 3) == [B, NL, ITEM]


def test_the_longest_match_beats_a_more_recent_shorter_one() -> None:
    # The suffix 1 2 3 4 5 occurred once; 2 3 4 5 (after a 9) more recently.
    context = [1, 2, 3, 4, 5, 50, 9, 2, 3, 4, 5, 60, 1, 2, 3, 4, 5]
    assert NGramProposer().propose(context, 1) == [50]
    assert NGramProposer(window=4).propose(context, 1) == [60]  # 4 tokens: a tie, most recent


def test_one_change_lines_up_two_do_not() -> None:
    # "5 1 2 3 4 -> 40" earlier, "3 4 -> 50" more recently.
    one = [5, 1, 2, 3, 4, 40, 3, 4, 50, 7, 1, 8, 3, 4]  # "1 [8] 3 4" lines up with "1 2 3 4"
    two = [5, 1, 2, 3, 4, 40, 3, 4, 50, 7, 9, 8, 3, 4]  # "9 8 3 4": two changes
    assert NGramProposer().propose(one, 1) == [40]
    assert NGramProposer().propose(two, 1) == [50]
    assert NGramProposer(tolerant=False).propose(one, 1) == [50]


@pytest.mark.parametrize(("window", "min_n"), [(0, 1), (4, 0), (4, 5)])
def test_bad_parameters_are_refused(window: int, min_n: int) -> None:
    with pytest.raises(ValueError, match="min_n"):
        NGramProposer(window=window, min_n=min_n)


def _walk(
    context: list[int], k: int, window: int, min_n: int, tolerant: bool
) -> tuple[list[int], int]:
    """The lookup as it was first written: a walk back from every candidate, one token at a
    time (the definition ``NGramProposer.lookup`` computes all at once)."""
    end = len(context)
    exact_n, exact_at, loose_n, loose_at = 0, -1, 0, -1
    for at in range(end - 1, 0, -1):
        run = equal = misses = 0
        for j in range(1, min(window, at) + 1):
            if context[at - j] == context[end - j]:
                equal += 1
                run += misses == 0
            else:
                misses += 1
                if misses > 1 or not tolerant:
                    break
        if run > exact_n:
            exact_n, exact_at = run, at
        if equal > loose_n:
            loose_n, loose_at = equal, at
    if tolerant and loose_n >= 3 and loose_n > exact_n:
        return context[loose_at : loose_at + k], loose_n
    if exact_n >= min_n:
        return context[exact_at : exact_at + k], exact_n
    return [], 0


@pytest.mark.parametrize("tolerant", [True, False])
@pytest.mark.parametrize(("window", "min_n"), [(8, 1), (4, 2), (1, 1), (12, 3)])
def test_the_lookup_equals_the_walk_it_replaced(window: int, min_n: int, tolerant: bool) -> None:
    """On seeded contexts of few distinct tokens (so matches of every length, ties and one
    changed token abound) and copied runs, every prefix gives the walk's span and length."""
    import random

    rng = random.Random(window * 100 + min_n * 10 + tolerant)
    ngram = NGramProposer(window=window, min_n=min_n, tolerant=tolerant)
    checked = matched = 0
    for _ in range(60):
        context = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(0, 40))]
        if context and rng.random() < 0.5:  # a copy with one token changed
            copy = context[: rng.randrange(len(context) + 1)]
            if copy:
                copy[rng.randrange(len(copy))] = 99
            context += copy
        for n in range(len(context) + 1):
            want = _walk(context[:n], 5, window, min_n, tolerant)
            assert ngram.lookup(context[:n], 5) == want, (context[:n], window, min_n, tolerant)
            checked += 1
            matched += want[1] > 0
    assert checked > 1000 and matched > checked // 10  # 16-66 % of prefixes have a match
