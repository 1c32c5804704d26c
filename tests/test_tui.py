"""``MonitorApp`` driven by a fake feed under Textual's Pilot: what it shows matches the
snapshots, the bindings work, a dropped feed shows a reconnecting state.

Textual runs on asyncio: each test is a plain function that runs its scenario with
``asyncio.run`` (pytest-trio's ``trio_mode`` only takes ``async def`` tests). State changes are
awaited with ``pilot.pause()``, never with sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC

import attrs
from textual.pilot import Pilot
from textual.widgets import DataTable, Sparkline, Static

from shard.messages import EdgeStatus, StatusSnapshot
from shard.observe.tui import state as st
from shard.observe.tui.app import MonitorApp
from shard.observe.tui.state import FeedDialing, FeedEvent, FeedLost
from shard.testing.snapshots import T0, sample_snapshot

ADDRESS = "127.0.0.1:7700"

Scenario = Callable[["FakeFeed", Pilot[None]], Awaitable[None]]


class FakeFeed:
    """Stands in for the Trio feed client: plays events into the app, counts resets."""

    def __init__(self) -> None:
        self.resets = 0
        self.app = MonitorApp(
            address=ADDRESS, on_reset=self.request_reset, clock=lambda: T0 + 500, tz=UTC
        )

    def request_reset(self) -> None:
        self.resets += 1

    async def play(self, pilot: Pilot[None], *events: FeedEvent) -> None:
        for event in events:
            self.app.show(event)
        await pilot.pause()

    def text(self, selector: str) -> str:
        return str(self.app.query_one(selector, Static).content)

    def rows(self) -> list[list[str]]:
        table = self.app.query_one("#stages", DataTable)
        return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]

    def spark(self, selector: str) -> list[float]:
        return list(self.app.query_one(selector, Sparkline).data or [])


def drive(scenario: Scenario, size: tuple[int, int] = (80, 24)) -> FakeFeed:
    feed = FakeFeed()

    async def main() -> None:
        async with feed.app.run_test(size=size) as pilot:
            await scenario(feed, pilot)

    asyncio.run(main())
    return feed


def expected_ring(snap: StatusSnapshot) -> str:
    hops = " ".join(f"{e.src} ─{st.ms(e.last_s)}/{st.ms(e.median_s)}→" for e in snap.edges)
    return f"{hops} {snap.edges[-1].dst}"


def test_shows_the_snapshot() -> None:
    """Ring edges, lap, headline numbers, stage rows, sparklines and events match the feed."""
    snaps = [sample_snapshot(seq=i, tok_s=10.0 * i, alpha=0.5 + i / 10) for i in (1, 2, 3)]

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, FeedDialing(ADDRESS, 1), *snaps)
        last = snaps[-1]
        ring = feed.text("#ring").splitlines()
        assert ring[0] == expected_ring(last)
        assert ring[1] == "lap 41.2 ms (median 39.8) · tok/lap 3.10 · laps 815"
        summary = feed.text("#summary")
        assert "tok/s 30.0  α 0.80 (768/1024)  K 4  D 2  sessions 2" in summary
        assert "requests 14 done, 1 failed  tokens 2519  standbys none" in summary
        # s0 reports no batching (None: "–"); s1 and s2 their rows, forwards/s and wait
        assert feed.rows() == [
            [
                s.node,
                st.ms(s.compute_last_s),
                st.ms(s.compute_median_s),
                "64",
                "–",
                rows,
                fwd,
                wait,
            ]
            for s, rows, fwd, wait in zip(
                last.stages,
                ("–", "5.0", "6.0"),
                ("–", "30.0", "20.0"),
                ("–", "2.1", "2.6"),
                strict=True,
            )
        ]
        assert feed.spark("#tok-s") == [10.0, 20.0, 30.0]
        assert feed.spark("#alpha") == [0.6, 0.7, 0.8]
        assert (feed.text("#tok-s-label"), feed.text("#alpha-label")) == ("tok/s 30.0", "α 0.80")
        events = feed.text("#events").splitlines()
        assert events[0].startswith("12:01:36 epoch ")  # newest first, UTC
        assert events[-1] == "12:00:01 join    s2 (stage) connected from 127.0.0.1:40122"
        assert feed.text("#link").startswith("● live  swarm local · coord @ 127.0.0.1:7700")

    drive(scenario)


def test_unknown_values_show_as_dash() -> None:
    """Values the feed does not know (no α yet, no laps, no edge samples) show "–", not 0."""
    snap = attrs.evolve(
        sample_snapshot(alpha=None),
        lap_last_s=None,
        lap_median_s=None,
        tokens_per_lap=None,
        edges=tuple(EdgeStatus(e.src, e.dst) for e in sample_snapshot().edges),
    )

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, snap)
        ring = feed.text("#ring").splitlines()
        assert ring[0] == "coord ─–/–→ s0 ─–/–→ s1 ─–/–→ s2 ─–/–→ coord"
        assert ring[1].startswith("lap – ms (median –) · tok/lap –")
        assert "α – (768/1024)" in feed.text("#summary")
        assert feed.text("#alpha-label") == "α –"
        assert feed.spark("#alpha") == []
        assert not feed.app.query_one("#alpha", Sparkline).visible
        assert feed.app.query_one("#tok-s", Sparkline).visible

    drive(scenario)


def test_pause_freezes_the_view_and_resume_catches_up() -> None:
    """``p`` freezes the display (snapshots still arrive, the link line stays live); ``p``
    again shows the latest."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, sample_snapshot(tok_s=11.0))
        await pilot.press("p")
        await feed.play(pilot, sample_snapshot(seq=2, tok_s=22.0))
        assert feed.app.paused
        assert "tok/s 11.0" in feed.text("#summary")
        assert "PAUSED" in feed.text("#link")
        await feed.play(pilot, FeedLost("gone"), FeedDialing(ADDRESS, 1))
        assert feed.text("#link").startswith("⟳ reconnecting")  # the link line is never frozen
        await feed.play(pilot, sample_snapshot(seq=3, tok_s=22.0))
        await pilot.press("p")
        assert not feed.app.paused
        assert "tok/s 22.0" in feed.text("#summary")
        assert "PAUSED" not in feed.text("#link")
        assert feed.spark("#tok-s") == [11.0, 22.0, 22.0]

    drive(scenario)


def test_reset_asks_the_feed_and_clears_history() -> None:
    """``r`` asks the feed to reset the coordinator's rolling stats and clears the sparklines."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, sample_snapshot(), sample_snapshot(seq=2))
        await pilot.press("r")
        assert feed.resets == 1
        assert feed.spark("#tok-s") == []
        assert "rolling statistics reset requested" in feed.text("#events").splitlines()[0]
        await feed.play(pilot, sample_snapshot(seq=3, tok_s=5.0))
        assert feed.spark("#tok-s") == [5.0]

    drive(scenario)


def test_quit_binding_exits() -> None:
    """``q`` ends the app."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, sample_snapshot())
        await pilot.press("q")
        assert not feed.app.is_running

    feed = drive(scenario)
    assert feed.app.return_code == 0


def test_dropped_feed_shows_reconnecting_then_live() -> None:
    """A lost feed turns the link line to "reconnecting" with the reason and greys out the
    last snapshot; the next snapshot brings it back to live and the log says so."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, FeedDialing(ADDRESS, 1), sample_snapshot())
        await feed.play(pilot, FeedLost("connection closed (1006)"), FeedDialing(ADDRESS, 2))
        link = feed.text("#link")
        assert link == f"⟳ reconnecting to {ADDRESS} (attempt 2): connection closed (1006)"
        assert feed.app.query_one("#link").has_class("reconnecting")
        assert feed.app.query_one("#body").has_class("stale")
        assert "tok/s 41.5" in feed.text("#summary")  # the last values stay, greyed
        assert "feed lost: connection closed (1006)" in feed.text("#events").splitlines()[0]
        await feed.play(pilot, sample_snapshot(seq=5, started=T0 + 400))
        assert feed.text("#link").startswith("● live")
        assert not feed.app.query_one("#body").has_class("stale")
        assert "coordinator coord restarted" in feed.text("#events")

    drive(scenario)


def test_a_ring_that_lost_a_block_shows_down_not_live() -> None:
    """The feed is live but the ring lost a block: the link line says "ring down" and what
    it waits for (not "● live"); a repair says "repairing"; a whole ring is live again."""
    waits = "layers [2, 4) lost with s1; waiting for a node that can hold them"

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, attrs.evolve(sample_snapshot(), ring_down=waits))
        link = feed.text("#link")
        assert link.startswith("✖ ring down  swarm local · coord") and link.endswith(waits)
        assert feed.app.query_one("#link").has_class("ring-down")
        await feed.play(pilot, attrs.evolve(sample_snapshot(seq=2), repairing="late joined"))
        assert feed.text("#link").startswith("◐ repairing  swarm local")
        await feed.play(pilot, sample_snapshot(seq=3))
        assert feed.text("#link").startswith("● live")
        assert not feed.app.query_one("#link").has_class("ring-down")

    drive(scenario)


def test_connecting_before_the_first_snapshot() -> None:
    """Before any snapshot the app says it is connecting and waits, with nothing invented."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, FeedDialing(ADDRESS, 3), FeedLost("connection refused"))
        assert feed.text("#link") == f"◌ connecting to {ADDRESS} (attempt 3): connection refused"
        assert feed.text("#ring") == "waiting for the first snapshot…"
        assert feed.rows() == []
        assert feed.text("#tok-s-label") == "tok/s –"
        assert not feed.app.query_one("#tok-s", Sparkline).visible  # no floor that reads as 0

    drive(scenario)


def test_fits_80_by_24() -> None:
    """At 80×24 every part is on screen and the event log keeps a few lines."""

    async def scenario(feed: FakeFeed, pilot: Pilot[None]) -> None:
        await feed.play(pilot, sample_snapshot())
        screen = feed.app.screen.region
        for selector in ("#link", "#ring", "#summary", "#sparks", "#stages", "#events"):
            region = feed.app.query_one(selector).region
            assert screen.contains_region(region), selector
        assert feed.app.query_one("#stages", DataTable).region.height == 4  # header + 3 stages
        assert feed.app.query_one("#events").region.height >= 4

    drive(scenario)
