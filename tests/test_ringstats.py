"""The coordinator's rolling per-stage statistics from the hops of each verdict (what the
status feed and the monitor show of batching): rows per forward, the wait before it and the
stage's forwards per second, counted from the forward number each hop carries."""

from __future__ import annotations

import pytest

from shard.coordinator.ringstats import RingMonitor, forward_rate
from shard.messages import Hop, NodeName

S0 = NodeName("s0")


def hop(at: float, forward: int, *, rows: int = 4, queued: float = 0.002) -> Hop:
    return Hop(S0, 0.01, at, at + 0.01, queued_s=queued, batch_rows=rows, forward=forward)


def lap(monitor: RingMonitor, *hops: Hop) -> None:
    monitor.lap(
        lap_s=0.1, sent_wall=0.0, arrived_wall=10.0, hops=hops, committed=1, drafted=0, accepted=0
    )


def test_forward_rate_counts_forwards_between_the_first_and_last_seen() -> None:
    # forwards 10..30 over 2 s of the stage's clock; chunks of one batch share a number
    seen = [(100.0, 10), (100.0, 10), (101.0, 20), (102.0, 30), (102.0, 30)]
    assert forward_rate(seen) == pytest.approx(10.0)
    assert forward_rate(reversed(seen)) == pytest.approx(10.0)  # order of arrival is irrelevant
    assert forward_rate([]) is None
    assert forward_rate([(100.0, 10), (100.0, 10)]) is None  # one forward: no rate
    assert forward_rate([(100.0, 10), (100.0, 11)]) is None  # no time between them


def test_rolling_node_statistics_carry_rows_wait_and_forward_rate() -> None:
    monitor = RingMonitor(NodeName("coord"))
    for i in range(5):  # two sessions' chunks rode each forward, one forward every 50 ms
        lap(monitor, hop(1.0 + 0.05 * i, 7 + i, rows=8, queued=0.001 * i))
        lap(monitor, hop(1.0 + 0.05 * i, 7 + i, rows=8, queued=0.001 * i))
    (node,) = monitor.snapshot(now=10.0).nodes
    assert node.rows_median == 8.0
    assert node.queued_median_s == pytest.approx(0.002)
    assert node.forwards_per_s == pytest.approx(20.0)


def test_stages_that_do_not_number_forwards_have_no_rate() -> None:
    monitor = RingMonitor(NodeName("coord"))
    for i in range(3):
        lap(monitor, hop(1.0 + i, 0))  # forward 0: not reported (an older stage)
    (node,) = monitor.snapshot(now=10.0).nodes
    assert node.forwards_per_s is None
