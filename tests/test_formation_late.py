"""A formed ring that lost a stage with no standby repairs itself when a node joins late
(issue 40, part 5): the same ``--join`` node restarted (it registers idle, as a standby) is
activated back into its slot — not sent a ``Rewire`` it cannot obey ("nothing to rewire") —
and a new joiner takes the slot through the sticky re-plan.

In process, virtual time, memory network, with the stub joiners of ``tests/test_formation.py``
(real ``ControlClient``s whose orders are recorded).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shard.failover.events import Resume, RingControl, RingLost
from shard.messages import Activate, Rewire
from shard.transport import MemoryNetwork
from test_formation import GOOD, MESH, Joiner, scheduler, serving

#: how long after the death the node that repairs the ring joins (virtual seconds)
LATE_S = 120.0


def _drain(told: trio.MemoryReceiveChannel[RingControl]) -> list[RingControl]:
    out = []
    while True:
        try:
            out.append(told.receive_nowait())
        except trio.WouldBlock:
            return out


@pytest.mark.parametrize(("who", "how"), [("same", "rejoin"), ("new", "cold")])
async def test_a_formed_ring_that_lost_its_tail_repairs_when_a_node_joins_later(
    autojump_clock: trio.testing.MockClock, who: str, how: str
) -> None:
    """b and c form the ring with no standby; the tail dies; after join_deadline_s the ring
    is lost and waits, saying for what; 120 s later the tail's own node restarts (``same``:
    activated into its slot) or a new node ``a`` joins (``new``: re-planned into it); the
    predecessor is rewired to it with replay and the ring resumes (a ``late`` recovery)."""
    sched, told = scheduler(expect=2)
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        scopes: dict[str, trio.CancelScope] = {}
        joiners = {n: Joiner(n, GOOD, MESH[n]) for n in ("b", "c")}
        for name, joiner in joiners.items():
            scopes[name] = trio.CancelScope()

            async def run(
                joiner: Joiner = joiner,
                scope: trio.CancelScope = scopes[name],
                *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await joiner.client(network, []).run(task_status=task_status)

            await nursery.start(run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        head, tail = (s.node for s in plan.stages)
        _drain(told)

        scopes[tail].cancel()  # the tail's process dies: its control link closes
        await trio.sleep(LATE_S)
        said = _drain(told)
        lost = [m for m in said if isinstance(m, RingLost)]
        assert lost and "waiting for a node that can hold them" in lost[0].detail, said
        assert [r.kind for r in sched.statistics().recoveries] == ["failed"]
        (waiting,) = sched.statistics().waiting
        assert waiting.startswith(f"layers [{plan.stages[1].first}, 6) lost with {tail}")

        comer = Joiner(tail if who == "same" else "a", GOOD, MESH[tail if who == "same" else "a"])
        await nursery.start(comer.client(network, []).run)
        with trio.fail_after(60):
            while not any(isinstance(m, Resume) for m in said):
                said.append(await told.receive())
        recoveries = sched.statistics().recoveries
        assert [(r.kind, r.lost, r.replacement) for r in recoveries] == [
            ("failed", tail, None),
            ("late", tail, comer.name),
        ], recoveries
        assert recoveries[1].detail.startswith(f"{how}: ")
        assert sched.statistics().waiting == ()
        (activate,) = comer.orders  # activated into the slot, never a bare Rewire
        assert isinstance(activate, Activate) and (activate.first, activate.last) == (
            plan.stages[1].first,
            6,
        )
        rewire = joiners[head].orders[-1]
        assert isinstance(rewire, Rewire) and rewire.replay
        assert sched.ring()[1:] == (head, comer.name)
        nursery.cancel_scope.cancel()
