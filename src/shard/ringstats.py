"""Lap accounting for one request: time to first token, lap times, per-node compute and
per-edge transit, folded into a ``RunStats``.

Durations use ``trio.current_time()`` (so virtual-time tests see virtual laps); per-edge
transit uses the wall-clock stamps each stage writes into its ``Hop``, which is only
meaningful when the nodes share a clock (one host, or NTP-synced hosts).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence

import trio

from shard.messages import EdgeStat, Hop, NodeName, NodeStat, RunStats


class LapRecorder:
    """Collects one request's laps. Call ``sent()`` when a chunk leaves, ``received()`` when
    its verdict arrives (plain decoding keeps one lap outstanding at a time)."""

    def __init__(self, node: NodeName, wall_clock: Callable[[], float]) -> None:
        self._node = node
        self._wall = wall_clock
        self._began = trio.current_time()
        self._sent_at = self._began
        self._sent_wall = wall_clock()
        self._laps: list[float] = []
        self._compute: dict[NodeName, float] = defaultdict(float)
        self._chunks: dict[NodeName, int] = defaultdict(int)
        self._edges: dict[tuple[NodeName, NodeName], list[float]] = defaultdict(list)

    @property
    def count(self) -> int:
        return len(self._laps)

    def sent(self) -> None:
        self._sent_at = trio.current_time()
        self._sent_wall = self._wall()

    def received(self, hops: Sequence[Hop]) -> None:
        self._laps.append(trio.current_time() - self._sent_at)
        arrived = self._wall()
        prev_node, prev_sent = self._node, self._sent_wall
        for hop in hops:
            self._compute[hop.node] += hop.compute_s
            self._chunks[hop.node] += 1
            self._edges[(prev_node, hop.node)].append(hop.received_at - prev_sent)
            prev_node, prev_sent = hop.node, hop.sent_at
        if hops:
            self._edges[(prev_node, self._node)].append(arrived - prev_sent)

    def stats(self, tokens: int) -> RunStats:
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
                NodeStat(node=n, compute_s=self._compute[n], chunks=self._chunks[n])
                for n in self._compute
            ),
            edges=tuple(
                EdgeStat(src=src, dst=dst, mean_s=statistics.fmean(values))
                for (src, dst), values in self._edges.items()
            ),
        )
