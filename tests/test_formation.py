"""Formation (``shard.formation``): a ``[formation]`` scheduler takes registrations
from nodes started with ``--join``, refuses malformed ones with a typed reply (the coordinator
serves on), measures the RTT mesh, plans and activates the ring tail first, and after a death
re-plans with the sticky ``replan`` (only the dead stage's layers move).

In process, virtual time, memory network: the joined nodes are real ``ControlClient``s whose
orders and measurements are recorded stubs.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import attrs
import pytest
import trio
import trio.testing

from answered import AnsweredClient
from shard.failover.control import JoinRefused
from shard.failover.events import Resume, RingControl, RingLost
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.formation.formation import (
    UNREACHABLE_MS,
    FormationError,
    check_report,
    describe,
    unmeasured,
)
from shard.formation.registration import check_register
from shard.messages import (
    Activate,
    Fault,
    Hello,
    MeasureRtt,
    NodeName,
    NodeProfile,
    Register,
    Rewire,
    RttReport,
    Welcome,
)
from shard.placement import Candidate, ModelFacts, Problem, RttMatrix
from shard.placement.lap import Mesh, evaluate
from shard.placement.replan import moved_layers
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.transport import Connection, ConnectionClosed, MemoryNetwork, Network
from shard.transport.links import accept_peer, dial_peer

SWARM = "form-test"
COORD = NodeName("coord")
LAYER = 1000
#: six layers; each node below has room for four with the embedding or head (so two stages)
MODEL = ModelFacts(6, LAYER, embedding_bytes=500, head_bytes=500)
ROOM = 4 * LAYER + 500
GOOD = NodeProfile("cpu", ROOM, 1.0, 1.2, 5)


def register(node: str, profile: NodeProfile | None = GOOD, address: str = "") -> Register:
    return Register(NodeName(node), "standby", address or f"{node}:7001", profile=profile)


# --- registrations and reports, checked for shape ------------------------------------------


@pytest.mark.parametrize(
    ("reg", "why"),
    [
        (register("a", None), "--join"),
        (register("a", address="nowhere"), "listen address"),
        (register("a", address="a:0"), "port 0"),
        (register("a", attrs.evolve(GOOD, memory_bytes=-1)), "memory"),
        (register("a", attrs.evolve(GOOD, memory_bytes=1 << 60)), "memory"),
        (register("a", attrs.evolve(GOOD, ms_per_layer_one=math.nan)), "1-token"),
        (register("a", attrs.evolve(GOOD, ms_per_layer_chunk=math.inf)), "chunk ms"),
        (register("a", attrs.evolve(GOOD, ms_per_layer_one=0.0)), "1-token"),
        (register("a", attrs.evolve(GOOD, chunk_tokens=0)), "tokens"),
        (register("a", attrs.evolve(GOOD, device="x" * 500)), "device label"),
    ],
)
def test_malformed_registrations_are_refused_with_the_reason(reg: Register, why: str) -> None:
    """Each malformed registration has a one-line reason naming what is wrong."""
    refused = check_register(reg)
    assert refused is not None and why in refused


def test_a_well_formed_registration_passes() -> None:
    """A joining node with a bound address and a finite profile is accepted."""
    assert check_register(register("a")) is None


def test_rtt_reports_must_answer_what_was_asked() -> None:
    """A report is taken only for the names asked, in order, with -1 or a finite RTT."""
    asked = MeasureRtt(("b", "coord"), ("b:1", "coord:1"), 3)
    node = NodeName("a")
    assert check_report(asked, RttReport(node, ("b", "coord"), (1.0, -1.0))) is None
    for bad in (
        RttReport(node, ("coord", "b"), (1.0, 1.0)),
        RttReport(node, ("b", "coord"), (1.0,)),
        RttReport(node, ("b", "coord"), (math.nan, 1.0)),
        RttReport(node, ("b", "coord"), (-2.0, 1.0)),
        RttReport(node, ("b", "coord"), (UNREACHABLE_MS * 2, 1.0)),
    ):
        assert check_report(asked, bad) is not None, bad


# --- a forming scheduler, in process -----------------------------------------------------


@attrs.define
class Joiner:
    """A fake joined node: its control client's orders and the RTTs it reports."""

    name: str
    profile: NodeProfile
    rtt_ms: dict[str, float]
    orders: list[Activate | Rewire] = attrs.field(factory=list)
    asked: list[MeasureRtt] = attrs.field(factory=list)
    #: when set, an ``Activate`` waits for this (a block still loading), and says it came
    loading: trio.Event | None = None
    activating: trio.Event = attrs.field(factory=trio.Event)

    def client(self, network: Network, order_log: list[str]) -> AnsweredClient:
        node = NodeName(self.name)

        async def obey(order: Activate | Rewire) -> None:
            self.orders.append(order)
            order_log.append(self.name)
            if isinstance(order, Activate) and self.loading is not None:
                self.activating.set()
                await self.loading.wait()

        async def measure(order: MeasureRtt) -> RttReport:
            self.asked.append(order)
            values = tuple(self.rtt_ms.get(n, -1.0) for n in order.names)
            return RttReport(node, order.names, values)

        return AnsweredClient(
            node,
            network,
            "coord",
            lambda: register(self.name, self.profile),
            SWARM,
            obey=obey,
            measure=measure,
            dead_after_s=10.0,
        )


def scheduler(
    expect: int, wait_s: float = 30.0
) -> tuple[Scheduler, trio.MemoryReceiveChannel[RingControl]]:
    to_router, told = trio.open_memory_channel[RingControl](256)
    return (
        Scheduler(
            SchedulerConfig(
                node=COORD,
                slots=[],
                return_address="coord:9",
                policy=FailoverSpec(probe_s=0.5, dead_after_s=10.0),
                formation=(FormationSpec(expect=expect, wait_s=wait_s, probes=3), MODEL),
            ),
            SchedulerChannels(to_router=to_router),
            ring_link=None,
        ),
        told,
    )


async def serving(
    nursery: trio.Nursery, network: MemoryNetwork, sched: Scheduler
) -> Callable[[Connection], Awaitable[None]]:
    """Run ``sched`` and serve its control links at ``coord``."""
    welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)

    async def control(conn: Connection) -> None:
        await sched.serve(conn, await accept_peer(conn, welcome))

    await nursery.start(sched.run)
    await nursery.start(network.serve, "coord", control)
    return control


#: a (far) and b, c (near each other); everyone 20 ms from the coordinator
MESH = {
    "a": {"b": 80.0, "c": 80.0, "coord": 20.0},
    "b": {"a": 80.0, "c": 2.0, "coord": 20.0},
    "c": {"a": 80.0, "b": 2.0, "coord": 20.0},
}


async def test_joined_nodes_form_a_planned_ring_and_a_death_moves_only_its_layers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three nodes join (two would hold the model): the mesh is measured, the near pair b, c
    forms the ring (a is the standby), activated tail first; after the tail dies the re-plan
    gives only its block to the standby."""
    sched, _ = scheduler(expect=3)
    assert sched.formation is not None
    joiners = [Joiner(n, GOOD, MESH[n]) for n in ("a", "b", "c")]
    order_log: list[str] = []
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners:
            await nursery.start(j.client(network, order_log).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        ring = [s.node for s in plan.stages]
        assert sorted(ring) == ["b", "c"] and plan.standbys == ("a",), describe(plan)
        assert plan.stages[0].first == 0 and plan.stages[-1].last == 6
        assert order_log == list(reversed(ring))  # the tail first: each dials its successor
        tail = joiners[[j.name for j in joiners].index(ring[-1])]
        (activate,) = tail.orders
        assert isinstance(activate, Activate) and activate.successor == "coord:9"
        asked = {j.name: j.asked[0] for j in joiners}
        assert set(asked["a"].names) == {"b", "c", "coord"} and asked["a"].probes == 3
        assert sched.ring() == (COORD, *ring)

        # the tail dies: the sticky re-plan moves its block to the standby a, nothing else
        slot = sched._registry.slots[-1]
        sched._registry.members[slot.holder].alive = False
        live = sched._registry.live_standbys()
        chosen = sched.formation.choose(slot, live)
        assert chosen is not None and chosen.node == "a"
        sched.formation.spliced(slot.holder, chosen.node)
        after = sched.formation.plan
        assert after is not None
        assert [s.node for s in after.stages] == [ring[0], "a"]
        assert after.blocks() == plan.blocks()
        assert moved_layers(plan, after) == plan.stages[-1].layers
        nursery.cancel_scope.cancel()


async def test_a_malformed_registration_gets_a_typed_reply_and_the_rest_form(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A joiner with a NaN profile is refused (Fault kind register: its client raises
    JoinRefused), a raw peer registering without a profile is told why and closed, and the
    coordinator serves on: two good nodes then form the ring."""
    sched, _ = scheduler(expect=2)
    assert sched.formation is not None
    order_log: list[str] = []
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        bad = Joiner("bad", attrs.evolve(GOOD, ms_per_layer_one=math.nan), {})
        with pytest.raises(JoinRefused, match="1-token ms per layer"):
            await bad.client(network, order_log).run()
        hello = Hello(NodeName("raw"), "stage", SWARM, link="control")
        raw = await dial_peer(network, "coord", hello, timeout_s=5)
        await raw.send(register("raw", None))
        fault = await raw.receive()
        assert isinstance(fault, Fault) and fault.kind == "register" and "--join" in fault.detail
        with pytest.raises(ConnectionClosed):
            await raw.receive()
        for name in ("b", "c"):
            await nursery.start(Joiner(name, GOOD, MESH[name]).client(network, order_log).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["b", "c"]
        assert "bad" not in sched._registry.members and "raw" not in sched._registry.members
        nursery.cancel_scope.cancel()


async def test_nodes_that_never_come_are_a_clear_formation_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One small node joins a swarm expecting three; at the deadline it cannot hold the model,
    and FormationError says who came, how much memory is missing and what to do."""
    sched, _ = scheduler(expect=3, wait_s=5.0)
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        await nursery.start(Joiner("a", GOOD, MESH["a"]).client(network, []).run)
        with pytest.raises(FormationError, match=r"1 of 3 expected nodes joined within 5 s"):
            await sched.formation.form()
        nursery.cancel_scope.cancel()


async def test_at_the_deadline_the_nodes_that_hold_the_model_form_the_ring(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two of three expected nodes came and they hold the model: at wait_s the ring forms
    with them."""
    sched, _ = scheduler(expect=3, wait_s=5.0)
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name in ("b", "c"):
            await nursery.start(Joiner(name, GOOD, MESH[name]).client(network, []).run)
        started = trio.current_time()
        plan = await sched.formation.form()
        assert trio.current_time() - started >= 5.0
        assert sorted(s.node for s in plan.stages) == ["b", "c"]
        nursery.cancel_scope.cancel()


def test_a_hop_not_measured_yet_is_named_not_added_to_the_printed_lap() -> None:
    """A standby spliced in before any round measured it (its round trips are the
    UNREACHABLE_MS stand-in) is printed with the lap over the measured hops and the hops
    not measured yet named — not a 60-second 'prediction' (issue 40)."""
    names = ("b", "d", "coord")
    far = UNREACHABLE_MS
    rows = ((0.0, far, 20.0), (far, 0.0, far), (20.0, far, 0.0))
    problem = Problem(
        (Candidate("b", ROOM, 1.0, 1.2), Candidate("d", ROOM, 1.0, 1.2)),
        RttMatrix(names, rows),
        MODEL,
        (COORD,),
    )
    spliced = evaluate(Mesh(problem), COORD, ["d", "b"], [3, 3], "d took a's layers")
    assert spliced.lap_ms > far  # what the planner counts, so it avoids such hops
    line = describe(spliced)
    assert unmeasured(spliced) == spliced.hops[:2]
    # measured: b -> coord, 10 ms one way; compute 6 layers x 1.2 ms
    assert "predicted lap 17.20 ms over the measured hops" in line, line
    assert "not measured yet: coord -> d, d -> b" in line, line
    assert "60" not in line.split("predicted lap")[1].split("ms")[0]
    measured = evaluate(Mesh(problem), COORD, ["b"], [6], "b alone")
    assert unmeasured(measured) == () and describe(measured).endswith("predicted lap 27.20 ms")


async def test_a_standby_that_loaded_the_block_is_in_the_plan_even_if_its_rewire_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The tail dies; while the standby loads its block, the tail's predecessor dies too, so
    rewiring it fails. The standby holds the slot all the same, and the formation's plan
    says so: the next re-plan (the predecessor's slot) builds on it, and a later death of
    that standby is re-planned too (found by the swarm simulation, issue 40)."""
    sched, told = scheduler(expect=3)
    assert sched.formation is not None
    joiners = {n: Joiner(n, GOOD, MESH[n]) for n in ("a", "b", "c")}
    network = MemoryNetwork()
    scopes = {n: trio.CancelScope() for n in joiners}

    async def node(j: Joiner, *, task_status: trio.TaskStatus[None]) -> None:
        with scopes[j.name]:
            await j.client(network, []).run(task_status=task_status)

    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners.values():
            await nursery.start(node, j)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        first, tail = (s.node for s in plan.stages)
        joiners["a"].loading = trio.Event()
        scopes[tail].cancel()  # the tail dies: a is activated in its place ...
        with trio.fail_after(60):
            await joiners["a"].activating.wait()
        scopes[first].cancel()  # ... and its predecessor dies while a loads
        joiners["a"].loading.set()
        with trio.fail_after(60):  # the splice fails at the rewire (the order is lost)
            while not isinstance(event := await told.receive(), RingLost):
                pass
        assert "could not be repaired" in event.detail, event
        after = sched.formation.plan
        assert after is not None and after.block_of("a") == plan.block_of(tail)
        assert sched.ring()[-1] == "a"  # the registry agrees with the plan
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["dies", "too slow"])
async def test_a_standby_that_fails_loading_is_replaced_by_the_next_one(
    how: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The tail dies; the standby chosen for it fails while it loads the block — it dies (the
    splice fails when its control link ends, not at splice_timeout_s), or it is too slow
    (the splice times out, the slot stays with it, and then it dies). A node that joins then
    is re-planned into the slot (found by the swarm simulation, issue 40)."""
    sched, told = scheduler(expect=3)
    assert sched.formation is not None
    joiners = {n: Joiner(n, GOOD, MESH[n]) for n in ("a", "b", "c")}
    joiners["a"].loading = trio.Event()  # never set: a is still loading when it fails
    network = MemoryNetwork()
    scopes = {n: trio.CancelScope() for n in (*joiners, "d")}

    async def node(j: Joiner, *, task_status: trio.TaskStatus[None]) -> None:
        with scopes[j.name]:
            await j.client(network, []).run(task_status=task_status)

    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners.values():
            await nursery.start(node, j)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        tail = plan.stages[-1].node
        scopes[tail].cancel()
        with trio.fail_after(60):
            await joiners["a"].activating.wait()
        failed = trio.current_time()
        if how == "dies":
            scopes["a"].cancel()
        with trio.fail_after(60):
            while not isinstance(event := await told.receive(), RingLost):
                pass
        if how == "dies":
            assert trio.current_time() - failed < 5.0, "waited for the splice timeout"
            assert "control link ended" in event.detail, event
        else:
            assert "longer than 30 s" in event.detail, event
            scopes["a"].cancel()
        await nursery.start(node, Joiner("d", GOOD, {"coord": 20.0, "b": 2.0, "c": 2.0}))
        with trio.fail_after(120):
            while not isinstance(event := await told.receive(), Resume):
                pass
        after = sched.formation.plan
        assert after is not None and after.block_of("d") == plan.block_of(tail), describe(after)
        assert sched.ring()[-1] == "d"
        nursery.cancel_scope.cancel()
