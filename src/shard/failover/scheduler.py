"""Scheduler: the control plane in the coordinator's process — who is alive, who holds which
ring slot, and what to do when a node dies.

Every stage and standby keeps a control link to the scheduler (``shard.failover.control``): it
registers, then heartbeats. A node whose link closes is dead; one that goes silent is first
suspected, then dead, as the failure detector (``shard.failover.detector``) judges the silence
against the node's measured heartbeat gaps and net of this scheduler's own loop lag. Problems
go on the scheduler's own queue as messages (``shard.failover.events``: ``NodeDead``,
``LinkLost``, ``Relink``, ``Rejoin``) and are repaired one at a time by the splicer
(``shard.failover.splice``):

- **a ring node died** — splice a standby into its slot, with replay; no standby in time and
  the requests fail with the committed tokens (``RingError``), never a silent stop; the slot
  then waits, however long, and the first node that registers and can hold its block is
  spliced in (``Joined``: a late repair), so the ring serves again.
- **a node declared dead but not replaced registers again** (it was frozen, or restarted) —
  it is taken back into its slot, re-synced from its predecessor's replay log like a standby.
  Only a node whose slot another node really holds is refused ("replaced by ...").
- **a node registers under a live member's name** (an impostor, a second ``--join`` with
  the same ``--node``) — refused with a ``Fault`` of kind ``name``, and the live member's link
  is not touched; on a secure swarm the same key may take its own link over (a restarted
  node). A name frees once its member is declared dead.
- **a ring edge broke between live nodes** (a severed connection, a corrupt frame; reported
  on a node's control link, or on ``ring_faults`` by this coordinator's own ring link) — after
  a grace period, if the successor is still alive and still in place, re-dial the same edge.

The router hears about repairs on ``to_router`` (``Pause``, ``Resume``, ``RingLost``, and
``RingNote`` events for the status feed). Timings of each recovery (detection, splice, total)
are kept in ``statistics().recoveries``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from shard.audit.checker import Answered, Ask, Copied, Noted, Roster, SpotEvent, SpotOutcome
from shard.failover.detector import FailureDetector
from shard.failover.edge import DownstreamLink
from shard.failover.events import (
    Joined,
    LinkLost,
    NodeDead,
    Problem,
    Rejoin,
    Relink,
    RingNote,
)
from shard.failover.scheduler_config import (
    SchedulerChannels,
    SchedulerConfig,
    SchedulerStatistics,
)
from shard.failover.splice import Recovery, Splicer
from shard.formation.formation import Formation, Prober
from shard.formation.registration import check_register
from shard.membership.registry import (
    Member,
    RecoveryFailed,
    Registry,
    Slot,
    forward_reply,
    peer_identity,
)
from shard.membership.rtt import RttTracker
from shard.messages import (
    Fault,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    ProbeReply,
    Ready,
    Register,
    Rewire,
    RttReport,
)
from shard.messages.audit import AuditCopy, AuditVerdict
from shard.transport import Connection, TransportError, abandon
from shard.transport.guard import CONNECTION_ERRORS

log = logging.getLogger(__name__)

# Problems waiting for the repair in progress: each member queues at most one death, and
# link faults come one per failed send (a link then waits to be rewired).
_PROBLEMS_BUFFER = 64


class Scheduler:
    """See the module docstring. ``serve`` handles one control connection (the coordinator's
    listener hands each one over); ``run`` watches heartbeats, reads the ring link's faults
    and carries out recoveries. Spot checks are the ``SpotChecker``'s (``shard.audit.checker``):
    the scheduler sends it what its control links carry (``SchedulerChannels.spot_checks``),
    acts on its notes and evictions (``spot_outcomes``) and lends it a registry read.

    ``statistics``, ``standbys``, ``ring`` and ``tail`` are snapshot reads (the status feed and
    the return endpoint ask them as they need them), so they stay calls.

    Cancellation: cancelling ``run`` stops the watchdog and any repair in progress.
    Errors: a repair that fails is a ``RingLost`` for the router, never an exception; bugs
    propagate.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        channels: SchedulerChannels,
        *,
        ring_link: DownstreamLink | None = None,
        mesh_probe: Prober | None = None,
        return_up: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """``ring_link``: this node's own ring edge (re-dialled by repairs; None: a test that
        plays it). ``return_up`` says whether a tail's return link is connected now (a
        snapshot read): a tail that registers while it is not (this coordinator restarted) is
        told to re-dial it. With ``config.formation``, ``mesh_probe`` is how it probes a
        joined node's listen address (reachability; None: it does not); once formed, the mesh
        is measured again every ``remeasure_s`` (its notes go to the router as ``mesh``
        events)."""
        node, policy = config.node, config.policy
        self._node = node
        self._registry = Registry(node, config.slots, config.return_address)
        self._to_router = to_router = channels.to_router
        self._ring_faults = channels.ring_faults
        self._policy = policy
        self._clock = clock
        self._return_up = return_up
        self._own_copies = channels.own_copies
        self._spot_checks = channels.spot_checks
        self._spot_outcomes = channels.spot_outcomes
        self.roster: Roster = self._registry  # the spot checker's read of it
        formation = config.formation
        self.formation = None if formation is None else Formation(
            formation[0], self._registry, model=formation[1], policy=policy, clock=clock,
            probe=mesh_probe,
        )  # fmt: skip
        self._splicer = Splicer(
            self._registry, ring_link=ring_link, to_router=to_router, policy=policy, clock=clock,
            replanner=self.formation,
        )  # fmt: skip
        self._problems_send, self._problems = trio.open_memory_channel[Problem](_PROBLEMS_BUFFER)
        self._detector = FailureDetector(policy)

    # --- views -------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        reg = self._registry
        return SchedulerStatistics(
            members=tuple((m.node, m.role, m.alive) for m in reg.members.values()),
            slots=tuple((s.name, s.holder) for s in reg.slots),
            standbys=reg.standbys(),
            recoveries=tuple(self._splicer.recoveries),
            waiting=tuple(w.describe() for w in self._splicer.waiting.values()),
            rtt_s=tuple((m.node, m.rtt.rtt_s) for m in reg.members.values()),
            mesh=None if self.formation is None else self.formation.statistics(),
        )

    def standbys(self) -> tuple[NodeName, ...]:
        return self._registry.standbys()

    def ring(self) -> tuple[NodeName, ...]:
        """Node names from the coordinator to the tail, as the ring stands now."""
        return self._registry.ring()

    def tail(self) -> NodeName:
        """The node that may open the return link now."""
        return self._registry.tail()

    # --- control links -------------------------------------------------------------------

    async def serve(self, conn: Connection, hello: Hello) -> None:
        """One node's control link, from its ``Register`` until it closes. A peer that sends
        anything else first, or nothing, or registers under a live member's name
        (``Registry.name_refusal``), is told why and closed; nothing else is affected."""
        first: Message | None = None
        with trio.move_on_after(self._policy.register_timeout_s):
            first = await conn.receive()
        if first is None:  # never registered: this connection only
            log.warning(
                "scheduler: %s (%s) sent no Register within %g s (failover.register_timeout_s);"
                " closed",
                hello.node,
                conn.peer,
                self._policy.register_timeout_s,
            )
            return
        if not isinstance(first, Register) or first.node != hello.node:
            await conn.send(Fault(self._node, "control", "expected Register for this node"))
            return
        refused = check_register(first) if self.formation is not None else None
        if refused is not None:  # a malformed joiner: told why; nothing else is touched
            log.warning("scheduler: refused %s's registration: %s", first.node, refused)
            await conn.send(Fault(self._node, "register", refused))
            return
        taken = self._registry.name_refusal(first.node, peer_identity(conn), self._clock())
        if taken is not None:  # a live member's name: refused; that member's link untouched
            log.warning("scheduler: refused a registration from %s: %s", conn.peer, taken)
            await conn.send(Fault(self._node, "name", taken))
            return
        replaced_by = self._registry.replaced_by(first)
        if replaced_by is not None:
            # Its slot is held by another: a node that wakes up later must not rejoin with
            # stale sessions. It can restart as a standby under a new name.
            detail = f"{first.node} was replaced by {replaced_by}"
            await conn.send(Fault(self._node, "control", detail))
            return
        replies_send, replies = trio.open_memory_channel[Ready](4)
        rtt = RttTracker(conn, interval_s=self._policy.probe_s, clock=self._clock)
        member = Member.registered(first, conn, self._clock(), replies, rtt)
        old = self._registry.join(member, first.slot)
        self._detector.watch(member.node, member.last_seen)
        if old is not None:
            await abandon(old.conn)
        if old is not None and not old.alive and self._registry.slot_of(member.node) is not None:
            # declared dead, not replaced (it still holds its slot): take it back
            await self._problems_send.send(Rejoin(member.node, old.last_seen))
        elif self._splicer.waiting and member.role == "standby":  # it may fill a lost slot
            await self._problems_send.send(Joined(member.node))
        reason = "control link closed"
        try:
            async with trio.open_nursery() as nursery:
                if member.node == self.tail():
                    nursery.start_soon(self._redial_return, member)
                await self._to_router.send(
                    RingNote("join", f"{member.node} ({member.role}) registered")
                )
                nursery.start_soon(self._beat, member)
                nursery.start_soon(member.rtt.run)
                try:
                    await self._listen(member, replies_send)
                except CONNECTION_ERRORS as exc:  # that link's failure, not this node's
                    reason = f"control link closed: {type(exc).__name__}: {exc}"
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            replies_send.close()  # an order waiting for its Ready fails now, not at its timeout
            self._declare_dead(member, reason)

    async def _listen(self, member: Member, replies: trio.MemorySendChannel[Ready]) -> None:
        """What a member sends: ``Ready`` replies to orders, probe replies, faults,
        heartbeats."""
        while True:
            msg = await member.conn.receive()
            member.last_seen = self._clock()
            beat = isinstance(msg, Heartbeat)
            self._detector.heard(member.node, member.last_seen, heartbeat=beat)
            if isinstance(msg, Ready):
                forward_reply(replies, msg, member.node)
            elif isinstance(msg, ProbeReply):
                member.rtt.on_reply(msg)
            elif isinstance(msg, Fault):
                await self._to_router.send(
                    RingNote("fault", f"{msg.node}: {msg.kind}: {msg.detail}")
                )
                if msg.kind == "link":
                    await self._link_lost(member.node)
            elif isinstance(msg, RttReport) and self.formation is not None:
                self.formation.reported(member.node, msg)
            elif isinstance(msg, AuditCopy):
                await self._spot(Copied(member.node, msg))
            elif isinstance(msg, AuditVerdict):
                await self._spot(Answered(member.node, msg))
            elif not isinstance(msg, Heartbeat):
                log.warning("scheduler: unexpected %s from %s", msg, member.node)

    def _declare_dead(self, member: Member, reason: str) -> None:
        """The member's control link ended: unless it was replaced meanwhile, it is dead.
        Synchronous (``send_nowait``): this runs while the serve task is being cancelled."""
        if self._registry.members.get(member.node) is not member or not member.alive:
            return
        member.alive = False
        self._detector.forget(member.node)
        log.warning("scheduler: %s is dead (%s)", member.node, reason)
        try:
            self._problems_send.send_nowait(NodeDead(member.node, self._clock()))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning("scheduler: not running; %s's loss is not acted on", member.node)

    async def _link_lost(self, node: NodeName) -> None:
        """``node``'s downstream edge failed (``node`` may be this coordinator)."""
        successor = self._registry.successor_of(node)
        if successor is not None:
            self._detector.corroborate(successor, f"{node} reported the edge into it broken")
            await self._problems_send.send(LinkLost(node, successor, self._clock()))

    async def _own_link_faults(self, faults: trio.MemoryReceiveChannel[Fault]) -> None:
        """Faults of this coordinator's own ring link (to stage 0)."""
        async with faults:
            async for fault in faults:
                await self._to_router.send(
                    RingNote("fault", f"{fault.node}: {fault.kind}: {fault.detail}")
                )
                await self._link_lost(self._node)

    async def _own_link_copies(self, copies: trio.MemoryReceiveChannel[AuditCopy]) -> None:
        async with copies:
            async for copy in copies:
                await self._spot(Copied(self._node, copy))

    async def _spot(self, event: SpotEvent) -> None:
        """A copy or verdict for the spot checker (none: a verdict is a node's own word)."""
        if self._spot_checks is not None:
            await self._spot_checks.send(event)
        elif isinstance(event, Answered):
            log.warning("scheduler: %s sent a verdict nobody asked it for; ignored", event.auditor)

    async def _ask(self, ask: Ask) -> None:
        req, member = ask.request, self._registry.members.get(ask.auditor)
        try:
            if member is None:
                raise TransportError("it left the swarm")
            await member.conn.send(req)
        except TransportError as exc:
            log.warning("scheduler: audit of %s not sent to %s: %s", req.accused, ask.auditor, exc)

    async def _spot_outcome(self, outcomes: trio.MemoryReceiveChannel[SpotOutcome]) -> None:
        """What the spot checker found: a note for the router, or a node to evict — declared
        dead and replaced by a standby exactly as after a crash (the predecessor replays its
        log, so no committed token is lost)."""
        async with outcomes:
            async for outcome in outcomes:
                if isinstance(outcome, Noted):
                    await self._to_router.send(RingNote("audit", outcome.text))
                    continue
                if isinstance(outcome, Ask):
                    await self._ask(outcome)
                    continue
                node = outcome.node
                member = self._registry.members.get(node)
                if member is None or not member.alive:
                    continue
                member.alive = False
                self._detector.forget(node)
                log.warning("scheduler: %s evicted after failed audits", node)
                await self._to_router.send(RingNote("audit", f"{node} evicted after failed audits"))
                await self._problems_send.send(NodeDead(node, self._clock()))
                await abandon(member.conn)

    # --- the watchdog and the recoverer ---------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            if self._ring_faults is not None:
                nursery.start_soon(self._own_link_faults, self._ring_faults)
            if self._own_copies is not None:
                nursery.start_soon(self._own_link_copies, self._own_copies)
            if self._spot_outcomes is not None:
                nursery.start_soon(self._spot_outcome, self._spot_outcomes)
            if self.formation is not None:
                nursery.start_soon(self._keep_mesh, self.formation)
            task_status.started()
            async with self._problems:
                async for problem in self._problems:
                    if isinstance(problem, NodeDead):
                        await self._splicer.recover(problem)
                    elif isinstance(problem, LinkLost):
                        nursery.start_soon(self._relink_later, problem)
                    elif isinstance(problem, Rejoin):
                        await self._splicer.rejoin(problem)
                    elif isinstance(problem, Joined):
                        await self._splicer.late()
                    else:
                        await self._splicer.relink(problem)

    async def _watch(self) -> None:
        """Ask the failure detector each heartbeat: a silent member is suspected (an event),
        then dead (a ``NodeDead``). The detector credits this loop's own lateness (a blocked
        event loop, a loaded host) to nobody: heartbeats waiting unread are not silence."""
        while True:
            for seen in self._detector.tick(self._clock()):
                member = self._registry.members.get(NodeName(seen.node))
                if member is None or not member.alive:
                    continue
                how = f"silent for {seen.silence_s:.2f} s"
                lag = f"phi {seen.phi:.1f}, scheduler lag {self._detector.lag_s:.2f} s"
                if seen.state != "dead":
                    what = "suspected" if seen.state == "suspect" else "no longer suspected"
                    log.warning("scheduler: %s %s (%s, %s)", member.node, what, how, lag)
                    await self._to_router.send(
                        RingNote("suspect", f"{member.node} {what} ({how}, {lag})")
                    )
                    continue
                member.alive = False
                self._detector.forget(member.node)
                log.warning(
                    "scheduler: %s %s: dead (%s; %s)", member.node, how, lag, seen.confirmed_by
                )
                await self._problems_send.send(NodeDead(member.node, member.last_seen))
                await abandon(member.conn)  # frozen: do not wait for its close
            await trio.sleep(self._policy.heartbeat_s)

    async def _keep_mesh(self, formation: Formation) -> None:
        """Once the ring formed, measure the mesh again every ``remeasure_s``, so a re-plan
        after a death uses round trips as they are now; what changed goes to the router."""
        await formation.wait_formed()
        notes = formation.formed_notes
        while True:
            for note in notes:
                await self._to_router.send(RingNote("mesh", note))
            if formation.remeasure_s <= 0:
                return
            await trio.sleep(formation.remeasure_s)
            notes = await formation.remeasure()

    async def _beat(self, member: Member) -> None:
        """Heartbeats to one member, in its own task: a member whose socket stopped draining
        blocks only this task, never the watchdog (and a send is never cut mid-frame)."""
        try:
            while member.alive:
                await member.conn.send(Heartbeat(node=self._node, sent_at=time.time()))
                await trio.sleep(self._policy.heartbeat_s)
        except TransportError:
            return  # its serve task sees the close

    async def _redial_return(self, member: Member) -> None:
        """A tail registered: if its return link is not up (this coordinator restarted while
        the ring stayed warm), have it re-dial this coordinator."""
        await trio.sleep(self._policy.heartbeat_s)
        if self._return_up() or not member.alive:
            return
        await self._to_router.send(
            RingNote("join", f"asking {member.node} to re-dial the return link")
        )
        try:
            order = Rewire(self._registry.return_address, False)
            await member.order(order, timeout_s=self._policy.splice_timeout_s)
        except (RecoveryFailed, trio.TooSlowError) as exc:
            log.warning("scheduler: %s could not re-dial the return link: %s", member.node, exc)

    async def _relink_later(self, problem: LinkLost) -> None:
        # A dead successor also breaks the edge into it; give the watchdog the time to say so.
        await trio.sleep(self._policy.dead_after_s + self._policy.heartbeat_s)
        registry = self._registry
        if registry.successor_of(problem.node) == problem.successor and registry.alive(
            problem.successor
        ):
            await self._problems_send.send(Relink(problem.node, problem.successor, problem.at))


__all__ = [
    "Recovery",
    "Scheduler",
    "SchedulerStatistics",
    "Slot",
]
