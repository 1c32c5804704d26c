"""Stop strings on streamed text (``shard.coordinator.stops``): cut at the first complete stop
string, across pieces, never emitting part of one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shard.coordinator.stops import StopText


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    s = StopText(stops)
    out = "".join(s.push(p) for p in pieces) + s.flush()
    return out, s.hit


def test_a_stop_string_split_across_pieces_cuts_there() -> None:
    """ "END" arriving as "E", "N", "D" cuts the text before it."""
    assert run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_a_partial_stop_string_is_held_back_then_released() -> None:
    """Text that might start a stop string waits; when it does not, it comes out whole."""
    s = StopText(["END"])
    assert s.push("hello E") == "hello "
    assert s.push("N") == ""
    assert s.push("x") == "ENx"
    assert s.flush() == "" and not s.hit


def test_the_earliest_stop_wins_and_nothing_follows() -> None:
    """Of several stop strings the first to complete cuts; later pushes emit nothing."""
    s = StopText(["\n\n", "b"])
    assert s.push("a b\n\n") == "a "
    assert s.push("more") == "" and s.hit


def test_an_unfinished_stop_is_released_at_the_end() -> None:
    """A generation that ends mid-stop-string keeps that text (it never was a stop)."""
    assert run(["STOP"], ["x ST"]) == ("x ST", False)


@given(
    text=st.text(alphabet="abE\nND", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="abEND\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_any_split_gives_the_whole_text_cut(text: str, cuts: list[str], stops: list[str]) -> None:
    """However the text is split, the output is the text cut before the stop string that
    completes first (earliest end; of those ending together, the earliest start)."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
    expected = text[: min(found)[1]] if found else text
    assert run(stops, pieces) == (expected, bool(found))
