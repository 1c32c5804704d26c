"""The formation's mesh after forming (``shard.formation``, ``shard.formation.mesh``):
re-measured every ``remeasure_s`` and used by the sticky re-plan after a death, hostile or
silent reports never crash the scheduler (their rows are dropped), reachability is detected
from who reached a node's listen address (the operator's ``unreachable`` wins) and such a
node is activated behind NAT, and a slow measurement never delays an ``Activate``.

In process, virtual time, memory network; the joined nodes are real ``ControlClient``s whose
measurements are the stubs of ``test_formation.Joiner`` — except the last test, which runs
real NAT networks (``NatNetwork`` on demand, the relay hub) and the real probe code over a
``Firewall``ed memory network that refuses every dial to the nodes behind it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial

import attrs
import pytest
import trio
import trio.testing

from answered import AnsweredClient
from shard.failover.events import RingControl, RingNote
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.formation.formation import MEASURE_TIMEOUT_S, Prober, describe
from shard.formation.mesh import STALE_MISSES
from shard.membership.rtt import measure_row, measure_rtt, serve_probes
from shard.messages import (
    Activate,
    Hello,
    MeasureRtt,
    NodeName,
    Probe,
    Rewire,
    RttReport,
    Welcome,
)
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.testing import Firewall
from shard.transport import Connection, MemoryNetwork, Network
from shard.transport.base import Handler, NetworkBase
from shard.transport.links import accept_peer, dial_peer
from shard.transport.nat import NatNetwork
from shard.transport.relayhub import RelayHub
from test_formation import COORD, GOOD, LAYER, MODEL, SWARM, Joiner, register, serving

#: b, c near each other (the ring); a and d far from them (the standbys), a less far
MESH4 = {
    "a": {"b": 80.0, "c": 80.0, "d": 80.0, "coord": 20.0},
    "b": {"a": 80.0, "c": 2.0, "d": 90.0, "coord": 20.0},
    "c": {"a": 80.0, "b": 2.0, "d": 90.0, "coord": 20.0},
    "d": {"a": 80.0, "b": 90.0, "c": 90.0, "coord": 20.0},
}


def scheduler(
    expect: int,
    *,
    remeasure_s: float,
    probe: Prober | None = None,
    unreachable: tuple[str, ...] = (),
    return_address: str = "coord:9",
) -> tuple[Scheduler, trio.MemoryReceiveChannel[RingControl]]:
    to_router, told = trio.open_memory_channel[RingControl](1024)
    spec = FormationSpec(
        expect=expect, wait_s=30.0, probes=3, remeasure_s=remeasure_s, unreachable=unreachable
    )
    sched = Scheduler(
        SchedulerConfig(
            node=COORD,
            slots=[],
            return_address=return_address,
            policy=FailoverSpec(probe_s=0.5, dead_after_s=10.0),
            formation=(spec, MODEL),
        ),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
        mesh_probe=probe,
    )
    return sched, told


def mesh_notes(told: trio.MemoryReceiveChannel[RingControl]) -> list[str]:
    notes = []
    while True:
        try:
            msg = told.receive_nowait()
        except trio.WouldBlock:
            return notes
        if isinstance(msg, RingNote) and msg.kind == "mesh":
            notes.append(msg.detail)


def client(
    name: str,
    network: Network,
    measure: Callable[[MeasureRtt], Awaitable[RttReport]],
    role_log: list[str] | None = None,
) -> AnsweredClient:
    """A joined node's control client whose measurements are ``measure``."""
    node = NodeName(name)

    async def obey(order: Activate | Rewire) -> None:
        if role_log is not None:
            role_log.append(name)

    return AnsweredClient(
        node,
        network,
        "coord",
        lambda: register(name, GOOD),
        SWARM,
        obey=obey,
        measure=measure,
        dead_after_s=10.0,
    )


class NatCapable(NetworkBase):
    """A memory network a fake node's control client dials through, which can be told the
    node is behind NAT (``BehindNat``): it only counts how often."""

    def __init__(self, inner: MemoryNetwork) -> None:
        self._inner = inner
        self.told = 0

    async def dial(self, address: str) -> Connection:
        return await self._inner.dial(address)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self._inner.serve(address, handler, task_status=task_status)

    async def behind_nat(self, *, timeout_s: float) -> None:
        self.told += 1


def kill_tail_and_choose(sched: Scheduler) -> str | None:
    """Mark the tail dead and ask the formation which standby takes its slot."""
    assert sched.formation is not None
    slot = sched._registry.slots[-1]
    sched._registry.members[slot.holder].alive = False
    chosen = sched.formation.choose(slot, sched._registry.live_standbys())
    return None if chosen is None else chosen.node


@pytest.mark.parametrize(("remeasure_s", "expected"), [(30.0, "d"), (0.0, "a")])
async def test_the_mesh_is_remeasured_and_a_replan_uses_the_new_one(
    autojump_clock: trio.testing.MockClock, remeasure_s: float, expected: str
) -> None:
    """b, c form the ring, a and d stand by (d the farther). Then d moves next to b and c:
    with remeasure_s the next round sees it (rows replaced, ages reset) and the re-plan after
    the tail dies picks d; with remeasure_s = 0 the mesh stays as formed and it picks a."""
    sched, told = scheduler(expect=4, remeasure_s=remeasure_s)
    assert sched.formation is not None
    joiners = {n: Joiner(n, GOOD, dict(MESH4[n])) for n in MESH4}
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners.values():
            await nursery.start(j.client(network, []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["b", "c"], describe(plan)
        for near in ("b", "c"):  # d moved: 3 ms from b and c, both ways
            joiners["d"].rtt_ms[near] = joiners[near].rtt_ms["d"] = 3.0
        await trio.sleep(100.0)  # three rounds' time, and then some
        mesh = sched.statistics().mesh
        assert mesh is not None and mesh.age_s is not None
        rows = {r.node: r for r in mesh.rows}
        assert set(rows) == set(MESH4) and all(r.state == "fresh" for r in rows.values())
        if remeasure_s:
            assert mesh.rounds >= 3 and len(joiners["d"].asked) == mesh.rounds
            assert mesh.age_s < remeasure_s + MEASURE_TIMEOUT_S
            assert dict(rows["d"].rtt_ms)["b"] == 3.0
            assert rows["d"].age_s is not None and rows["d"].age_s < 100.0
        else:
            assert mesh.rounds == 1 and len(joiners["d"].asked) == 1
            assert dict(rows["d"].rtt_ms)["b"] == 90.0
        assert kill_tail_and_choose(sched) == expected
        assert mesh_notes(told) == []  # everyone answered: nothing to note
        nursery.cancel_scope.cancel()


def hostile_reports(node: NodeName) -> Callable[[MeasureRtt], Awaitable[RttReport]]:
    """An ``on_measure`` whose every answer is malformed, in turn: wrong names, wrong count,
    NaN, out of range, another node's name."""
    seed = itertools.count()

    async def on_measure(order: MeasureRtt) -> RttReport:
        n = len(order.names)
        bad = [
            RttReport(node, tuple(reversed(order.names)), (1.0,) * n) if n > 1 else None,
            RttReport(node, order.names, (1.0,) * (n + 1000)),
            RttReport(node, order.names, (math.nan,) * n),
            RttReport(node, order.names, (-5.0,) * n),
            RttReport(node, order.names, (1e12,) * n),
            RttReport(NodeName("b"), order.names, (0.0,) * n),  # posing as b
        ]
        choices = [r for r in bad if r is not None]
        return choices[next(seed) % len(choices)]

    return on_measure


async def test_hostile_reports_never_crash_the_scheduler_and_their_row_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """b, c form the ring with d standing by; h joins later and answers every measurement
    with garbage. The scheduler serves on, b's row is not overwritten by h posing as b, h's
    row is dropped after STALE_MISSES rounds (noted on the status feed), and the re-plan
    after a death picks d over h (whose pairs, estimated through the coordinator, would
    otherwise look free)."""
    sched, told = scheduler(expect=3, remeasure_s=5.0)
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        # b, c, d reach h at 1 ms: only its own (garbage) row can keep it out
        mesh3 = {n: {k: v for k, v in MESH4[n].items() if k != "a"} | {"h": 1.0} for n in "bcd"}
        for name in "bcd":
            await nursery.start(Joiner(name, GOOD, mesh3[name]).client(network, []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["b", "c"], describe(plan)
        await nursery.start(client("h", network, hostile_reports(NodeName("h"))).run)
        await trio.sleep((STALE_MISSES + 1) * (5.0 + MEASURE_TIMEOUT_S))
        mesh = sched.statistics().mesh
        assert mesh is not None
        rows = {r.node: r for r in mesh.rows}
        assert rows["h"].state == "dropped" and rows["h"].rtt_ms == ()
        assert dict(rows["b"].rtt_ms) == mesh3["b"]
        assert rows["b"].state == rows["c"].state == rows["d"].state == "fresh"
        notes = mesh_notes(told)
        assert any(note.startswith("h answered no RTT measurement") for note in notes), notes
        assert kill_tail_and_choose(sched) == "d"
        assert sched._registry.members[NodeName("h")].alive  # refused rows, not the node
        nursery.cancel_scope.cancel()


def prober(unreached: set[str]) -> Prober:
    """The coordinator's probe of a listen address: 1 ms, or None for ``unreached``."""

    async def probe(address: str) -> float | None:
        await trio.sleep(0.001)
        return None if address in unreached else 0.001

    return probe


async def test_a_node_nobody_reaches_is_planned_behind_nat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nobody (a nor the coordinator) reaches c at its listen address: c is detected
    unreachable (a mesh note says so) and, needed for the model, planned behind NAT: its
    network is turned to NAT edges before its Activate runs, and it is dialled at nat:c."""
    mesh = {
        "a": {"c": -1.0, "coord": 20.0},
        "c": {"a": 1.0, "coord": 20.0},  # c dials out fine
    }
    sched, told = scheduler(expect=2, remeasure_s=0.0, probe=prober({"c:7001"}))
    assert sched.formation is not None
    network = MemoryNetwork()
    nets = {n: NatCapable(network) for n in "ac"}
    joiners = {n: Joiner(n, GOOD, mesh[n]) for n in "ac"}
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name, j in joiners.items():
            await nursery.start(j.client(nets[name], []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["a", "c"]
        stats = sched.statistics().mesh
        assert stats is not None
        assert {r.node: r.reachable for r in stats.rows} == {"a": True, "c": False}
        (to_c,) = joiners["c"].orders
        (to_a,) = joiners["a"].orders
        assert isinstance(to_c, Activate) and isinstance(to_a, Activate)
        assert to_c.behind_nat and not to_a.behind_nat
        assert nets["c"].told == 1 and nets["a"].told == 0
        slots = {s.holder: s.address for s in sched._registry.slots}
        assert slots == {"a": "a:7001", "c": "nat:c"}
        into_c = sched.formation.entry if plan.stages[0].node == "c" else to_a.successor
        assert into_c == "nat:c"
        await trio.testing.wait_all_tasks_blocked()  # the scheduler passes its notes on
        notes = mesh_notes(told)
        assert len(notes) == 1 and notes[0].startswith("c accepts no inbound connection at")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("unreached", "unreachable", "reach"),
    [
        # peers reach c: the coordinator alone does not decide
        ({"c:7001"}, (), {"a": True, "b": True, "c": True}),
        # reached by all, but the operator says no: that wins
        (set(), ("b",), {"a": True, "b": False, "c": True}),
    ],
)
async def test_one_reacher_is_enough_and_the_operator_wins(
    autojump_clock: trio.testing.MockClock,
    unreached: set[str],
    unreachable: tuple[str, ...],
    reach: dict[str, bool],
) -> None:
    """A node any peer reaches is reachable even if the coordinator does not reach it; a node
    the spec lists in formation.unreachable is taken as behind NAT however well it is
    reached (its Activate says so, and it is dialled at nat:NAME)."""
    joiners = [Joiner(n, GOOD, {k: v for k, v in MESH4[n].items() if k != "d"}) for n in "abc"]
    sched, _ = scheduler(
        expect=3, remeasure_s=0.0, probe=prober(unreached), unreachable=unreachable
    )
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners:
            await nursery.start(j.client(NatCapable(network), []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["b", "c"], describe(plan)
        stats = sched.statistics().mesh
        assert stats is not None and {r.node: r.reachable for r in stats.rows} == reach
        behind = {j.name for j in joiners if any(getattr(o, "behind_nat", False) for o in j.orders)}
        assert behind == set(unreachable)
        slots = {s.holder: s.address for s in sched._registry.slots}
        assert all((a == f"nat:{n}") == (n in unreachable) for n, a in slots.items()), slots
        nursery.cancel_scope.cancel()


async def test_a_measurement_that_never_ends_does_not_hold_up_activation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """b's measurement hangs: the mesh round gives up on b's row at its deadline, and b,
    needed for the model, still takes its block (its Activate does not wait behind the
    measurement on b's control link)."""

    async def hang(order: MeasureRtt) -> RttReport:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    sched, _ = scheduler(expect=2, remeasure_s=0.0)
    assert sched.formation is not None
    activated: list[str] = []
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        a = Joiner("a", GOOD, {"b": 5.0, "coord": 20.0})
        await nursery.start(a.client(network, activated).run)
        await nursery.start(client("b", network, hang, activated).run)
        with trio.fail_after(MEASURE_TIMEOUT_S + 10):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["a", "b"]
        assert sorted(activated) == ["a", "b"]
        nursery.cancel_scope.cancel()


#: a (reachable) and x, y (behind a firewall: no dial reaches their listen addresses); each
#: has room for two of the six layers, so the ring needs all three
ROOM2 = 2 * LAYER + 500
NAT_NODES = {"a": True, "x": False, "y": False}


def on_demand(inner: Firewall, name: str) -> NatNetwork:
    """A joined node's network: reachable at NAME:7001 until the scheduler says otherwise."""
    return NatNetwork(
        inner, node=NodeName(name), role="stage", swarm=SWARM, advertise=f"{name}:7001",
        relay="coord", call_timeout_s=5.0, on_demand=True,
    )  # fmt: skip


async def test_joined_nodes_nobody_reaches_form_a_ring_through_the_relay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Real NAT networks on a firewalled memory network, the real probe code on both sides:
    x and y accept no inbound connection. Detection finds it, the plan puts all three in
    the ring, x and y register at the coordinator's relay when activated, and every edge of
    the ring (into x and y by callback or through the relay) carries a message end to end;
    no ring dial ever reached the firewall."""
    closed = {f"{n}:7001" for n, ok in NAT_NODES.items() if not ok}
    firewall = Firewall(MemoryNetwork(encode_frames=True), closed)
    hub = RelayHub(COORD, SWARM, "coordinator")
    coord_net = NatNetwork(
        firewall, node=COORD, role="coordinator", swarm=SWARM, advertise="coord",
        relay="coord", hub=hub, call_timeout_s=5.0,
    )  # fmt: skip
    coord_hello = Hello(node=COORD, role="coordinator", swarm=SWARM, link="probe")
    probe = partial(measure_rtt, coord_net, hello=coord_hello, probes=3, timeout_s=5.0)
    sched, _ = scheduler(expect=3, remeasure_s=0.0, probe=probe, return_address="coord")
    assert sched.formation is not None
    nets = {n: on_demand(firewall, n) for n in NAT_NODES}
    echoed: list[str] = []  # who answered each edge a stage dialled on Activate

    async def echo(name: NodeName, conn: Connection) -> None:
        """A node's listener: probe links answered, anything else echoed back."""
        hello = await accept_peer(conn, Welcome(node=name, role="stage", swarm=SWARM))
        if hello.link == "probe":
            await serve_probes(conn)
            return
        while True:
            await conn.send(await conn.receive())

    async def coordinator(conn: Connection) -> None:
        welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)
        hello = await accept_peer(conn, welcome)
        if hello.link == "control":
            await sched.serve(conn, hello)
        elif hello.link == "probe":
            await serve_probes(conn)
        else:  # the tail's return link
            await conn.send(await conn.receive())

    async def edge(net: Network, me: NodeName, address: str) -> None:
        """Dial ``address`` as a ring edge and see one message come back."""
        hello = Hello(node=me, role="stage", swarm=SWARM)
        conn = await dial_peer(net, address, hello, timeout_s=10.0)
        await conn.send(Probe(nonce=1, sent_at=0.0))
        assert await conn.receive() == Probe(nonce=1, sent_at=0.0)
        echoed.append(f"{me}->{address}")
        await conn.aclose()

    def node_client(name: str) -> AnsweredClient:
        node, net = NodeName(name), nets[name]

        async def obey(order: Activate | Rewire) -> None:
            assert isinstance(order, Activate)
            await edge(net, node, order.successor)

        hello = Hello(node=node, role="stage", swarm=SWARM, link="probe")
        return AnsweredClient(
            node, net, "coord", lambda: register(name, attrs.evolve(GOOD, memory_bytes=ROOM2)),
            SWARM, obey=obey, measure=partial(measure_row, net, hello, timeout_s=5.0),
            dead_after_s=10.0,
        )  # fmt: skip

    with trio.fail_after(120):
        async with coord_net, trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            await nursery.start(coord_net.serve, "coord", coordinator)
            for name, net in nets.items():
                bound = await nursery.start(net.serve, f"{name}:7001", partial(echo, name))
                assert bound == f"{name}:7001"  # reachable until told otherwise
            for name in NAT_NODES:
                await nursery.start(node_client(name).run)
            plan = await sched.formation.form()
            ring = [s.node for s in plan.stages]
            assert sorted(ring) == ["a", "x", "y"], describe(plan)
            await edge(coord_net, COORD, sched.formation.entry)  # the coordinator's own edge
            stats = sched.statistics().mesh
            assert stats is not None
            assert {r.node: r.reachable for r in stats.rows} == NAT_NODES
            slots = {s.holder: s.address for s in sched._registry.slots}
            assert slots == {"a": "a:7001", "x": "nat:x", "y": "nat:y"}
            nat = {n: net.statistics() for n, net in nets.items()}
            assert nat["x"].registered and nat["y"].registered and not nat["a"].registered
            refused_before = list(firewall.refused)
            nursery.cancel_scope.cancel()
    assert len(echoed) == 4  # three stages' edges and the coordinator's
    assert sorted(e.split("->")[1] for e in echoed) == sorted(["coord", *slots.values()])
    assert all(address in closed for address in refused_before)  # only probes hit it
    hub_stats = hub.statistics()
    through = sum(s.callbacks + s.relayed for s in nat.values()) + coord_net.statistics().callbacks
    assert through == 2 and hub_stats.calls == 2  # the two edges into x and y
    adjacent = abs(ring.index("x") - ring.index("y")) == 1
    assert hub_stats.pairs == int(adjacent)  # x -> y (or y -> x) meets at the relay
    print(f"ring {ring}; relayed pairs {hub_stats.pairs}; callbacks {through - hub_stats.pairs}")


async def test_a_node_that_dies_during_a_round_is_not_reported_missing(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """c's measurement hangs and c dies mid-round: the round names nobody as missing (a dead
    node is gone, not late: the soak's log warned 'no RTT report from n1' for a node the
    scheduler had declared dead a moment before) and counts no miss against it."""

    async def hang(order: MeasureRtt) -> RttReport:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    caplog.set_level(logging.WARNING, logger="shard.formation.formation")
    sched, _ = scheduler(expect=3, remeasure_s=0.0)
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name in ("a", "b"):
            others = {n: 5.0 for n in ("a", "b", "c") if n != name}
            await nursery.start(
                Joiner(name, GOOD, {**others, "coord": 20.0}).client(network, []).run
            )
        await nursery.start(client("c", network, hang).run)

        async def dies_mid_round() -> None:
            await trio.sleep(MEASURE_TIMEOUT_S / 2)
            sched._registry.members[NodeName("c")].alive = False

        nursery.start_soon(dies_mid_round)
        with trio.fail_after(MEASURE_TIMEOUT_S + 10):
            await sched.formation.form()
        assert not [r for r in caplog.records if "no RTT report" in r.getMessage()]
        nursery.cancel_scope.cancel()
