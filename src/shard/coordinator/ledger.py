"""Ledger: what the coordinator's requests record and share — counters, the rolling view of
the ring, recent ring events, and the K/D model that each new request starts from.

Direct calls, not messages, on purpose: every method is synchronous, local and never blocks
(a counter, a sample, a snapshot). Posted on a channel to the router instead, a driver's
record could wait behind the router while the router waits to hand that driver a verdict,
and a snapshot read right after a request would not see that request yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import trio

from shard.coordinator.ringstats import LapRecorder, RingEvent, RingMonitor, RingStatistics
from shard.decode.control import RunLengths, SpeculationConfig, SpeculationController
from shard.decode.speculation import Outcome
from shard.messages import NodeName, Verdict

_EVENTS_KEPT = 64


@attrs.frozen
class CoordinatorStatistics:
    """The coordinator's counters plus the rolling view of the ring (``ring``).

    ``k`` is the current draft length (0: plain decoding) and ``depth`` the verify chunks kept
    in flight per session; ``events`` are the most recent ring events, oldest first.
    ``ring_down``: why the ring is down (lost; what it waits for), ``repairing``: what is
    being repaired, each None when not (the ``Coordinator`` fills them in).
    """

    node: NodeName
    sessions_open: int
    requests_done: int
    requests_failed: int
    tokens: int
    k: int
    depth: int
    stale_dropped: int
    ring: RingStatistics
    events: tuple[RingEvent, ...]
    ring_down: str | None = None
    repairing: str | None = None


class Ledger:
    """See the module docstring. ``wall_clock`` stamps events and laps."""

    def __init__(
        self, node: NodeName, speculation: SpeculationConfig, wall_clock: Callable[[], float]
    ) -> None:
        self.node = node
        self.wall_clock = wall_clock
        self.sessions = 0  # requests in flight: they share the ring's stages
        self._done = self._failed = self._tokens = self._stale = 0
        self._k, self._depth = 0, 1
        # K/D policy state shared by requests: timings and acceptance by run length
        self._control = SpeculationController(speculation, runs=RunLengths())
        self._monitor = RingMonitor(node)
        self._events: deque[RingEvent] = deque(maxlen=_EVENTS_KEPT)

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(
            node=self.node,
            sessions_open=self.sessions,
            requests_done=self._done,
            requests_failed=self._failed,
            tokens=self._tokens,
            k=self._k,
            depth=self._depth,
            stale_dropped=self._stale,
            ring=self._monitor.snapshot(trio.current_time()),
            events=tuple(self._events),
        )

    def reset(self) -> None:
        """Clear the rolling ring statistics (counters since start are kept)."""
        self._monitor.reset()

    def event(self, kind: str, detail: str) -> None:
        """Record a ring event (join, fault, splice, epoch bump) for the status feed."""
        self._events.append(RingEvent(at=self.wall_clock(), kind=kind, detail=detail))

    def control_for(self, speculation: SpeculationConfig) -> SpeculationController:
        """A K/D controller for a new request, starting from the last one's measurements."""
        self._control = self._control.carry(speculation)
        return self._control

    def request_done(self) -> None:
        self._done += 1

    def request_failed(self) -> None:
        self._failed += 1

    def stale(self) -> None:
        self._stale += 1

    def kd(self, k: int, depth: int) -> None:
        self._k, self._depth = k, depth

    def lap(
        self, laps: LapRecorder, verdict: Verdict, *, committed: int, outcome: Outcome | None = None
    ) -> None:
        lap_s, sent_wall = laps.received(verdict.seq, verdict.hops, outcome)
        self._monitor.lap(
            lap_s=lap_s,
            sent_wall=sent_wall,
            arrived_wall=self.wall_clock(),
            hops=verdict.hops,
            committed=committed,
            drafted=outcome.drafted if outcome else 0,
            accepted=outcome.accepted if outcome else 0,
        )

    def committed(self, tokens: int) -> None:
        self._tokens += tokens
        self._monitor.committed(trio.current_time(), tokens)


__all__ = ["CoordinatorStatistics", "Ledger"]
