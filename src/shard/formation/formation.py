"""Formation: the scheduler's part in a swarm whose ring forms from nodes started with
``--join`` (a spec with ``[formation]``, no ``[[stage]]``).

A joining node registers on its control link like any standby — after the same admission and
``Hello`` — with its ``NodeProfile`` (device, memory for weights, measured ms per layer).
``check_register`` (``shard.formation.registration``) refuses a malformed one (a typed ``Fault``
of kind ``register`` and the connection closed; nothing else is affected). ``form`` then:

1. waits until ``expect`` nodes joined and their memory holds the model (or, at ``wait_s``,
   forms with whoever joined if they hold it; else ``FormationError`` says who came and what
   is missing);
2. asks every candidate (``MeasureRtt``) to measure its round trip to every other one and to
   the coordinator (the median of ``probes``) and waits for their ``RttReport``; the
   coordinator's row is its control links' RTTs, and it probes every candidate's listen
   address itself to detect reachability (``shard.formation.mesh``);
3. plans with ``shard.placement.plan`` (memory, profiles, the mesh, pinning to the spec's
   ``trusted`` names and to nodes whose verified admission token grants the role
   ``trusted`` — never a node's own word); a candidate that nobody reached at its
   listen address, or that the spec lists in ``unreachable``, is planned as
   ``reachable = false`` (logged, and a ``mesh`` note);
4. fills the ring's slots and sends each ring node ``Activate`` from the tail back to stage 0
   (each loads its block and dials its successor); the others stay spare standbys. An
   unreachable one gets ``Activate(behind_nat=True)`` (it registers at the relay first) and
   is dialled at ``nat:NAME`` (``Registry.behind_nat``), by a callback or through the relay.

Once formed, ``remeasure`` (every ``remeasure_s``, driven by the scheduler) measures the mesh
again the same way, so it stays current: rows are replaced, a node that does not answer keeps
its last row (stale) and loses it after ``STALE_MISSES`` rounds, and nodes that joined later are
measured too. After a stage dies, ``choose`` re-plans on the latest mesh with the sticky
``replan`` (standbys only: a running stage cannot grow its block yet), so only the dead stage's
layers move; ``spliced`` commits it.

A ring still running when this coordinator starts (a standby coordinator that took over) is
adopted as it stands instead (``shard.formation.warm``).

Errors: ``FormationError`` (the ring cannot form; the message says what to do).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.formation.mesh import Mesh, MeshStatistics
from shard.formation.report import (
    UNREACHABLE_MS,
    FormationError,
    check_report,
    describe,
    unmeasured,
)
from shard.formation.warm import adopt, adopted_plan, warm_ring
from shard.logs import NOTE
from shard.membership.registry import Member, RecoveryFailed, Registry, Slot
from shard.messages import Activate, MeasureRtt, NodeName, RttReport
from shard.placement import Candidate, ModelFacts, Plan, PlanError, Problem, RttMatrix, plan
from shard.placement.replan import moved_layers, replan
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec
from shard.transport import TransportError
from shard.trust.admission import TRUSTED_ROLE

log = logging.getLogger(__name__)

#: How long each candidate may take to measure its row of the mesh.
MEASURE_TIMEOUT_S = 20.0

#: The coordinator's own probe of a listen address: the median round trip in seconds, or
#: None when it could not reach it (``shard.membership.rtt.measure_rtt``, bound to its network).
Prober = Callable[[str], Awaitable[float | None]]


class Formation:
    """See the module docstring. Not an actor: the scheduler routes registrations and
    reports to it, and the coordinator's composition root awaits ``form``."""

    def __init__(
        self,
        spec: FormationSpec,
        registry: Registry,
        *,
        model: ModelFacts,
        policy: FailoverSpec,
        clock: Callable[[], float] = trio.current_time,
        probe: Prober | None = None,
    ) -> None:
        """``probe``: how the coordinator probes a candidate's listen address (None: it does
        not; reachability is then detected from the candidates' rows alone)."""
        self._spec = spec
        self._registry = registry
        self._model = model
        self._policy = policy
        self._clock = clock
        self._probe = probe
        self._asked: dict[NodeName, MeasureRtt] = {}
        self.mesh = Mesh(registry.node)
        self._unreachable: set[NodeName] = set()  # as last noted
        self._formed = trio.Event()
        self._cold = False  # stage claims that never made a whole ring: ignored (warm.py)
        #: the mesh's notes from the measurement before forming (for the status feed)
        self.formed_notes: list[str] = []
        self._reported = trio.Event()
        self._next: tuple[NodeName, Plan] | None = None
        #: the ring as planned, re-planned after each death; None until formed
        self.plan: Plan | None = None

    @property
    def entry(self) -> str:
        """Where the coordinator's ring link dials once formed: stage 0's address."""
        return self._registry.slots[0].address

    # --- what the scheduler hands over -------------------------------------------------

    def reported(self, node: NodeName, report: RttReport) -> None:
        """A candidate's row of the mesh (ignored, logged, unless it answers what it was
        asked: a node cannot fill in other nodes' rows)."""
        asked = self._asked.get(node)
        why = "nobody asked it" if asked is None else check_report(asked, report)
        if asked is None or why is not None or report.node != node:
            log.warning("formation: RTT report from %s ignored: %s", node, why or "wrong node")
            return
        self.mesh.take(report, self._clock())
        self._reported.set()
        self._reported = trio.Event()

    # --- forming -----------------------------------------------------------------------

    async def form(self) -> Plan:
        """Wait for the nodes, measure the mesh, plan, and activate the ring (see the module
        docstring). Errors: ``FormationError``."""
        joined = await self._wait_joined()
        self.formed_notes = [*await self._measure(joined), *self._note_reach(joined)]
        warm = None if self._cold else warm_ring(joined, self._model.n_layers)  # complete
        try:
            if warm is not None:
                return await self._adopt(adopted_plan(self._problem(joined), warm.stages))
            found = plan(self._problem(joined))
        except PlanError as exc:
            raise FormationError(f"the joined nodes cannot form a ring: {exc}") from None
        reg = self._registry
        behind = {NodeName(s.node) for s in found.stages if self.unreachable(self._member(s.node))}
        reg.behind_nat |= behind
        members = [self._member(s.node) for s in found.stages]
        reg.slots = [
            Slot(m.node, s.first, s.last, m.node, reg.dial_address(m))
            for s, m in zip(found.stages, members, strict=True)
        ]
        for i in reversed(range(len(reg.slots))):  # the tail first: each dials its successor
            slot = reg.slots[i]
            member = self._member(slot.holder)
            order = Activate(
                slot.name, slot.first, slot.last, reg.address_after(i), slot.holder in behind
            )
            try:
                await member.order(order, timeout_s=self._policy.splice_timeout_s)
            except (RecoveryFailed, trio.TooSlowError) as exc:
                raise FormationError(
                    f"{slot.holder} could not take layers [{slot.first}, {slot.last}): "
                    f"{exc or 'no answer in time'} (failover.splice_timeout_s)"
                ) from None
            member.role = "stage"
        self.plan = found
        self._formed.set()
        out = f"; behind NAT (dialled through the relay): {', '.join(sorted(behind))}"
        log.log(NOTE, "formation: formed the ring %s%s", describe(found), out if behind else "")
        return found

    async def _adopt(self, found: Plan) -> Plan:
        """Take the running ring ``found`` as it is (``shard.formation.warm``)."""
        await adopt(self._registry, found, self._policy.splice_timeout_s)
        self.plan = found
        self._formed.set()
        log.log(NOTE, "formation: adopted the running ring %s", describe(found))
        return found

    @property
    def remeasure_s(self) -> float:
        """How often the mesh is measured again once formed (0: never)."""
        return self._spec.remeasure_s

    async def wait_formed(self) -> None:
        await self._formed.wait()

    def unreachable(self, member: Member) -> bool:
        """Whether ``member`` accepts no inbound connection: the spec says so (always wins),
        or detection found that nobody reaches its listen address."""
        return member.node in self._spec.unreachable or self.mesh.reachable(member.node) is False

    def statistics(self) -> MeshStatistics:
        """The mesh as held now, one row per joined node (``reachable``: as detected, or
        False for a node the spec lists in ``unreachable``)."""
        joined = [m.node for m in self._registry.members.values() if m.profile is not None]
        stats = self.mesh.statistics(joined, self._clock())
        said = self._spec.unreachable  # the operator's word wins over detection
        rows = (attrs.evolve(r, reachable=False) if r.node in said else r for r in stats.rows)
        return attrs.evolve(stats, rows=tuple(rows))

    async def remeasure(self) -> list[str]:
        """Measure the mesh again over every live joined node (ring and standbys); the
        one-line notes of what changed (rows gone stale or dropped, reachability)."""
        joined = self._candidates()
        if not joined:
            return []
        notes = await self._measure(joined)
        notes += self._note_reach(joined)
        return notes

    def _note_reach(self, joined: Sequence[Member]) -> list[str]:
        """Log (and return) each change in who accepts no inbound connection."""
        notes = []
        for m in joined:
            gone = self.unreachable(m)
            if gone == (m.node in self._unreachable):
                continue
            if gone:
                self._unreachable.add(m.node)
                how = (
                    "the spec lists it in formation.unreachable"
                    if m.node in self._spec.unreachable
                    else "no candidate nor the coordinator reached it there"
                )
                then = (
                    "it keeps its edges as they are (a re-dial into it may fail)"
                    if m.role == "stage" and m.node not in self._registry.behind_nat
                    else "if it takes a block, it is activated behind NAT (dialled at nat:NAME "
                    "through the relay)"
                )
                notes.append(
                    f"{m.node} accepts no inbound connection at {m.address} ({how}): taken as "
                    f"reachable = false; {then}"
                )
            else:
                self._unreachable.discard(m.node)
                notes.append(f"{m.node} is reachable at {m.address} again")
        for note in notes:
            log.warning("formation: %s", note)
        return notes

    async def _wait_joined(self) -> list[Member]:
        spec, need = self._spec, self._model.total_bytes
        deadline = self._clock() + spec.wait_s
        warm_until: float | None = None
        while True:
            joined = self._candidates()
            warm = None if self._cold else warm_ring(joined, self._model.n_layers)
            if warm is not None:  # a running ring: adopted whole, never formed over
                if warm.complete:
                    return joined
                warm_until = warm_until or self._clock() + self._policy.join_deadline_s
                if self._clock() >= warm_until:  # false or stale claims: formed without them
                    log.warning("formation: stage claims lack %s after %g s; forming without "
                                "them", warm.missing, self._policy.join_deadline_s)  # fmt: skip
                    self._cold = True
                    continue
                with trio.move_on_after(warm_until - self._clock()):
                    await self._registry.wait_joined()
                continue
            joined = [m for m in joined if not (self._cold and m.role == "stage")]
            held = sum(m.profile.memory_bytes for m in joined if m.profile is not None)
            if len(joined) >= spec.expect and held >= need:
                return joined
            left = deadline - self._clock()
            if left <= 0:
                if joined and held >= need:
                    log.warning(
                        "formation: %d of %d expected nodes joined within %g s; forming with "
                        "them", len(joined), spec.expect, spec.wait_s,
                    )  # fmt: skip
                    return joined
                names = ", ".join(m.node for m in joined) or "none"
                raise FormationError(
                    f"{len(joined)} of {spec.expect} expected nodes joined within "
                    f"{spec.wait_s:g} s (formation.wait_s; joined: {names}), holding "
                    f"{held / 2**30:.2f} of the {need / 2**30:.2f} GiB the model needs; start "
                    "more nodes with shard up --role stage --join, or give them more memory"
                )
            with trio.move_on_after(left):
                await self._registry.wait_joined()

    def _candidates(self) -> list[Member]:
        """Live joined nodes, in the order they registered."""
        return [m for m in self._registry.members.values() if m.alive and m.profile is not None]

    def _member(self, node: str) -> Member:
        return self._registry.members[NodeName(node)]

    async def _measure(self, joined: Sequence[Member]) -> list[str]:
        """Ask every candidate for its row of the mesh and probe each one's listen address;
        wait (bounded) for the answers. Returns the mesh's notes on rows that changed state."""
        coordinator = self._registry.node
        self.mesh.round_started()
        async with trio.open_nursery() as nursery:
            for m in joined:
                peers = [p for p in joined if p is not m]
                ask = MeasureRtt(
                    names=(*(p.node for p in peers), coordinator),
                    addresses=(*(p.address for p in peers), self._registry.return_address),
                    probes=self._spec.probes,
                )
                self._asked[m.node] = ask
                nursery.start_soon(self._ask, m, ask)
                if self._probe is not None:
                    nursery.start_soon(self._probe_one, m)
            with trio.move_on_after(MEASURE_TIMEOUT_S):
                while not all(self.mesh.answered(m.node) for m in joined if m.alive):
                    await self._reported.wait()
        alive = [m for m in joined if m.alive]  # one that died meanwhile is gone, not late
        missing = [m.node for m in alive if not self.mesh.answered(m.node)]
        if missing:
            log.warning("formation: no RTT report from %s; estimated", ", ".join(missing))
        notes = self.mesh.round_done((m.node for m in alive), self._clock())
        for note in notes:
            log.warning("formation: %s", note)
        stats = self.mesh.statistics([m.node for m in joined], self._clock())
        log.info(
            "formation: mesh round %d: %s", stats.rounds,
            ", ".join(f"{r.node} {r.state}" for r in stats.rows),
        )  # fmt: skip
        return notes

    async def _ask(self, member: Member, ask: MeasureRtt) -> None:
        """Send one ``MeasureRtt`` (in its own task: a node whose link does not drain delays
        only its own row, and only up to ``MEASURE_TIMEOUT_S``)."""
        with trio.move_on_after(MEASURE_TIMEOUT_S):
            try:
                await member.conn.send(ask)
            except TransportError as exc:
                log.warning("formation: could not ask %s for RTTs: %s", member.node, exc)

    async def _probe_one(self, member: Member) -> None:
        """The coordinator's own probe of ``member``'s listen address (reachability)."""
        assert self._probe is not None
        rtt: float | None = None
        with trio.move_on_after(MEASURE_TIMEOUT_S):
            rtt = await self._probe(member.address)
        self.mesh.probed(member.node, rtt is not None)

    def _problem(self, members: Sequence[Member]) -> Problem:
        names = [m.node for m in members]
        coordinator = self._registry.node
        places = [*names, coordinator]
        rows = tuple(tuple(self._rtt(a, b) for b in places) for a in places)
        candidates = []
        for m in members:
            p = m.profile
            assert p is not None  # candidates are joined nodes
            candidates.append(
                Candidate(
                    m.node,
                    p.memory_bytes,
                    p.ms_per_layer_one,
                    p.ms_per_layer_chunk,
                    trusted=m.node in self._spec.trusted or TRUSTED_ROLE in m.token_roles,
                    reachable=not self.unreachable(m),
                )
            )
        return Problem(
            tuple(candidates),
            RttMatrix(tuple(places), rows),
            self._model,
            (coordinator,),
            pin_boundaries=self._spec.pin_boundaries,
            ring_size=self._spec.stages,  # [formation] stages; None: by predicted lap
        )

    def _rtt(self, a: str, b: str) -> float:
        """The round trip ``a -> b`` in ms: ``a``'s report, else ``b``'s the other way, else
        through the coordinator (a late joiner's, before its first round); the coordinator's
        own row is its control links' median. A dropped row's node costs ``UNREACHABLE_MS``
        on every pair."""
        if a == b:
            return 0.0
        if self.mesh.dropped(a) or self.mesh.dropped(b):
            return UNREACHABLE_MS  # it stopped answering measurements: chosen last
        coordinator = self._registry.node
        if a == coordinator:
            member = self._registry.members.get(NodeName(b))
            if member is not None and member.rtt.rtt_s is not None:
                return member.rtt.rtt_s * 1000.0
            return (self.mesh.row(b) or {}).get(a, UNREACHABLE_MS)
        for src, dst in ((a, b), (b, a)):
            row = self.mesh.row(src) or {}
            if dst in row:
                return row[dst]
        if b == coordinator:
            return self._rtt(b, a)
        return min(self._rtt(coordinator, a) + self._rtt(coordinator, b), UNREACHABLE_MS)

    # --- after a death -----------------------------------------------------------------

    def choose(self, slot: Slot, live: Sequence[Member]) -> Member | None:
        """The standby the sticky re-plan puts in ``slot`` (its holder died), or None when no
        live standby can take it (the splicer waits for one to join, then gives up). The
        holder may be a standby that died loading the block, which the plan never named: the
        slot is the plan's stage at the same place in the ring."""
        previous, dead = self.plan, slot.holder
        i = next((j for j, s in enumerate(self._registry.slots) if s.name == slot.name), None)
        if previous is None or i is None or i >= len(previous.stages):
            return None
        planned = previous.stages[i].node  # ``dead`` itself, unless a splice into it failed
        spares = [m for m in live if m.profile is not None and m.role == "standby"]
        ring = [self._member(s.node) for s in previous.stages]
        try:
            found = replan(
                attrs.evolve(previous, standbys=tuple(m.node for m in spares)),
                planned,
                self._problem([*ring, *spares]),
                neighbours=False,
            )
        except PlanError as exc:
            log.warning("formation: no re-plan after %s died: %s", dead, exc)
            return None
        self._next = (dead, found)  # what the splicer's ``spliced`` will name
        chosen = self._member(found.stages[i].node)
        if self.unreachable(chosen):  # activated behind NAT, dialled at nat:NAME
            self._registry.behind_nat.add(chosen.node)
        return chosen

    def spliced(self, dead: NodeName, standby: NodeName) -> None:
        """``standby`` holds ``dead``'s slot (it loaded the block; the rewire into it follows,
        and may fail): the re-plan chosen for it is the plan now."""
        nxt = self._next
        if nxt is None or nxt[0] != dead or standby not in nxt[1].ring() or self.plan is None:
            return  # not the choice made (a node taken back into its own slot)
        before, after = self.plan, nxt[1]
        self.plan, self._next = after, None
        log.log(
            NOTE,
            "formation: re-planned after %s died: %s (moved %d layers: %s)",
            dead, describe(after), moved_layers(before, after), after.method,
        )  # fmt: skip


__all__ = [
    "MEASURE_TIMEOUT_S",
    "UNREACHABLE_MS",
    "Formation",
    "FormationError",
    "Prober",
    "check_report",
    "describe",
    "unmeasured",
]
