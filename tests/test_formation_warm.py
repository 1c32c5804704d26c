"""A coordinator that starts over a ring still running (a standby coordinator that took over a
formed swarm) adopts it: no ``Activate`` to a node that serves a slot (which it refuses:
``already serves a ring slot`` ended the coordinator in the soak of issue 40), the ring's slots
as the stages say, the tail told to re-dial its return link; standbys stay standbys. Stage
claims that make no whole ring are set aside after ``join_deadline_s``.

In process, virtual time, memory network; the nodes are real ``ControlClient``s whose orders
are recorded (``tests/test_formation.py``'s harness).
"""

from __future__ import annotations

import attrs
import trio
import trio.testing

from answered import AnsweredClient
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.messages import Activate, NodeName, Register, Rewire
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.transport import MemoryNetwork
from test_formation import COORD, GOOD, MESH, MODEL, SWARM, Joiner, serving


def _scheduler(expect: int) -> Scheduler:
    to_router, _ = trio.open_memory_channel(256)
    return Scheduler(
        SchedulerConfig(
            node=COORD,
            slots=[],
            return_address="coord:9",
            policy=FailoverSpec(probe_s=0.5, dead_after_s=10.0, join_deadline_s=30.0),
            formation=(FormationSpec(expect=expect, wait_s=600.0, probes=3), MODEL),
        ),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
    )


def _stage(joiner: Joiner, network: MemoryNetwork, serves: tuple[str, int, int] | None
           ) -> AnsweredClient:  # fmt: skip
    """``joiner``'s control client, registering as the stage of slot ``serves[0]`` holding
    ``[serves[1], serves[2])`` (None: as a standby)."""
    node = NodeName(joiner.name)
    client = joiner.client(network, [])

    def register() -> Register:
        if serves is None:
            return Register(node, "standby", f"{node}:7001", profile=joiner.profile)
        slot, first, last = serves
        return Register(node, "stage", f"{node}:7001", first, last, slot, profile=joiner.profile)

    assert (client.node, client.role, client.swarm) == (node, "stage", SWARM)
    return attrs.evolve(client, register=register)


async def test_a_running_ring_is_adopted_not_formed_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """c holds [0, 3) in slot "b" and b holds [3, 6) in slot "c" (slot names are the stages'
    own, whoever holds them now). Expecting 4 nodes, 3 registered: the running ring does not
    wait for the fourth, nobody is activated, the tail alone gets a Rewire to this
    coordinator, and a stays a standby."""
    sched = _scheduler(expect=4)
    assert sched.formation is not None
    joiners = {n: Joiner(n, GOOD, MESH[n]) for n in ("a", "b", "c")}
    serves = {"a": None, "b": ("c", 3, 6), "c": ("b", 0, 3)}
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name, joiner in joiners.items():
            await nursery.start(_stage(joiner, network, serves[name]).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert [(s.node, s.first, s.last) for s in plan.stages] == [("c", 0, 3), ("b", 3, 6)]
        assert plan.standbys == ("a",) and plan.method.startswith("adopted")
        assert [(s.name, s.holder) for s in sched._registry.slots] == [("b", "c"), ("c", "b")]
        assert sched.ring() == (COORD, "c", "b")
        assert joiners["b"].orders == [Rewire("coord:9", False)]  # the tail re-dials
        assert joiners["c"].orders == [] and joiners["a"].orders == []
        assert not any(isinstance(o, Activate) for j in joiners.values() for o in j.orders)
        nursery.cancel_scope.cancel()


async def test_stage_claims_that_make_no_whole_ring_are_set_aside_and_the_rest_form(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """b claims [0, 3) and nobody holds the rest (its partner died while no coordinator
    watched, or b lies: a hostile joiner's claim once ended the coordinator with a
    FormationError). After join_deadline_s the claim is set aside and a, c form the ring;
    b is given nothing."""
    sched = _scheduler(expect=2)
    assert sched.formation is not None
    joiners = {n: Joiner(n, GOOD, MESH[n]) for n in ("a", "b", "c")}
    serves = {"a": None, "b": ("b", 0, 3), "c": None}
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name, joiner in joiners.items():
            await nursery.start(_stage(joiner, network, serves[name]).run)
        started = trio.current_time()
        with trio.fail_after(120):
            plan = await sched.formation.form()
        assert trio.current_time() - started >= 30.0
        assert sorted(s.node for s in plan.stages) == ["a", "c"]
        assert joiners["b"].orders == []
        assert all(isinstance(o, Activate) for n in "ac" for o in joiners[n].orders)
        nursery.cancel_scope.cancel()
