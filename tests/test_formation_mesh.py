"""The formation's mesh after forming (``shard.failover.formation``, ``shard.failover.mesh``):
re-measured every ``remeasure_s`` and used by the sticky re-plan after a death, hostile or
silent reports never crash the scheduler (their rows are dropped), reachability is detected
from who reached a node's listen address (the operator's ``unreachable`` wins), and a slow
measurement never delays an ``Activate``.

In process, virtual time, memory network; the joined nodes are real ``ControlClient``s whose
measurements are the stubs of ``test_formation.Joiner``.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import pytest
import trio
import trio.testing

from shard.failover.control import ControlClient, OnMeasure
from shard.failover.events import RingControl, RingNote
from shard.failover.formation import MEASURE_TIMEOUT_S, Prober, describe
from shard.failover.mesh import STALE_MISSES
from shard.failover.rtt import measure_row, measure_rtt, serve_probes
from shard.failover.scheduler import Scheduler
from shard.messages import Activate, Hello, MeasureRtt, NodeName, Rewire, RttReport, Welcome
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.transport import Connection, MemoryNetwork, Network
from shard.transport.links import accept_peer
from test_formation import COORD, GOOD, MODEL, SWARM, Joiner, register, serving

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
) -> tuple[Scheduler, trio.MemoryReceiveChannel[RingControl]]:
    to_router, told = trio.open_memory_channel[RingControl](1024)
    spec = FormationSpec(
        expect=expect, wait_s=30.0, probes=3, remeasure_s=remeasure_s, unreachable=unreachable
    )
    sched = Scheduler(
        node=COORD,
        slots=[],
        return_address="coord:9",
        ring_link=None,
        to_router=to_router,
        policy=FailoverSpec(probe_s=0.5, dead_after_s=10.0),
        formation=(spec, MODEL),
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
    name: str, network: Network, on_measure: OnMeasure, role_log: list[str] | None = None
) -> ControlClient:
    """A joined node's control client whose measurements are ``on_measure``."""
    node = NodeName(name)

    async def on_order(order: Activate | Rewire) -> None:
        if role_log is not None:
            role_log.append(name)

    return ControlClient(
        node,
        network,
        "coord",
        Hello(node=node, role="stage", swarm=SWARM, link="control"),
        lambda: register(name, GOOD),
        on_order,
        on_measure=on_measure,
        heartbeat_s=0.25,
        dead_after_s=10.0,
    )


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


def hostile_reports(node: NodeName) -> OnMeasure:
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


async def test_a_node_nobody_reaches_is_detected_unreachable_and_left_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nobody (peers nor coordinator) reaches c at its listen address: c is detected
    unreachable, left out of the plan with a mesh note, and never chosen after a death; a
    and b, reached, form the ring."""
    mesh = {
        "a": {"b": 2.0, "c": -1.0, "coord": 20.0},
        "b": {"a": 2.0, "c": -1.0, "coord": 20.0},
        "c": {"a": 1.0, "b": 1.0, "coord": 20.0},  # c dials out fine
    }
    sched, told = scheduler(expect=3, remeasure_s=0.0, probe=prober({"c:7001"}))
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name in "abc":
            await nursery.start(Joiner(name, GOOD, mesh[name]).client(network, []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["a", "b"] and plan.standbys == ()
        stats = sched.statistics().mesh
        assert stats is not None
        reach = {r.node: r.reachable for r in stats.rows}
        assert reach == {"a": True, "b": True, "c": False}
        await trio.testing.wait_all_tasks_blocked()  # the scheduler passes its notes on
        notes = mesh_notes(told)
        assert len(notes) == 1 and notes[0].startswith("c accepts no inbound connection at")
        assert kill_tail_and_choose(sched) is None  # c is no standby for the ring
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("unreached", "unreachable", "ring", "reach"),
    [
        # peers reach c: the coordinator alone does not decide
        ({"c:7001"}, (), ["b", "c"], {"a": True, "b": True, "c": True}),
        # reached by all, but the operator says no: that wins
        (set(), ("b",), ["a", "c"], {"a": True, "b": False, "c": True}),
    ],
)
async def test_one_reacher_is_enough_and_the_operator_wins(
    autojump_clock: trio.testing.MockClock,
    unreached: set[str],
    unreachable: tuple[str, ...],
    ring: list[str],
    reach: dict[str, bool],
) -> None:
    """A node any peer reaches is reachable even if the coordinator does not reach it; a node
    the spec lists in formation.unreachable is left out however well it is reached."""
    joiners = [Joiner(n, GOOD, {k: v for k, v in MESH4[n].items() if k != "d"}) for n in "abc"]
    sched, _ = scheduler(
        expect=3, remeasure_s=0.0, probe=prober(unreached), unreachable=unreachable
    )
    assert sched.formation is not None
    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for j in joiners:
            await nursery.start(j.client(network, []).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ring, describe(plan)
        stats = sched.statistics().mesh
        assert stats is not None and {r.node: r.reachable for r in stats.rows} == reach
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


async def test_detection_with_real_probe_links(autojump_clock: trio.testing.MockClock) -> None:
    """With the real probe code on both sides (``measure_row`` on the nodes, ``measure_rtt``
    as the coordinator's prober) over a memory network: a and b serve probes at their
    listen addresses, c serves nothing there (it can only dial out). c is detected
    unreachable from every side and left out; a and b, measured, form the ring."""
    network = MemoryNetwork()
    coord_hello = Hello(node=COORD, role="coordinator", swarm=SWARM, link="probe")
    probe = partial(measure_rtt, network, hello=coord_hello, probes=3, timeout_s=5.0)
    sched, told = scheduler(expect=3, remeasure_s=0.0, probe=probe)
    assert sched.formation is not None

    async def serve_probe_link(name: str, conn: Connection) -> None:
        welcome = Welcome(node=NodeName(name), role="stage", swarm=SWARM)
        await accept_peer(conn, welcome)
        await serve_probes(conn)

    def measuring(name: str) -> OnMeasure:
        hello = Hello(node=NodeName(name), role="stage", swarm=SWARM, link="probe")
        return partial(measure_row, network, hello, timeout_s=5.0)

    async with network, trio.open_nursery() as nursery:
        await serving(nursery, network, sched)
        for name in "ab":
            await nursery.start(network.serve, f"{name}:7001", partial(serve_probe_link, name))
        for name in "abc":
            await nursery.start(client(name, network, measuring(name)).run)
        with trio.fail_after(60):
            plan = await sched.formation.form()
        assert sorted(s.node for s in plan.stages) == ["a", "b"], describe(plan)
        stats = sched.statistics().mesh
        assert stats is not None
        rows = {r.node: r for r in stats.rows}
        assert {n: r.reachable for n, r in rows.items()} == {"a": True, "b": True, "c": False}
        assert set(dict(rows["c"].rtt_ms)) == {"a", "b"}  # c reached both, dialling out
        assert "b" in dict(rows["a"].rtt_ms) and "c" not in dict(rows["a"].rtt_ms)
        await trio.testing.wait_all_tasks_blocked()
        assert any(n.startswith("c accepts no inbound connection") for n in mesh_notes(told))
        nursery.cancel_scope.cancel()
