"""The monitor's pure state fold and formatting: link states, histories, the merged event log."""

from __future__ import annotations

import subprocess
import sys

import attrs
import pytest

from shard.messages import EventRecord
from shard.observe.tui import state as st
from shard.observe.tui.state import FeedDialing, FeedLost, FeedNote, MonitorState, apply
from shard.testing.snapshots import T0, sample_snapshot

NOW = T0 + 500


def fold(*events: st.FeedEvent, state: MonitorState | None = None) -> MonitorState:
    out = state or MonitorState()
    for event in events:
        out = apply(out, event, NOW)
    return out


def test_first_dial_is_connecting_later_ones_reconnecting() -> None:
    """Dialing before any snapshot is "connecting"; after one it is "reconnecting"."""
    assert fold(FeedDialing("a:1", 1)).link == "connecting"
    state = fold(FeedDialing("a:1", 1), sample_snapshot(), FeedLost("gone"), FeedDialing("a:1", 2))
    assert (state.link, state.attempt, state.reason) == ("reconnecting", 2, "gone")
    assert state.snapshot == sample_snapshot()  # the last one is kept, shown as stale


def test_snapshot_makes_live_and_extends_histories() -> None:
    """Each snapshot appends its tok/s and α to the sparkline histories."""
    state = fold(sample_snapshot(tok_s=10, alpha=0.5), sample_snapshot(seq=2, tok_s=20, alpha=0.7))
    assert state.link == "live"
    assert state.tok_s == (10, 20)
    assert state.alpha == (0.5, 0.7)


def test_unknown_alpha_is_not_plotted_as_zero() -> None:
    """A snapshot without α (nothing drafted) leaves the α history as it was."""
    state = fold(sample_snapshot(alpha=0.5), sample_snapshot(seq=2, alpha=None))
    assert state.alpha == (0.5,)
    assert state.tok_s == (41.5, 41.5)


def test_histories_are_bounded() -> None:
    """Sparkline histories keep the last ``HISTORY`` points."""
    state = fold(*(sample_snapshot(seq=i, tok_s=float(i)) for i in range(st.HISTORY + 7)))
    assert len(state.tok_s) == st.HISTORY
    assert state.tok_s[-1] == st.HISTORY + 6


def test_events_are_merged_once() -> None:
    """Coordinator events repeated in every snapshot enter the log once, oldest first."""
    state = fold(sample_snapshot(), sample_snapshot(seq=2))
    assert [e.kind for e in state.log] == ["join", "fault", "epoch"]


def test_lost_feed_and_restart_are_noted() -> None:
    """A lost feed is noted once; a coordinator with a new start time is noted as restarted,
    and the events of its previous run stay in the log."""
    state = fold(
        sample_snapshot(),
        FeedLost("connection closed"),
        FeedLost("refused"),
        sample_snapshot(started=T0 + 300, events=(EventRecord(NOW + 1, "join", "s0 back"),)),
    )
    notes = [e.detail for e in state.log if e.kind == "monitor"]
    assert notes == ["feed lost: connection closed; reconnecting", "coordinator coord restarted"]
    assert [e.kind for e in state.log] == ["join", "fault", "epoch", "monitor", "monitor", "join"]


def test_log_is_in_time_order() -> None:
    """Coordinator events that arrive after a monitor note but happened before it are placed
    before it: the log reads in time order, not arrival order."""
    state = fold(FeedNote("starting the swarm"), sample_snapshot())
    assert [e.kind for e in state.log] == ["join", "fault", "epoch", "monitor"]


def test_feed_restored_without_restart() -> None:
    """The same coordinator coming back on a new connection is noted as restored."""
    state = fold(sample_snapshot(), FeedLost("x"), sample_snapshot(seq=9))
    assert state.log[-1] == EventRecord(NOW, "monitor", "feed restored")


def test_reset_clears_histories_only() -> None:
    """``reset`` clears the sparkline histories and notes it; the snapshot stays."""
    state = st.reset(fold(sample_snapshot(), FeedNote("hello")), NOW)
    assert (state.tok_s, state.alpha) == ((), ())
    assert state.snapshot is not None
    assert [e.detail for e in state.log[-2:]] == ["hello", "rolling statistics reset requested"]


def test_log_is_bounded() -> None:
    """The event log keeps the last ``LOG_KEPT`` lines."""
    state = fold(*(FeedNote(str(i)) for i in range(st.LOG_KEPT + 5)))
    assert len(state.log) == st.LOG_KEPT
    assert state.log[-1].detail == str(st.LOG_KEPT + 4)


def test_formatting() -> None:
    """Milliseconds, ratios and counts format compactly; unknown values show as a dash."""
    assert [st.ms(v) for v in (None, 0.00041, 0.0123, 0.2501)] == ["–", "0.4", "12.3", "250"]
    assert [st.ratio(v) for v in (None, 0.75, 1.0)] == ["–", "0.75", "1.00"]
    assert (st.rate(41.53), st.count(None), st.count(0)) == ("41.5", "–", "0")


def test_state_is_frozen() -> None:
    """The state is an immutable record: every change is a new one."""
    state = MonitorState()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.link = "live"  # type: ignore[misc]
    assert apply(state, FeedNote("x"), NOW) is not state


def test_monitor_does_not_import_torch() -> None:
    """The monitor and the status feed stay light: a fresh interpreter imports them without
    torch or numpy (the monitor runs on an operator's laptop)."""
    code = (
        "import shard.observe.tui.main, shard.observe.status, sys; "
        "assert 'torch' not in sys.modules, 'torch'; "
        "assert 'numpy' not in sys.modules, 'numpy'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
