"""The status feed: the coordinator's view of the ring, published to monitors as it changes.

``build_snapshot`` is the pure part: it turns the coordinator's ``statistics()`` into a wire
``StatusSnapshot`` laid out in ring order (every edge and stage is listed, with None where no
sample exists yet, so a monitor draws the whole ring from the first snapshot). ``StatusFeed``
is the actor: one task builds a snapshot every ``interval_s`` while a monitor is connected,
and each monitor connection sends the latest one. A slow monitor skips snapshots instead of
queueing them (the latest wins), so monitors never hold memory or slow the coordinator.

Monitors connect like every other peer (``Hello``/``Welcome``, role ``"monitor"``) and then
only read. The one thing they may send is ``StatusReset``: the operator asked to clear the
rolling statistics; the coordinator records it as a ``reset`` event that every monitor sees.

Light on purpose: no torch, and the coordinator is only a type here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import trio

from shard.messages import (
    AuditCounts,
    DeviceStatus,
    EdgeStatus,
    EventRecord,
    NodeName,
    StageStatus,
    StatusReset,
    StatusSnapshot,
)
from shard.transport import Connection, ConnectionClosed
from shard.transport.guard import send_within

if TYPE_CHECKING:
    from shard.coordinator.coordinator import CoordinatorStatistics
    from shard.coordinator.ringstats import RingStatistics

log = logging.getLogger(__name__)

#: How often a snapshot is built while monitors are connected: "a few times a second".
DEFAULT_INTERVAL_S = 0.25


class StatusSource(Protocol):
    """What the feed reads and may reset; the ``Coordinator`` is one."""

    def statistics(self) -> CoordinatorStatistics: ...

    def reset_statistics(self) -> None: ...

    def event(self, kind: str, detail: str) -> None: ...


_NO_AUDITS = AuditCounts()


def build_snapshot(
    stats: CoordinatorStatistics,
    *,
    swarm: str,
    ring: Sequence[NodeName],
    seq: int,
    at: float,
    started: float,
    standbys: Sequence[NodeName] = (),
    devices: Sequence[DeviceStatus] = (),
    audit: AuditCounts = _NO_AUDITS,
) -> StatusSnapshot:
    """A ``StatusSnapshot`` of ``stats`` with edges and stages in the order of ``ring``.

    ``ring`` runs from the coordinator to the last stage (open: the closing edge back to the
    coordinator is implied). Edges or nodes the statistics know but the ring does not (a
    spliced-in standby) are listed after the ring's own — except a node evicted after failed
    audits (``audit.evicted``) and its edges, once the ring no longer holds it: the rolling
    window still has its samples, but it is gone, not elsewhere.
    """
    rolling = stats.ring
    order = tuple(ring)
    gone = frozenset(audit.evicted) - frozenset(order)
    lapped = rolling.laps > 0
    return StatusSnapshot(
        swarm=swarm,
        coordinator=stats.node,
        seq=seq,
        at=at,
        started=started,
        ring=order,
        edges=_edges(rolling, order, gone),
        stages=_stages(rolling, order, stats.node, gone),
        laps=rolling.laps,
        lap_last_s=rolling.lap_last_s if lapped else None,
        lap_median_s=rolling.lap_median_s if lapped else None,
        tokens_per_lap=rolling.tokens_per_lap if lapped else None,
        drafted=rolling.drafted,
        accepted=rolling.accepted,
        alpha=rolling.alpha,
        k=stats.k,
        depth=stats.depth,
        tok_s=rolling.tok_s,
        tokens=stats.tokens,
        sessions=stats.sessions_open,
        requests_done=stats.requests_done,
        requests_failed=stats.requests_failed,
        standbys=tuple(standbys),
        events=tuple(EventRecord(e.at, e.kind, e.detail) for e in stats.events),
        devices=tuple(devices),
        audit=audit,
        ring_down=stats.ring_down,
        repairing=stats.repairing,
    )


def _edges(
    rolling: RingStatistics, order: tuple[NodeName, ...], gone: frozenset[NodeName]
) -> tuple[EdgeStatus, ...]:
    """The ring's edges in ring order (closing edge included), then any others measured but
    those of a node ``gone``."""
    hops = list(itertools.pairwise((*order, order[0]))) if order else []
    by_edge = {(e.src, e.dst): e for e in rolling.edges}
    hops += [key for key in by_edge if key not in hops and not gone.intersection(key)]
    edges = []
    for src, dst in hops:
        seen = by_edge.get((src, dst))
        if seen is None:
            edges.append(EdgeStatus(src, dst))
        else:
            edges.append(EdgeStatus(src, dst, last_s=seen.last_s, median_s=seen.median_s))
    return tuple(edges)


def _stages(
    rolling: RingStatistics,
    order: tuple[NodeName, ...],
    coordinator: NodeName,
    gone: frozenset[NodeName],
) -> tuple[StageStatus, ...]:
    """The ring's stages in ring order, then any other node measured (a spliced standby)
    but one ``gone``."""
    by_node = {n.node: n for n in rolling.nodes}
    names = [n for n in order if n != coordinator]
    names += [n for n in by_node if n not in names and n not in gone]
    stages = []
    for name in names:
        node = by_node.get(name)
        if node is None:
            stages.append(StageStatus(name))
        else:
            stages.append(
                StageStatus(
                    name,
                    node.last_s,
                    node.median_s,
                    chunks=node.chunks,
                    # batch_rows 0: stages that do not report batching (older hops)
                    queued_median_s=node.queued_median_s if node.rows_median else None,
                    batch_rows_median=node.rows_median or None,
                    forwards_per_s=node.forwards_per_s,
                )
            )
    return tuple(stages)


@attrs.frozen
class StatusFeedStatistics:
    """Monitors connected now, snapshots built and frames sent since start."""

    monitors: int
    snapshots: int
    sent: int


@attrs.frozen
class StatusReads:
    """What a status feed reads for each snapshot, built by the coordinator's root: the
    router's statistics (``source``), the ring from the coordinator to the tail (or a
    function giving it: the ring changes when a standby is spliced in), the standbys waiting,
    GPU telemetry (``shard.observe.devices.DeviceProbe.read``) and the spot-check counters
    (the scheduler's strike book)."""

    source: StatusSource
    ring: Sequence[NodeName] | Callable[[], Sequence[NodeName]]
    standbys: Callable[[], Sequence[NodeName]] = tuple
    devices: Callable[[], Sequence[DeviceStatus]] = tuple
    audits: Callable[[], AuditCounts] = AuditCounts


class StatusFeed:
    """Publishes ``StatusSnapshot`` to every monitor connection handed to ``serve``.

    ``run`` builds a snapshot every ``interval_s`` while at least one monitor is connected
    (nothing at all while none is); ``serve(conn)`` sends each monitor the newest snapshot
    whenever there is one it has not seen yet, and handles its ``StatusReset``.

    Cancellation: cancelling ``run`` stops building snapshots (monitors keep the last one);
    cancelling ``serve`` ends that monitor's connection (its caller closes it).

    Errors: a monitor that goes away, sends a malformed frame or breaks its connection ends
    only its own ``serve`` (logged); anything else is a bug and propagates.
    """

    def __init__(
        self,
        reads: StatusReads,
        *,
        swarm: str,
        interval_s: float = DEFAULT_INTERVAL_S,
        wall_clock: Callable[[], float] = time.time,
        send_timeout_s: float = 30.0,
    ) -> None:
        """A monitor that does not take a snapshot within ``send_timeout_s`` is cut (it
        stopped reading: ``limits.message_timeout_s``)."""
        self._source = reads.source
        self._swarm = swarm
        ring = reads.ring
        fixed = () if callable(ring) else tuple(ring)
        self._ring: Callable[[], Sequence[NodeName]] = ring if callable(ring) else lambda: fixed
        self._standbys = reads.standbys
        self._devices = reads.devices
        self._audits = reads.audits
        self._interval_s = interval_s
        self._send_timeout_s = send_timeout_s
        self._wall_clock = wall_clock
        self._started = wall_clock()
        self._seq = 0
        self._sent = 0
        self._monitors = 0
        self._latest: StatusSnapshot | None = None
        self._changed = trio.Event()
        self._wanted = trio.Event()

    def statistics(self) -> StatusFeedStatistics:
        return StatusFeedStatistics(monitors=self._monitors, snapshots=self._seq, sent=self._sent)

    def snapshot(self) -> StatusSnapshot:
        """Build the next snapshot from the source's statistics, now."""
        self._seq += 1
        return build_snapshot(
            self._source.statistics(),
            swarm=self._swarm,
            ring=self._ring(),
            seq=self._seq,
            at=self._wall_clock(),
            started=self._started,
            standbys=self._standbys(),
            devices=self._devices(),
            audit=self._audits(),
        )

    def _publish(self) -> None:
        self._latest = self.snapshot()
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if self._monitors == 0:
                await self._wanted.wait()
            self._publish()
            await trio.sleep(self._interval_s)

    async def serve(self, conn: Connection) -> None:
        """Feed one monitor until it goes away (after its handshake, done by the caller).

        Errors: what ends this monitor's connection — a malformed frame (``WireError``), a
        monitor too slow to read (``PeerTooSlow``) — propagates, for the caller's
        ``shard.transport.guard.serve_one``; an ordinary close returns."""
        self._monitors += 1
        self._wanted.set()
        try:
            self._publish()  # a new monitor sees the ring at once, not after a tick
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_requests, conn, nursery.cancel_scope)
                await self._send_snapshots(conn)
                nursery.cancel_scope.cancel()
        finally:
            self._monitors -= 1
            if self._monitors == 0:
                self._wanted = trio.Event()

    async def _send_snapshots(self, conn: Connection) -> None:
        sent = 0
        while True:
            changed = self._changed
            latest = self._latest
            if latest is None or latest.seq == sent:
                await changed.wait()
                continue
            try:
                await send_within(conn, latest, self._send_timeout_s, what="monitor")
            except ConnectionClosed as exc:
                log.info("monitor %s went away: %s", conn.peer, exc)
                return
            sent = latest.seq
            self._sent += 1

    async def _read_requests(self, conn: Connection, done: trio.CancelScope) -> None:
        try:
            while True:
                msg = await conn.receive()
                if isinstance(msg, StatusReset):
                    self._source.reset_statistics()
                    self._source.event(
                        "reset", f"rolling statistics reset by {msg.node} ({conn.peer})"
                    )
                    self._publish()
                else:
                    log.warning("monitor %s sent %s; ignored", conn.peer, type(msg).__name__)
        except ConnectionClosed as exc:
            log.info("monitor %s: %s", conn.peer, exc)
        done.cancel()
