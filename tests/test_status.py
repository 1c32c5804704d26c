"""The status feed: snapshots built from statistics in ring order, served to monitors (memory
network with the wire codec, and WebSockets), the coordinator's "monitor" role, and the Trio
feed client's reconnects.

Charter: 127.0.0.1 and port 0 (or memory names) only; every I/O test under a
``trio.fail_after`` deadline; no sleeps to wait for state.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing

from shard.coordinator.coordinator import CoordinatorStatistics
from shard.coordinator.ringstats import EdgeRolling, NodeRolling, RingEvent, RingStatistics
from shard.messages import (
    AuditCounts,
    EdgeStatus,
    Hello,
    NodeName,
    StageStatus,
    StatusReset,
    StatusSnapshot,
)
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.observe.status import StatusFeed, StatusReads, build_snapshot
from shard.observe.tui.feed import FeedWatcher
from shard.observe.tui.state import FeedDialing, FeedEvent, FeedLost
from shard.spec.swarm import SwarmSpec
from shard.transport import Connection, MemoryNetwork, Network, WebSocketNetwork
from shard.transport.links import dial_peer

DEADLINE_S = 30.0
RING = tuple(NodeName(n) for n in ("coord", "s0", "s1"))


def ring_stats(*, laps: int = 3, tok_s: float = 12.5) -> RingStatistics:
    """Rolling statistics with one stage (s0) and two edges seen, s1 not yet."""
    return RingStatistics(
        laps=laps,
        lap_last_s=0.02,
        lap_median_s=0.018,
        tokens_per_lap=1.0,
        drafted=8,
        accepted=6,
        alpha=0.75,
        tok_s=tok_s,
        nodes=(NodeRolling(NodeName("s0"), 0.004, 0.0035, 3),),
        edges=(
            EdgeRolling(NodeName("coord"), NodeName("s0"), 0.001, 0.0012),
            EdgeRolling(NodeName("s1"), NodeName("coord"), 0.002, 0.0021),
        ),
    )


def coordinator_stats(ring: RingStatistics, events: tuple[RingEvent, ...] = ()) -> Any:
    return CoordinatorStatistics(
        node=NodeName("coord"),
        sessions_open=1,
        requests_done=2,
        requests_failed=0,
        tokens=40,
        k=4,
        depth=2,
        stale_dropped=0,
        ring=ring,
        events=events,
    )


class FakeSource:
    """A coordinator stand-in: fixed statistics, counts resets, records events."""

    def __init__(self) -> None:
        self.resets = 0
        self.events: list[RingEvent] = []

    def statistics(self) -> Any:
        return coordinator_stats(ring_stats(laps=0 if self.resets else 3), tuple(self.events))

    def reset_statistics(self) -> None:
        self.resets += 1

    def event(self, kind: str, detail: str) -> None:
        self.events.append(RingEvent(at=100.0 + len(self.events), kind=kind, detail=detail))


def test_build_snapshot_follows_ring_order() -> None:
    """Every ring edge and stage is listed in ring order; unseen ones carry None, not 0."""
    snap = build_snapshot(
        coordinator_stats(ring_stats()), swarm="t", ring=RING, seq=7, at=5.0, started=1.0
    )
    assert snap.ring == RING
    assert snap.edges == (
        EdgeStatus(NodeName("coord"), NodeName("s0"), 0.001, 0.0012),
        EdgeStatus(NodeName("s0"), NodeName("s1"), None, None),
        EdgeStatus(NodeName("s1"), NodeName("coord"), 0.002, 0.0021),
    )
    assert snap.stages == (
        StageStatus(NodeName("s0"), 0.004, 0.0035, chunks=3, queue=None),
        StageStatus(NodeName("s1")),
    )
    assert (snap.seq, snap.at, snap.started, snap.k, snap.depth) == (7, 5.0, 1.0, 4, 2)
    assert (snap.alpha, snap.tok_s, snap.tokens, snap.sessions) == (0.75, 12.5, 40, 1)
    assert snap.standbys == ()


def test_build_snapshot_without_laps_has_no_lap_times() -> None:
    """Before the first lap the lap times and tokens per lap are unknown (None)."""
    snap = build_snapshot(
        coordinator_stats(ring_stats(laps=0)), swarm="t", ring=RING, seq=1, at=0.0, started=0.0
    )
    assert (snap.lap_last_s, snap.lap_median_s, snap.tokens_per_lap) == (None, None, None)


def test_build_snapshot_lists_unknown_nodes_after_the_ring() -> None:
    """An edge or node the statistics know but the ring does not is appended, not dropped."""
    ring = RING[:2]  # the ring no longer has s1 (spliced out), but stats still do
    stats = attrs_evolve_nodes(ring_stats(), NodeRolling(NodeName("s1"), 0.1, 0.1, 1))
    snap = build_snapshot(coordinator_stats(stats), swarm="t", ring=ring, seq=1, at=0, started=0)
    assert [(e.src, e.dst) for e in snap.edges] == [
        ("coord", "s0"),
        ("s0", "coord"),
        ("s1", "coord"),
    ]
    assert [s.node for s in snap.stages] == ["s0", "s1"]


def attrs_evolve_nodes(ring: RingStatistics, extra: NodeRolling) -> RingStatistics:
    import attrs

    return attrs.evolve(ring, nodes=(*ring.nodes, extra))


@asynccontextmanager
async def feed_served(
    network: Network, source: FakeSource, address: str, *, started: float = 1.0
) -> AsyncIterator[tuple[str, StatusFeed, trio.CancelScope]]:
    """A ``StatusFeed`` of ``source`` served at ``address`` (handshake as the coordinator's)."""
    from shard.messages import Welcome
    from shard.transport.links import accept_peer

    feed = StatusFeed(
        StatusReads(source, RING), swarm="t", interval_s=0.01, wall_clock=lambda: started
    )

    async def handler(conn: Connection) -> None:
        await accept_peer(conn, Welcome(node=NodeName("coord"), role="coordinator", swarm="t"))
        await feed.serve(conn)

    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        bound = await nursery.start(network.serve, address, handler)
        yield bound, feed, nursery.cancel_scope
        nursery.cancel_scope.cancel()


async def test_feed_serves_snapshots_and_reset() -> None:
    """A monitor gets snapshots through the wire codec; its StatusReset resets the source,
    is logged as a reset event and is answered with a fresh snapshot."""
    source = FakeSource()
    network = MemoryNetwork(encode_frames=True)
    hello = Hello(node=NodeName("monitor"), role="monitor", swarm="t")
    with trio.fail_after(DEADLINE_S):
        async with feed_served(network, source, "coord") as (address, feed, _):
            conn = await dial_peer(network, address, hello, timeout_s=5)
            first = await conn.receive()
            assert isinstance(first, StatusSnapshot)
            assert first.laps == 3
            assert first.ring == RING
            await conn.send(StatusReset(node=NodeName("monitor")))
            while True:
                snap = await conn.receive()
                assert isinstance(snap, StatusSnapshot)
                assert snap.seq > first.seq
                if snap.laps == 0:
                    break
            assert source.resets == 1
            assert [e.kind for e in snap.events] == ["reset"]
            assert "rolling statistics reset by monitor" in snap.events[0].detail
            assert feed.statistics().monitors == 1
            await conn.aclose()


async def test_feed_builds_nothing_without_monitors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With no monitor connected the feed builds no snapshot, however long it runs (virtual
    time: pytest-trio's ``autojump_clock``)."""
    source = FakeSource()
    feed = StatusFeed(StatusReads(source, RING), swarm="t", interval_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        await trio.sleep(60)
        assert feed.statistics().snapshots == 0
        nursery.cancel_scope.cancel()


def tiny_spec(model_dir: Path) -> SwarmSpec:
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 128, "prefill_chunk": 4, "max_sessions": 4},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
        "stage": [
            {"name": "s0", "listen": "127.0.0.1:9001", "layers": [0, 1]},
            {"name": "s1", "listen": "127.0.0.1:9002", "layers": [1, 2]},
        ],
    }
    return SwarmSpec.from_dict(data, source="test.toml")


async def test_coordinator_serves_monitors(tiny_checkpoint: Any) -> None:
    """The coordinator's listen address feeds a "monitor" peer: ring order, a join event, and
    after a request, laps, tok/s and per-stage compute from the real ring."""
    model_dir = tiny_checkpoint(seed=3, n_layers=2)
    spec = tiny_spec(model_dir)
    network = MemoryNetwork(encode_frames=True)
    hello = Hello(node=NodeName("monitor"), role="monitor", swarm="test")
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(
                    spec, model_dir=model_dir, network=network, task_status=task_status
                )
            )
            conn = await dial_peer(network, handle.address, hello, timeout_s=5)
            first = await conn.receive()
            assert isinstance(first, StatusSnapshot)
            assert first.ring == ("coord", "s0", "s1")
            assert first.laps == 0
            assert first.lap_last_s is None
            assert "join" in [e.kind for e in first.events]
            await handle.coordinator.generate([5, 17, 99], max_tokens=8)
            while True:
                snap = await conn.receive()
                assert isinstance(snap, StatusSnapshot)
                if snap.laps > 0 and snap.tok_s > 0:
                    break
            assert [s.node for s in snap.stages] == ["s0", "s1"]
            assert all(s.chunks > 0 and s.compute_last_s is not None for s in snap.stages)
            assert all(s.queue is None for s in snap.stages)  # not reported: unknown, not 0
            assert [(e.src, e.dst) for e in snap.edges] == [
                ("coord", "s0"),
                ("s0", "s1"),
                ("s1", "coord"),
            ]
            assert snap.tokens > 0
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_watcher_reconnects_after_restart() -> None:
    """The Trio feed client reports snapshots, a lost feed, its redials, and the snapshots of
    the coordinator that came back on the same address (a new ``started``)."""
    # Unbounded only in the test: ``post`` is synchronous, like the app's ``show``.
    events_in, events = trio.open_memory_channel[FeedEvent](math.inf)
    source = FakeSource()

    async def next_snapshot() -> StatusSnapshot:
        async for event in events:
            if isinstance(event, StatusSnapshot):
                return event
        raise AssertionError("feed ended")

    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork(connect_timeout_s=2) as network, trio.open_nursery() as n:
            watcher = FeedWatcher(
                network, swarm="t", post=events_in.send_nowait, dial_timeout_s=1, retry_s=0.01
            )
            async with feed_served(network, source, "127.0.0.1:0", started=1.0) as (addr, _, _):
                n.start_soon(watcher.run, addr)
                assert (await next_snapshot()).started == 1.0
            seen: list[FeedEvent] = []
            async for event in events:
                seen.append(event)
                if isinstance(event, FeedDialing):
                    break
            assert any(isinstance(e, FeedLost) for e in seen)
            async with feed_served(network, source, addr, started=2.0):
                assert (await next_snapshot()).started == 2.0
            n.cancel_scope.cancel()


async def test_watcher_reset_reaches_the_coordinator() -> None:
    """``request_reset`` on the client sends one StatusReset over the live connection."""
    events_in, events = trio.open_memory_channel[FeedEvent](math.inf)
    source = FakeSource()
    network = MemoryNetwork(encode_frames=True)
    with trio.fail_after(DEADLINE_S):
        async with feed_served(network, source, "coord") as (addr, _, _), trio.open_nursery() as n:
            watcher = FeedWatcher(network, swarm="t", post=events_in.send_nowait)
            n.start_soon(watcher.run, addr)
            async for event in events:
                if isinstance(event, StatusSnapshot):
                    break
            watcher.request_reset()
            async for event in events:
                if isinstance(event, StatusSnapshot) and event.laps == 0:
                    break
            assert source.resets == 1
            n.cancel_scope.cancel()


async def test_watcher_reports_wrong_swarm() -> None:
    """A coordinator of another swarm refuses the handshake: reported as FeedLost, retried."""
    events_in, events = trio.open_memory_channel[FeedEvent](math.inf)
    network = MemoryNetwork()
    with trio.fail_after(DEADLINE_S):
        async with (
            feed_served(network, FakeSource(), "coord") as (addr, _, _),
            trio.open_nursery() as n,
        ):
            watcher = FeedWatcher(network, swarm="other", post=events_in.send_nowait)
            n.start_soon(watcher.run, addr)
            async for event in events:
                if isinstance(event, FeedLost):
                    break
            assert "swarm 'other' is not this swarm ('t')" in event.reason
            n.cancel_scope.cancel()


class _Scripted:
    """A monitor's connection: it sends ``script`` (an exception: its malformed frame), then
    nothing; with ``reading=False`` it never takes a snapshot."""

    def __init__(self, script: list[Any], *, reading: bool = True) -> None:
        self._script = list(script)
        self.reading = reading
        self.closed = False
        self.sent = 0

    @property
    def peer(self) -> str:
        return "10.0.0.9:4242"

    async def send(self, msg: Any) -> None:
        if not self.reading:
            await trio.sleep_forever()
        self.sent += 1

    async def receive(self) -> Any:
        if not self._script:
            await trio.sleep_forever()
        item = self._script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


async def test_monitor_link_failures_end_only_that_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A monitor's malformed frame ends its link (the error reaches the link's guard, not
    the node); a monitor that stops reading is cut after the feed's send deadline."""
    from shard.transport.guard import serve_one
    from shard.wire import WireError

    feed = StatusFeed(
        StatusReads(FakeSource(), RING), swarm="t", interval_s=0.25, send_timeout_s=4.0
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        hostile = _Scripted([StatusReset(NodeName("m")), WireError("header: unknown tag")])
        await serve_one(hostile, feed.serve, what="monitor link")
        assert hostile.closed and hostile.sent >= 1
        stuck = _Scripted([], reading=False)
        began = trio.current_time()
        await serve_one(stuck, feed.serve, what="monitor link")
        assert stuck.closed
        assert trio.current_time() - began == 4.0
        assert feed.statistics().monitors == 0
        nursery.cancel_scope.cancel()


def test_build_snapshot_carries_the_audit_counters() -> None:
    """Audits, strikes and evictions go into the snapshot as given (zero by default)."""
    stats = coordinator_stats(ring_stats())
    plain = build_snapshot(stats, swarm="t", ring=RING, seq=1, at=0, started=0)
    assert plain.audit == AuditCounts()
    counts = AuditCounts(audits=9, strikes=2, evictions=1)
    snap = build_snapshot(stats, swarm="t", ring=RING, seq=1, at=0, started=0, audit=counts)
    assert snap.audit == counts
