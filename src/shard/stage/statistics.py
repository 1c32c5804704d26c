"""The stage executor's counters (``StageExecutor.statistics()``): what the status feed and
the benchmarks read of one stage."""

from __future__ import annotations

import attrs

from shard.messages import NodeName, SessionId

__all__ = ["StageStatistics"]


@attrs.frozen
class StageStatistics:
    """Counters of one executor, for the status feed and benchmarks."""

    node: NodeName
    first: int
    last: int
    sessions: int
    chunks: int
    positions: int
    compute_s: float
    faults: int
    stale_skipped: int
    kv_bytes: int  # KV cache memory held by the open sessions
    forwards: int = 0  # forward passes run (a batch of chunks is one)
    max_batch_rows: int = 0  # the most rows one forward has run
    forwards_per_s: float = 0.0  # forwards over the wall time since the executor started
    queued_s: float = 0.0  # chunks' total wait between arriving here and their forward
    session_queued_s: tuple[tuple[SessionId, float], ...] = ()  # mean wait per open session

    @property
    def rows_per_forward(self) -> float:
        """Mean rows (positions) per forward pass."""
        return self.positions / self.forwards if self.forwards else 0.0
