"""A ring that lost its only holder of a block is down, not dead: it repairs itself whenever a
node that can hold the block registers, however late (issue 40, part 5).

In process and in virtual time, with the harness of ``tests/test_failover.py``: a stage (s1;
s0 and s2 for the coordinator's own link and the tail's return link) is killed mid-decode
with no standby; after ``join_deadline_s`` the requests in flight fail with their committed
tokens (a prefix of the reference), and the ring says what it waits for. Two minutes later a
node that can hold the lost layers comes — a standby of that block (hot), a spare that loads
it (cold), or the lost stage itself restarted — and is spliced in; the next requests equal
the single-process reference, and a replaced node that comes back is still refused.
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
from shard.messages import Fault, Hello, NodeName, Register
from shard.nodes.coordinator import run_standby
from shard.nodes.stage import run_stage
from shard.testing.faults import FaultInjector, FaultPlan
from shard.transport import MemoryNetwork, Network
from shard.transport.links import dial_peer
from test_failover import DECODE, MAX_TOKENS, PROMPTS, failover_spec, start_swarm
from test_failover import model_dir as model_dir
from test_failover import references as references

#: how long after the kill the node that repairs the ring is started (virtual seconds)
LATE_S = 120.0


def waiting(victim: str) -> str:
    i = int(victim[1:])
    return (
        f"layers [{2 * i}, {2 * i + 2}) lost with {victim}; waiting for a node that can hold them"
    )


async def _come_back(who: str, model_dir: Path, network: Network, nursery: trio.Nursery) -> None:
    """Start the node that can hold the lost block: ``late`` (a standby of s1's), ``spare``
    (no block: the cold path) or the lost stage itself, restarted with its spec."""
    if who in ("s0", "s1", "s2"):
        spec = failover_spec(model_dir, standbys=False)
        await nursery.start(partial(run_stage, spec, who, network=network, model_dir=model_dir))
        return
    spec = failover_spec(model_dir, standbys=False, late=who == "late", spare=who == "spare")
    await nursery.start(partial(run_standby, spec, who, network=network, model_dir=model_dir))


async def _register(network: Network, victim: str) -> str:
    """Register ``victim`` again on a raw control link, as a restarted stage would; the
    scheduler's refusal."""
    i, node = int(victim[1:]), NodeName(victim)
    hello = Hello(node=node, role="stage", swarm="test", link="control")
    conn = await dial_peer(network, "127.0.0.1:9000", hello, timeout_s=5)
    await conn.send(Register(node, "stage", f"127.0.0.1:{9001 + i}", 2 * i, 2 * i + 2, slot=node))
    fault = await conn.receive()
    assert isinstance(fault, Fault), fault
    return fault.detail


@pytest.mark.parametrize(
    ("victim", "who", "how"),
    [
        ("s1", "late", "hot"),
        ("s1", "spare", "cold"),
        ("s1", "s1", "rejoin"),
        ("s0", "spare", "cold"),  # the coordinator's own ring link is rewired
        ("s2", "spare", "cold"),  # the tail: the return link comes from the spare
    ],
)
def test_a_ring_that_lost_a_block_repairs_when_a_node_joins_minutes_later(
    model_dir: Path, references: list[tuple[int, ...]], victim: str, who: str, how: str
) -> None:
    """A stage dies with no standby: the requests fail after join_deadline_s with a prefix of the
    reference, the ring reports what it waits for (readiness, monitor, statistics), a new
    request fails at once; a node that can hold the lost layers joins 120 s later and is
    spliced in (a ``late`` recovery), and the next requests equal the reference."""
    plan = FaultPlan.random(93, kind="kill", node=victim, frames=DECODE)
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
                assert reason is not None and waiting(victim) in reason, reason
                stats = coordinator.statistics()
                assert stats.ring_down is not None and waiting(victim) in stats.ring_down
                assert [w.startswith(waiting(victim)) for w in scheduler.statistics().waiting] == [
                    True
                ]
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
                    ("failed", victim, None),
                    ("late", victim, who),
                ], recoveries
                assert recoveries[1].detail.startswith(f"{how}: "), recoveries[1]
                assert recoveries[1].total_s >= LATE_S
                assert scheduler.ring()[1 + int(victim[1:])] == who
                if who != victim:  # replaced: the lost node coming back now is refused
                    assert await _register(network, victim) == f"{victim} was replaced by {who}"

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
