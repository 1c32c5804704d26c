"""A ring that lost its only holder of a block is down, not dead: it repairs itself whenever a
node that can hold the block registers, however late (issue 40, part 5).

In process and in virtual time, with the harness of ``tests/test_failover.py``: s1 is killed
mid-decode with no standby; after ``join_deadline_s`` the requests in flight fail with their
committed tokens (a prefix of the reference), and the ring says what it waits for. Two
minutes later a node that can hold s1's layers comes — a standby of that block (hot), a spare
that loads it (cold), or s1 itself restarted — and is spliced in; the next requests equal the
single-process reference.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from shard.compute.offload import inline_compute
from shard.coordinator.coordinator import Completion, RingError
from shard.coordinator.service import ring_unready
from shard.failover.faults import FaultInjector, FaultPlan
from shard.nodes.coordinator import run_standby
from shard.nodes.stage import run_stage
from shard.transport import MemoryNetwork, Network
from test_failover import DECODE, MAX_TOKENS, PROMPTS, failover_spec, start_swarm
from test_failover import model_dir as model_dir
from test_failover import references as references

#: how long after the kill the node that repairs the ring is started (virtual seconds)
LATE_S = 120.0
WAITING = "layers [2, 4) lost with s1; waiting for a node that can hold them"


async def _come_back(who: str, model_dir: Path, network: Network, nursery: trio.Nursery) -> None:
    """Start the node that can hold s1's block: ``late`` (a standby of it), ``spare`` (no
    block: the cold path) or ``s1`` itself, restarted with its spec."""
    if who == "s1":
        spec = failover_spec(model_dir, standbys=False)
        await nursery.start(partial(run_stage, spec, "s1", network=network, model_dir=model_dir))
        return
    spec = failover_spec(model_dir, standbys=False, late=who == "late", spare=who == "spare")
    await nursery.start(partial(run_standby, spec, who, network=network, model_dir=model_dir))


@pytest.mark.parametrize(("who", "how"), [("late", "hot"), ("spare", "cold"), ("s1", "rejoin")])
def test_a_ring_that_lost_a_block_repairs_when_a_node_joins_minutes_later(
    model_dir: Path, references: list[tuple[int, ...]], who: str, how: str
) -> None:
    """s1 dies with no standby: the requests fail after join_deadline_s with a prefix of the
    reference, the ring reports what it waits for (readiness, monitor, statistics), a new
    request fails at once; a node that can hold s1's layers joins 120 s later and is
    spliced in (a ``late`` recovery), and the next requests equal the reference."""
    plan = FaultPlan.random(93, kind="kill", node="s1", frames=DECODE)
    spec = failover_spec(model_dir, standbys=False, join_deadline_s=5.0)
    injector = FaultInjector(plan)
    failed: dict[int, Completion | RingError] = {}
    after: list[Completion] = []

    async def main() -> None:
        network = MemoryNetwork()
        with inline_compute(), trio.fail_after(900):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(
                    nursery, spec, model_dir, network=network, wrap=injector.wrap,
                    scopes=injector.scopes,
                )  # fmt: skip
                coordinator, scheduler = handle.coordinator, handle.scheduler
                assert scheduler is not None

                async def one(i: int) -> None:
                    try:
                        failed[i] = await coordinator.generate(PROMPTS[i], max_tokens=MAX_TOKENS)
                    except RingError as exc:
                        failed[i] = exc

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                assert injector.fired, f"{plan}: the fault never fired"

                # down, and saying what it waits for: readiness, the monitor, the scheduler
                reason = ring_unready(coordinator)
                assert reason is not None and WAITING in reason, reason
                stats = coordinator.statistics()
                assert stats.ring_down is not None and WAITING in stats.ring_down
                assert [w.startswith(WAITING) for w in scheduler.statistics().waiting] == [True]
                with pytest.raises(RingError, match="waiting for a node"):  # no client hangs
                    await coordinator.generate(PROMPTS[0], max_tokens=MAX_TOKENS)

                await trio.sleep(LATE_S)
                assert ring_unready(coordinator) is not None  # still waiting, two minutes on
                await _come_back(who, model_dir, network, nursery)
                with trio.fail_after(60):
                    await coordinator.wait_ring_up()
                assert ring_unready(coordinator) is None
                assert scheduler.statistics().waiting == ()
                stats = coordinator.statistics()
                assert stats.ring_down is None and stats.repairing is None

                recoveries = scheduler.statistics().recoveries
                assert [(r.kind, r.lost, r.replacement) for r in recoveries] == [
                    ("failed", "s1", None),
                    ("late", "s1", who),
                ], recoveries
                assert recoveries[1].detail.startswith(f"{how}: "), recoveries[1]
                assert recoveries[1].total_s >= LATE_S
                assert scheduler.ring()[2] == who

                async def again(i: int) -> None:
                    after.append(await coordinator.generate(PROMPTS[i], max_tokens=MAX_TOKENS))

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(again, i)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert any(isinstance(r, RingError) for r in failed.values()), f"{plan}: {failed}"
    for i, result in failed.items():
        if isinstance(result, RingError):
            assert "could not be repaired" in str(result), f"{plan}: {result}"
            committed = tuple(result.committed)
            assert committed == references[i][: len(committed)], f"{plan}: request {i}"
        else:  # finished before the kill
            assert result.token_ids == references[i], f"{plan}: request {i}"
    assert sorted(r.token_ids for r in after) == sorted(references), plan
