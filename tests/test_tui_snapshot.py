"""Snapshot tests (pytest-textual-snapshot) of the monitor's main screen with fixed data.

The SVGs live in ``tests/__snapshots__/test_tui_snapshot/`` (the plugin's place); after a
deliberate change of the screen, review and accept with ``pytest --snapshot-update``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC
from typing import Any

import attrs
from textual.pilot import Pilot

from shard.messages import AuditCounts, EventRecord, NodeName, StatusSnapshot
from shard.observe.tui.app import MonitorApp
from shard.observe.tui.state import FeedDialing, FeedEvent, FeedLost
from shard.testing.snapshots import T0, sample_snapshot

ADDRESS = "127.0.0.1:7700"
#: Eight snapshots with tok/s and α moving, so both sparklines have a shape.
LIVE: tuple[FeedEvent, ...] = (
    FeedDialing(ADDRESS, 1),
    *(
        sample_snapshot(seq=i, tok_s=30.0 + 3 * (i % 4) + i, alpha=0.55 + 0.03 * i)
        for i in range(1, 9)
    ),
)


def app_after(*events: FeedEvent) -> tuple[MonitorApp, Callable[[Pilot[Any]], None]]:
    app = MonitorApp(address=ADDRESS, clock=lambda: T0 + 500, tz=UTC)

    def play(pilot: Pilot[Any]) -> None:
        for event in events:
            app.show(event)

    return app, play


def test_main_screen(snap_compare: Any) -> None:
    """The live main screen at 80×24: ring, numbers, sparklines, stages, events."""
    app, play = app_after(*LIVE)
    assert snap_compare(app, terminal_size=(80, 24), run_before=play)


def test_reconnecting_screen(snap_compare: Any) -> None:
    """A dropped feed: the link line says reconnecting and why; the last values are greyed."""
    app, play = app_after(*LIVE, FeedLost("connection closed (1006)"), FeedDialing(ADDRESS, 2))
    assert snap_compare(app, terminal_size=(80, 24), run_before=play)


def test_wide_terminal(snap_compare: Any) -> None:
    """At 120×32 the same screen grows: a longer event log, wider sparklines."""
    app, play = app_after(*LIVE)
    assert snap_compare(app, terminal_size=(120, 32), run_before=play)


def _after_eviction() -> StatusSnapshot:
    """The sample ring after s1 was evicted for failed audits and its standby took its slot."""
    swap = {NodeName("s1"): NodeName("s1-standby")}
    path = "/var/cache/shard/evidence/s1-session7-chunk3-5be1a0c2d94f.json"
    snap = sample_snapshot(seq=9)
    return attrs.evolve(
        snap,
        ring=tuple(swap.get(n, n) for n in snap.ring),
        edges=tuple(attrs.evolve(e, src=swap.get(e.src, e.src), dst=swap.get(e.dst, e.dst))
                    for e in snap.edges),
        stages=tuple(attrs.evolve(s, node=swap.get(s.node, s.node)) for s in snap.stages),
        audit=AuditCounts(
            audits=31, strikes=2, evictions=1, evicted=(NodeName("s1"),),
            evidence=(path,),
        ),
        events=(
            *snap.events,
            EventRecord(T0 + 100, "audit", "s1 failed an audit (the output's bytes differ); "
                        f"strike 2; evidence in {path}"),
            EventRecord(T0 + 100.5, "audit", "s1 evicted after failed audits"),
        ),
    )  # fmt: skip


def test_eviction_screen(snap_compare: Any) -> None:
    """After an eviction: the standby on the ring line, s1 nowhere on it or in the stage
    table, the audit line naming s1 and the newest evidence file, the strike events in red."""
    app, play = app_after(*LIVE, _after_eviction())
    assert snap_compare(app, terminal_size=(100, 30), run_before=play)
