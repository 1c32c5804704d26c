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
