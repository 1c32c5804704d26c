"""Lap accounting for one request: time to first token, lap times, per-node compute and
per-edge transit, folded into a ``RunStats``.

Durations use ``trio.current_time()`` (so virtual-time tests see virtual laps); per-edge
transit uses the wall-clock stamps each stage writes into its ``Hop``, which is only
meaningful when the nodes share a clock (one host, or NTP-synced hosts).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs
import trio

from shard.messages import EdgeStat, Hop, NodeName, NodeStat, RunStats

T = TypeVar("T")


class LapRecorder:
    """Collects one request's laps. ``sent(seq)`` when a chunk leaves, ``received(seq, ...)``
    when its verdict arrives (several chunks may be in flight), ``discard(seq)`` for a chunk
    whose verdict turned out stale. A branch (``shard.decode.speculation``) rides in the lap
    of the chunk after it: ``branch()`` counts one sent, ``branch(won=True)`` one whose
    verdict was folded in as the lap's, and ``computed(seq, hops)`` takes the compute of one
    that lost, with no lap."""

    def __init__(self, node: NodeName, wall_clock: Callable[[], float]) -> None:
        self._node = node
        self._wall = wall_clock
        self._began = trio.current_time()
        self._sent: dict[int, tuple[float, float]] = {}
        self._laps: list[float] = []
        self._compute: dict[NodeName, float] = defaultdict(float)
        self._chunks: dict[NodeName, int] = defaultdict(int)
        self._queued: dict[NodeName, float] = defaultdict(float)
        self._rows: dict[NodeName, int] = defaultdict(int)
        self._edges: dict[tuple[NodeName, NodeName], list[float]] = defaultdict(list)
        self._drafted = 0
        self._accepted = 0
        self._stale = 0
        self._branches = [0, 0]  # [sent, won]

    @property
    def count(self) -> int:
        return len(self._laps)

    @property
    def last_lap_s(self) -> float:
        return self._laps[-1] if self._laps else 0.0

    def sent(self, seq: int) -> None:
        self._sent[seq] = (trio.current_time(), self._wall())

    def branch(self, *, won: bool = False) -> None:
        self._branches[int(won)] += 1

    def computed(self, seq: int, hops: Sequence[Hop]) -> None:
        """A verdict that is no lap of its own (a branch that lost): its stages' compute."""
        self._sent.pop(seq, None)
        self._hops(hops)

    def discard(self, seq: int) -> None:
        self._sent.pop(seq, None)
        self._stale += 1

    def received(self, seq: int, hops: Sequence[Hop], outcome: Any = None) -> tuple[float, float]:
        """Record a verdict's lap; returns (lap seconds, wall time its chunk was sent)."""
        sent_at, sent_wall = self._sent.pop(seq, (trio.current_time(), self._wall()))
        lap_s = trio.current_time() - sent_at
        self._laps.append(lap_s)
        if outcome is not None:
            self._drafted += outcome.drafted
            self._accepted += outcome.accepted
        arrived = self._wall()
        self._hops(hops)
        prev_node, prev_sent = self._node, sent_wall
        for hop in hops:
            self._edges[(prev_node, hop.node)].append(hop.received_at - prev_sent)
            prev_node, prev_sent = hop.node, hop.sent_at
        if hops:
            self._edges[(prev_node, self._node)].append(arrived - prev_sent)
        return lap_s, sent_wall

    def _hops(self, hops: Sequence[Hop]) -> None:
        for hop in hops:
            self._compute[hop.node] += hop.compute_s
            self._chunks[hop.node] += 1
            self._queued[hop.node] += hop.queued_s
            self._rows[hop.node] += hop.batch_rows

    def stats(self, tokens: int, *, max_depth: int = 1) -> RunStats:
        seconds = trio.current_time() - self._began
        decode_laps = self._laps[1:]
        return RunStats(
            tokens=tokens,
            seconds=seconds,
            tok_s=tokens / seconds if seconds > 0 else 0.0,
            prefill_s=self._laps[0] if self._laps else 0.0,
            laps=len(self._laps),
            mean_lap_s=statistics.fmean(decode_laps) if decode_laps else 0.0,
            nodes=tuple(
                NodeStat(
                    node=n,
                    compute_s=self._compute[n],
                    chunks=self._chunks[n],
                    queued_s=self._queued[n],
                    batch_rows=self._rows[n] / self._chunks[n] if self._chunks[n] else 0.0,
                )
                for n in self._compute
            ),
            edges=tuple(
                EdgeStat(src=src, dst=dst, mean_s=statistics.fmean(values))
                for (src, dst), values in self._edges.items()
            ),
            drafted=self._drafted,
            accepted=self._accepted,
            tokens_per_lap=tokens / len(self._laps) if self._laps else 0.0,
            max_depth=max_depth,
            stale_dropped=self._stale,
            branches=self._branches[0],
            branches_won=self._branches[1],
        )


@attrs.frozen
class RingEvent:
    """Something that happened to the ring: ``kind`` is join, fault, splice, epoch, ..."""

    at: float
    kind: str
    detail: str


@attrs.frozen
class NodeRolling:
    """A stage's compute per chunk over the recent window (seconds), with the median wait
    of a chunk there before its forward, the median rows of those forwards and the forwards
    per second they show (None: fewer than two forwards seen, or stages that do not count)."""

    node: NodeName
    last_s: float
    median_s: float
    chunks: int
    queued_median_s: float = 0.0
    rows_median: float = 0.0
    forwards_per_s: float | None = None


@attrs.frozen
class EdgeRolling:
    """An edge's one-way transit over the recent window (seconds; wall-clock stamps)."""

    src: NodeName
    dst: NodeName
    last_s: float
    median_s: float


def forward_rate(seen: Iterable[tuple[float, int]]) -> float | None:
    """Forwards per second of one stage from ``(received_at, forward)`` of the chunks seen:
    forwards counted between the first and the last seen, over the stage's own clock between
    them (None with fewer than two forwards, or when they share one instant)."""
    first = last = None
    for stamp in seen:
        first = stamp if first is None or stamp[1] < first[1] else first
        last = stamp if last is None or stamp[1] > last[1] else last
    if first is None or last is None or last[1] == first[1] or last[0] <= first[0]:
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


@attrs.frozen
class RingStatistics:
    """Rolling view of the ring across every request (for the status feed and monitor).

    ``alpha`` is accepted / drafted over the window (None before any draft was verified);
    ``tok_s`` counts committed tokens over the last ``rate_window_s`` seconds.
    """

    laps: int
    lap_last_s: float
    lap_median_s: float
    tokens_per_lap: float
    drafted: int
    accepted: int
    alpha: float | None
    tok_s: float
    nodes: tuple[NodeRolling, ...]
    edges: tuple[EdgeRolling, ...]


class RingMonitor:
    """Folds every verdict of every request into rolling statistics (last ``window`` laps).

    Pure bookkeeping: the coordinator calls ``lap`` and ``committed``; ``snapshot`` reads.
    ``reset`` clears the rolling state (the monitor's "reset" binding).
    """

    def __init__(self, node: NodeName, *, window: int = 64, rate_window_s: float = 5.0) -> None:
        self._node = node
        self._window = window
        self._rate_window_s = rate_window_s
        self.reset()

    def reset(self) -> None:
        self._laps_total = 0
        self._laps: deque[float] = deque(maxlen=self._window)
        self._per_lap: deque[int] = deque(maxlen=self._window)
        self._drafts: deque[tuple[int, int]] = deque(maxlen=self._window)
        self._compute: dict[NodeName, deque[float]] = {}
        self._queue: dict[NodeName, deque[float]] = {}
        self._batch: dict[NodeName, deque[float]] = {}
        self._forwards: dict[NodeName, deque[tuple[float, int]]] = {}
        self._edges: dict[tuple[NodeName, NodeName], deque[float]] = {}
        self._commits: deque[tuple[float, int]] = deque()

    def lap(
        self,
        *,
        lap_s: float,
        sent_wall: float,
        arrived_wall: float,
        hops: Sequence[Hop],
        committed: int,
        drafted: int,
        accepted: int,
    ) -> None:
        self._laps_total += 1
        self._laps.append(lap_s)
        self._per_lap.append(committed)
        if drafted:
            self._drafts.append((drafted, accepted))
        prev_node, prev_sent = self._node, sent_wall
        for hop in hops:
            self._series(self._compute, hop.node).append(hop.compute_s)
            self._series(self._queue, hop.node).append(hop.queued_s)
            self._series(self._batch, hop.node).append(float(hop.batch_rows))
            if hop.forward:
                self._series(self._forwards, hop.node).append((hop.received_at, hop.forward))
            self._series(self._edges, (prev_node, hop.node)).append(hop.received_at - prev_sent)
            prev_node, prev_sent = hop.node, hop.sent_at
        if hops:
            self._series(self._edges, (prev_node, self._node)).append(arrived_wall - prev_sent)

    def committed(self, now: float, tokens: int) -> None:
        self._commits.append((now, tokens))

    def _series(self, table: dict[Any, deque[T]], key: Any) -> deque[T]:
        if key not in table:
            table[key] = deque(maxlen=self._window)
        return table[key]

    def snapshot(self, now: float) -> RingStatistics:
        while self._commits and self._commits[0][0] < now - self._rate_window_s:
            self._commits.popleft()
        drafted = sum(d for d, _ in self._drafts)
        accepted = sum(a for _, a in self._drafts)
        return RingStatistics(
            laps=self._laps_total,
            lap_last_s=self._laps[-1] if self._laps else 0.0,
            lap_median_s=statistics.median(self._laps) if self._laps else 0.0,
            tokens_per_lap=statistics.fmean(self._per_lap) if self._per_lap else 0.0,
            drafted=drafted,
            accepted=accepted,
            alpha=accepted / drafted if drafted else None,
            tok_s=sum(n for _, n in self._commits) / self._rate_window_s,
            nodes=tuple(
                NodeRolling(
                    n,
                    s[-1],
                    statistics.median(s),
                    len(s),
                    queued_median_s=statistics.median(self._queue[n]),
                    rows_median=statistics.median(self._batch[n]),
                    forwards_per_s=forward_rate(self._forwards.get(n, ())),
                )
                for n, s in self._compute.items()
            ),
            edges=tuple(
                EdgeRolling(a, b, s[-1], statistics.median(s)) for (a, b), s in self._edges.items()
            ),
        )
