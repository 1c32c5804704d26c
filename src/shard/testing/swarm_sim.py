"""A swarm of simulated nodes formed, placed and repaired by the real scheduler, in virtual time.

``simulate(world, ...)`` runs, under ``trio.testing.MockClock(autojump_threshold=0)``, the
coordinator's real ``Scheduler`` with its ``Formation`` (``shard.failover.scheduler``,
``shard.formation``) and so the real planner (``shard.placement.plan``, ``replan``) and
failure detector, fed by one real ``ControlClient`` per simulated node of a ``World``
(``shard.testing.swarm_world``): it registers with its card's profile, heartbeats, answers
probes over a ``DelayNetwork`` link of its round trip to the coordinator, reports its row of
the mesh, and obeys ``Activate`` (after block bytes / its bandwidth) and ``Rewire`` (at once).
No weights, no forward pass, no ring data.

What is simulated rather than run: a node's row of the mesh is the world's round trips (no
probe links between nodes: a million of them at 1,000 nodes), truncated as ``measure_row``
truncates it (``MAX_PEERS``: peers past the first 256 are reported unreached); the
coordinator's own probe of each listen address answers after the node's round trip; replay
after a splice costs nothing. Churn comes from the world (Weibull sessions, Poisson joins)
and, on top, ``ring_kills`` deaths of ring nodes at seeded times after forming, so repairs
are exercised at any size. A node's end goes through the existing fault injection
(``FaultInjector``): ``kill`` closes its links, ``stall`` for good freezes it with its links
open (a silent death).

``choose`` (the re-plan after a death) is timed on the wall clock, and the planner is timed
again on the problem the ring formed from, so the bench (``bench/swarm_sim.py``) can show
how the scheduler's own cost grows with the swarm.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import statistics
import time
from collections.abc import Sequence
from functools import partial

import attrs
import trio
import trio.testing

from shard.failover.control import ControlClient, ControlLink, JoinRefused, NodeReplaced
from shard.failover.duties import duties
from shard.failover.edge import DownstreamLink
from shard.failover.events import RingControl
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.formation.formation import Formation, FormationError
from shard.membership.registry import Member, Slot
from shard.membership.rtt import MAX_PEERS
from shard.messages import (
    Activate,
    Hello,
    MeasureRtt,
    Message,
    NodeName,
    NodeProfile,
    Register,
    Rewire,
    RttReport,
    Welcome,
)
from shard.placement import ModelFacts, Plan, plan
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.testing.faults import FaultInjector, FaultPlan
from shard.testing.swarm_world import SimNode, World
from shard.transport import Connection, MemoryNetwork, Network, TransportError
from shard.transport.delay import DelayNetwork
from shard.transport.guard import serve_one
from shard.transport.links import HandshakeError, accept_peer

_GONE = (NodeReplaced, JoinRefused, TransportError, HandshakeError)
SWARM = "sim"
COORD = NodeName("coord")
#: WAN timings: heartbeats every second, the RTT probe every 5 s, a long splice for loading.
POLICY = FailoverSpec(heartbeat_s=1.0, probe_s=5.0, splice_timeout_s=900.0)
#: After the horizon, how long the repairs in progress may take to finish (virtual seconds).
SETTLE_S = 900.0


@attrs.frozen
class Repair:
    """One repair the scheduler recorded (``Recovery``), with the lap after it."""

    lost: str
    replacement: str | None
    kind: str
    detect_s: float
    splice_s: float
    total_s: float
    lap_ms: float | None


@attrs.frozen
class SimReport:
    """What one simulation measured. Times in virtual seconds unless ``_wall``."""

    expect: int  # the formation's ``expect``
    seed: int
    joined_at_form: int  # live joined nodes when the ring formed
    form_s: float  # from the first arrival to the formed ring
    form_after_expect_s: float  # from the ``expect``-th arrival to the formed ring
    ring: tuple[tuple[str, int, int], ...]  # the ring as formed: (node, first, last)
    lap_ms: float  # the formed ring's predicted lap
    method: str
    repairs: tuple[Repair, ...]
    deaths: int  # nodes that left during the run (any role)
    ring_kills: tuple[tuple[float, str], ...]  # (virtual time, node) of each injected death
    not_serving: str  # why the ring does not serve at the end ("": every block held, live)
    final_ring: tuple[tuple[str, int, int], ...]
    plan_wall_s: float  # the planner on the formed problem, timed again (NaN: not timed)
    problem_wall_s: float  # building that problem from the mesh (N x N round trips)
    choose_wall_s: tuple[float, ...]  # each re-plan after a death (``Formation.choose``)
    form_wall_s: float  # wall time until the ring formed (the whole simulation's share)
    run_wall_s: float

    def repair_s(self) -> float | None:
        """The median time to repair (loss to ring whole), or None without repairs."""
        done = [r.total_s for r in self.repairs if r.replacement is not None]
        return statistics.median(done) if done else None


class _RingLink(DownstreamLink):
    """The coordinator's own ring link, reduced to what the splicer asks of it: a rewire
    (when stage 0 is replaced) succeeds at once."""

    def __init__(self, network: Network) -> None:
        outbox = trio.open_memory_channel[Message](0)[1]
        super().__init__(COORD, outbox, network, Hello(COORD, "coordinator", SWARM, link="ring"))
        self.rewired: list[str] = []

    async def rewire(self, address: str, *, replay: bool) -> None:
        self.rewired.append(address)


class _Sim:
    def __init__(self, world: World, expect: int, ring_kills: int, policy: FailoverSpec) -> None:
        self.world = world
        self.expect = expect
        self.ring_kills = ring_kills
        self.policy = policy
        self.network = MemoryNetwork()
        self.injector = FaultInjector(FaultPlan(world.seed, ()))
        self.gone: set[str] = set()
        self.calm = False  # past the horizon: nobody leaves any more
        self.nursery: trio.Nursery  # set by the run
        self.deaths = 0
        self.killed: list[tuple[float, str]] = []  # the ring deaths injected
        self.choose_wall: list[float] = []
        self.laps: dict[str, float] = {}  # replacement -> lap after its splice
        m = world.model
        self.model = ModelFacts(m.n_layers, m.layer_bytes, m.embedding_bytes, m.head_bytes)

    # --- one simulated node ------------------------------------------------------------

    def _client(self, node: SimNode, network: Network, nursery: trio.Nursery) -> ControlClient:
        name = NodeName(node.name)
        profile = NodeProfile(node.card, node.memory_bytes, node.ms_one, node.ms_chunk, 5)
        held: list[tuple[int, int, str]] = []  # the block it was activated with, if any

        def register() -> Register:
            first, last, slot = held[-1] if held else (-1, -1, "")
            role = "stage" if held else "standby"
            return Register(name, role, f"{node.name}:7000", first, last, slot, profile=profile)

        async def obey(order: Activate | Rewire) -> None:
            if isinstance(order, Activate):
                m = self.world.model
                size = (order.last - order.first) * m.layer_bytes
                size += m.embedding_bytes if order.first == 0 else 0
                size += m.head_bytes if order.last == m.n_layers else 0
                await trio.sleep(size / node.load_bytes_s)
                held.append((order.first, order.last, order.slot))

        async def measure(order: MeasureRtt) -> RttReport:
            rtt = self.world.rtt_ms
            # as measure_row: past MAX_PEERS (the coordinator last of all) -1, not tried
            values = tuple(
                rtt(node.name, n) if i < MAX_PEERS else -1.0 for i, n in enumerate(order.names)
            )
            return RttReport(name, order.names, values)

        link = ControlLink(
            name, ("coord",), Hello(name, "stage", SWARM, link="control"),
            heartbeat_s=self.policy.heartbeat_s, dead_after_s=self.policy.dead_after_s,
        )  # fmt: skip
        return ControlClient(link, network, register, duties(nursery, obey, measure=measure))

    async def _node(self, node: SimNode) -> None:
        """Join at ``join_at``; live until ``leave_at`` (or a ring kill); then go."""
        await trio.sleep_until(node.join_at)
        one_way_s = self.world.rtt_ms(node.name, COORD) / 2000.0
        with trio.CancelScope() as scope:
            self.injector.scopes[node.name] = scope
            async with (
                DelayNetwork(
                    self.network, one_way_s, local_name=node.name, size=lambda _: 0
                ) as delayed,
                trio.open_nursery() as nursery,
            ):
                client = self._client(node, self.injector.wrap(node.name, delayed), nursery)
                nursery.start_soon(self._leave_at, node, node.leave_at)
                # refused, or frozen before its first dial got an answer: it is gone
                with contextlib.suppress(*_GONE):
                    await client.run()
                nursery.cancel_scope.cancel()

    async def _leave_at(self, node: SimNode, at: float) -> None:
        await trio.sleep_until(at)
        self.leave(node)

    def leave(self, node: SimNode) -> None:
        """``node`` ends: silently (frozen, links open; its process is gone a while later)
        or by closing its links."""
        if node.name in self.gone or self.calm:
            return
        self.gone.add(node.name)
        self.deaths += 1
        if not node.silent:
            self.injector.kill(node.name)
            return
        self.injector.stall(node.name, math.inf)
        self.nursery.start_soon(self._kill_later, node.name)

    async def _kill_later(self, name: str) -> None:
        await trio.sleep(10 * self.policy.dead_after_s)
        self.injector.kill(name)

    # --- the coordinator -----------------------------------------------------------------

    def scheduler(self) -> tuple[Scheduler, trio.MemoryReceiveChannel[RingControl]]:
        to_router, told = trio.open_memory_channel[RingControl](256)
        expect_at = sorted(n.join_at for n in self.world.nodes)[self.expect - 1]
        spec = FormationSpec(
            expect=self.expect, wait_s=expect_at + 60.0, probes=3,
            remeasure_s=60.0,
        )  # fmt: skip
        sched = Scheduler(
            SchedulerConfig(
                node=COORD,
                slots=[],
                return_address="coord:9",
                policy=self.policy,
                formation=(spec, self.model),
            ),
            SchedulerChannels(to_router=to_router),
            ring_link=_RingLink(self.network),
            mesh_probe=self._probe,
        )
        assert sched.formation is not None
        self._time(sched.formation)
        return sched, told

    def _time(self, formation: Formation) -> None:
        """Wrap ``formation``'s re-plan choice and commit: wall time, lap after."""
        choose, spliced = formation.choose, formation.spliced

        def timed_choose(slot: Slot, live: Sequence[Member]) -> Member | None:
            started = time.perf_counter()
            try:
                return choose(slot, live)
            finally:
                self.choose_wall.append(time.perf_counter() - started)

        def timed_spliced(dead: NodeName, standby: NodeName) -> None:
            spliced(dead, standby)
            if formation.plan is not None:
                self.laps[standby] = formation.plan.lap_ms

        setattr(formation, "choose", timed_choose)  # noqa: B010 (an instance's method)
        setattr(formation, "spliced", timed_spliced)  # noqa: B010

    async def _probe(self, address: str) -> float | None:
        """The coordinator's own probe of a node's listen address (as a formed swarm's
        coordinator does): its round trip, or None from a node that is gone or frozen."""
        name = address.rsplit(":", 1)[0]
        rtt_s = self.world.rtt_ms(name, COORD) / 1000.0
        if name in self.gone:
            await trio.sleep(10.0)  # measure_rtt's timeout
            return None
        await trio.sleep(rtt_s)
        return rtt_s

    async def kill_ring(self, sched: Scheduler, formed_at: float, horizon_s: float) -> None:
        """``ring_kills`` deaths of ring nodes at seeded times in the first half of the
        ``horizon_s`` after forming."""
        rng = random.Random(self.world.seed + 1)
        span = 0.5 * horizon_s
        for at in sorted(formed_at + rng.uniform(0, span) for _ in range(self.ring_kills)):
            await trio.sleep_until(max(at, trio.current_time()))
            slots = sched.statistics().slots
            victim = self.world.node(slots[rng.randrange(len(slots))][1])
            if victim.name not in self.gone:
                self.killed.append((trio.current_time(), victim.name))
                self.leave(victim)


async def _run(
    world: World,
    *,
    expect: int,
    horizon_s: float,
    ring_kills: int,
    policy: FailoverSpec,
    time_plan: bool,
) -> SimReport | FormationError:
    started_wall = time.perf_counter()
    sim = _Sim(world, expect, ring_kills, policy)
    sched, told = sim.scheduler()
    formation = sched.formation
    assert formation is not None
    welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)

    async def control(conn: Connection) -> None:  # as the coordinator's handler does
        try:
            hello = await accept_peer(conn, welcome)
        except (HandshakeError, trio.TooSlowError):
            return  # a node that froze while it dialled
        await serve_one(conn, partial(sched.serve, hello=hello), what="control link")

    async def drain() -> None:
        async for _ in told:
            pass

    async with sim.network, trio.open_nursery() as nursery:
        sim.nursery = nursery
        nursery.start_soon(drain)
        await nursery.start(sched.run)
        await nursery.start(sim.network.serve, "coord", control)
        for node in world.nodes:
            nursery.start_soon(sim._node, node)
        try:
            found = await formation.form()
        except FormationError as exc:  # raised by simulate, not wrapped in a group
            nursery.cancel_scope.cancel()
            return exc
        formed_at, form_wall = trio.current_time(), time.perf_counter() - started_wall
        joined = [m for m in sched._registry.members.values() if m.alive and m.profile]
        t0 = time.perf_counter()
        problem = formation._problem(joined)
        t1 = time.perf_counter()
        if time_plan:
            plan(problem)
        plan_wall = time.perf_counter() - t1 if time_plan else math.nan
        nursery.start_soon(sim.kill_ring, sched, formed_at, horizon_s)
        await trio.sleep(horizon_s)
        sim.calm = True  # no more deaths: let the repairs in progress finish
        await trio.sleep(3 * policy.dead_after_s)  # a silent death is seen only by then
        reg, n_layers = sched._registry, world.model.n_layers
        with trio.move_on_after(SETTLE_S):
            while True:
                assert formation.plan is not None
                holders = [(s.holder, reg.alive(s.holder)) for s in reg.slots]
                stats = sched.statistics()
                why = _not_serving(formation.plan, n_layers, holders, stats.waiting)
                if not why:
                    break
                await trio.sleep(1.0)
        final = formation.plan
        nursery.cancel_scope.cancel()
    assert final is not None
    repairs = tuple(
        Repair(
            r.lost,
            r.replacement,
            r.kind,
            r.detect_s,
            r.splice_s,
            r.total_s,
            sim.laps.get(r.replacement) if r.replacement else None,
        )
        for r in stats.recoveries
    )
    expect_at = sorted(n.join_at for n in world.nodes)[expect - 1]
    return SimReport(
        expect=expect,
        seed=world.seed,
        joined_at_form=len(joined),
        form_s=formed_at - world.nodes[0].join_at,
        form_after_expect_s=formed_at - expect_at,
        ring=tuple((s.node, s.first, s.last) for s in found.stages),
        lap_ms=found.lap_ms,
        method=found.method,
        repairs=repairs,
        deaths=sim.deaths,
        ring_kills=tuple(sim.killed),
        not_serving=why,
        final_ring=tuple((s.node, s.first, s.last) for s in final.stages),
        plan_wall_s=plan_wall,
        problem_wall_s=t1 - t0,
        choose_wall_s=tuple(sim.choose_wall),
        form_wall_s=form_wall,
        run_wall_s=time.perf_counter() - started_wall,
    )


def _not_serving(
    final: Plan, n_layers: int, holders: Sequence[tuple[NodeName, bool]], waiting: Sequence[str]
) -> str:
    """Why the ring as it ends does not serve the whole model, or ""."""
    tiles = final.blocks()
    if (
        tiles[0][0] != 0
        or tiles[-1][1] != n_layers
        or any(a[1] != b[0] for a, b in itertools.pairwise(tiles))
    ):
        return f"the blocks do not tile: {tiles}"
    if [h for h, _ in holders] != [s.node for s in final.stages]:
        return f"slots held by {[h for h, _ in holders]}, the plan says {final.ring()}"
    dead = [h for h, alive in holders if not alive]
    if dead or waiting:
        return f"dead holders {dead} (a repair in progress?); waiting: {list(waiting)}"
    return ""


def simulate(
    world: World,
    *,
    expect: int,
    horizon_s: float = 900.0,
    ring_kills: int = 3,
    policy: FailoverSpec = POLICY,
    time_plan: bool = True,
) -> SimReport:
    """Run ``world`` in virtual time: the ring forms once ``expect`` nodes joined (or 60 s
    after the ``expect``-th arrival, with whoever is live), then for ``horizon_s`` the world's
    churn and ``ring_kills`` ring deaths are repaired; then, churn stopped, the repairs in
    progress may finish (``SETTLE_S``). ``time_plan``: time the planner again on the formed
    problem (``plan_wall_s``; NaN when not).

    Errors: ``FormationError`` when the ring cannot form."""
    report = trio.run(
        lambda: _run(
            world,
            expect=expect,
            horizon_s=horizon_s,
            ring_kills=ring_kills,
            policy=policy,
            time_plan=time_plan,
        ),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    if isinstance(report, FormationError):
        raise report
    return report


__all__ = ["POLICY", "Repair", "SimReport", "simulate"]
