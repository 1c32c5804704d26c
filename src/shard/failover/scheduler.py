"""Scheduler: the control plane in the coordinator's process — who is alive, who holds which
ring slot, and what to do when a node dies.

Every stage and standby keeps a control link to the scheduler (``shard.failover.control``): it
registers, then heartbeats. A node whose link closes is dead; one that goes silent is first
suspected, then dead, as the failure detector (``shard.failover.detector``) judges the silence
against the node's measured heartbeat gaps and net of this scheduler's own loop lag.
Recovery, one at a time:

- **a ring node died** — pause the requests, pick a standby holding the same block (hot), else
  a spare that loads it (cold), else wait ``join_deadline_s`` for one to register; ``Activate``
  it (it dials the dead node's successor), then ``Rewire`` the dead node's predecessor to it
  with replay, so the standby rebuilds every live session's KV from the predecessor's log
  (stage 0: the coordinator's own link replays token ids). The ring resumes: each request
  bumps its epoch and re-sends from its committed tokens. No standby in time: the requests
  fail with the committed tokens (``RingError``), never a silent stop.
- **a node declared dead but not replaced registers again** (it was frozen, or restarted) —
  it is taken back into its slot, re-synced from its predecessor's replay log like a standby,
  and the requests resume. Only a node whose slot another node really holds is refused.
- **a ring edge broke between live nodes** (a severed connection, a corrupt frame) — after a
  grace period, if the successor is still alive and still in place, re-dial the same edge
  (no replay: the successor's KV is intact) and resync the requests.

Timings of each recovery (detection, splice, total) are kept in ``statistics().recoveries``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from shard.failover.detector import FailureDetector
from shard.failover.edge import DownstreamLink
from shard.failover.rtt import RttTracker
from shard.messages import (
    Activate,
    Fault,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    ProbeReply,
    Ready,
    Register,
    Rewire,
)
from shard.spec.failover import FailoverSpec
from shard.transport import Connection, TransportError, abandon

log = logging.getLogger(__name__)

_NO_BLOCK = (-1, -1)


@attrs.define
class Slot:
    """One ring position: the spec's stage name, its block, and who holds it now."""

    name: NodeName
    first: int
    last: int
    holder: NodeName
    address: str


@attrs.frozen
class Recovery:
    """One recovery: what died, who replaced it, and how long each part took (seconds).

    ``kind``: ``hot`` / ``cold`` (a standby with / without the block spliced in for ``lost``),
    ``rejoin`` (``lost`` was declared dead, was not replaced, and came back into its slot),
    ``relink`` (the edge from ``lost`` — alive — to ``replacement`` was re-dialled; ``slot`` is
    the successor's), ``failed`` (``detail`` says why). ``detect_s`` runs from the failure
    (last heartbeat, closed link, reported fault) to the start of the repair; for a relink it
    includes the grace period that lets a dead successor be found first.
    """

    slot: NodeName
    lost: NodeName
    replacement: NodeName | None
    kind: str  # "hot" | "cold" | "rejoin" | "relink" | "failed"
    detect_s: float
    splice_s: float
    total_s: float
    detail: str = ""


@attrs.frozen
class SchedulerStatistics:
    members: tuple[tuple[NodeName, str, bool], ...]  # (node, role, alive)
    slots: tuple[tuple[NodeName, NodeName], ...]  # (slot, holder)
    standbys: tuple[NodeName, ...]
    recoveries: tuple[Recovery, ...]
    #: (node, median control-link round trip in seconds, None until measured)
    rtt_s: tuple[tuple[NodeName, float | None], ...] = ()


@attrs.define
class _Member:
    node: NodeName
    role: str
    address: str
    first: int
    last: int
    conn: Connection
    last_seen: float
    alive: bool = True
    replies: trio.MemoryReceiveChannel[Ready] | None = None
    rtt: RttTracker = attrs.field(kw_only=True)


class RingHooks(Protocol):
    """What the scheduler asks of the coordinator (``shard.coordinator.router.Coordinator`` has
    it)."""

    def pause(self, detail: str) -> None: ...

    async def resume(self, detail: str) -> None: ...

    async def fail(self, detail: str) -> None: ...

    def event(self, kind: str, detail: str) -> None: ...


class Scheduler:
    """See the module docstring. ``serve`` handles one control connection; ``run`` watches
    heartbeats and carries out recoveries."""

    def __init__(
        self,
        *,
        node: NodeName,
        slots: Sequence[Slot],
        return_address: str,
        ring_link: DownstreamLink | None,
        hooks: RingHooks,
        policy: FailoverSpec = FailoverSpec(),
        clock: Callable[[], float] = trio.current_time,
        return_up: Callable[[], bool] = lambda: True,
    ) -> None:
        """``policy`` is the spec's ``[failover]`` record, taken as is. ``return_up`` says
        whether a tail's return link is connected now: a tail that registers while it is not
        (this coordinator restarted) is told to re-dial it."""
        self._return_up = return_up
        self._node = node
        self._slots = list(slots)
        self._return_address = return_address
        self._ring_link = ring_link
        self._hooks = hooks
        self._policy = policy
        self._clock = clock
        self._members: dict[NodeName, _Member] = {}
        self._fenced: dict[NodeName, NodeName] = {}  # replaced node -> who took its slot
        self._detector = FailureDetector(policy)
        self._problems_send, self._problems = trio.open_memory_channel[
            tuple[str, NodeName, NodeName | None, float]
        ](64)
        self._joined = trio.Event()
        self._recoveries: list[Recovery] = []
        self._nursery: trio.Nursery | None = None

    # --- views -------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            members=tuple((m.node, m.role, m.alive) for m in self._members.values()),
            slots=tuple((s.name, s.holder) for s in self._slots),
            standbys=self.standbys(),
            recoveries=tuple(self._recoveries),
            rtt_s=tuple((m.node, m.rtt.rtt_s) for m in self._members.values()),
        )

    def standbys(self) -> tuple[NodeName, ...]:
        return tuple(m.node for m in self._members.values() if m.alive and m.role == "standby")

    def ring(self) -> tuple[NodeName, ...]:
        """Node names from the coordinator to the tail, as the ring stands now."""
        return (self._node, *(s.holder for s in self._slots))

    def tail(self) -> NodeName:
        """The node that may open the return link now."""
        return self._slots[-1].holder

    # --- control links -------------------------------------------------------------------

    async def serve(self, conn: Connection, hello: Hello) -> None:
        """One node's control link, from its ``Register`` until it closes. A peer that sends
        anything else first, or nothing, is told why and closed; nothing else is affected."""
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
        replaced_by = self._replaced_by(first)
        if replaced_by is not None:
            # Its slot is held by another: a node that wakes up later must not rejoin with
            # stale sessions. It can restart as a standby under a new name.
            detail = f"{first.node} was replaced by {replaced_by}"
            await conn.send(Fault(self._node, "control", detail))
            return
        replies_send, replies = trio.open_memory_channel[Ready](4)
        member = _Member(
            first.node,
            first.role,
            first.address,
            first.first,
            first.last,
            conn,
            self._clock(),
            replies=replies,
            rtt=RttTracker(conn, interval_s=self._policy.probe_s, clock=self._clock),
        )
        old = self._members.get(first.node)
        self._members[first.node] = member
        self._detector.watch(member.node, member.last_seen)
        if old is not None:
            await abandon(old.conn)
        for slot in self._slots:
            claims = member.role == "stage" and slot.name == first.slot
            if claims and (slot.holder == member.node or not self._alive(slot.holder)):
                # the ring as it stands (a standby spliced in before this coordinator
                # started); a live holder is never displaced by a claim
                slot.holder = member.node
            if slot.holder == member.node:
                slot.address = member.address
        if member.node == self.tail() and self._nursery is not None:
            self._nursery.start_soon(self._redial_return, member)
        self._hooks.event("join", f"{member.node} ({member.role}) registered")
        if old is not None and not old.alive and self._slot_of(member.node) is not None:
            # declared dead, not replaced (it still holds its slot): take it back
            await self._problems_send.send(("rejoin", member.node, None, old.last_seen))
        self._joined.set()
        self._joined = trio.Event()
        reason = "control link closed"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._beat, member)
                nursery.start_soon(member.rtt.run)
                try:
                    while True:
                        msg = await conn.receive()
                        member.last_seen = self._clock()
                        beat = isinstance(msg, Heartbeat)
                        self._detector.heard(member.node, member.last_seen, heartbeat=beat)
                        if isinstance(msg, Ready):
                            await replies_send.send(msg)
                        elif isinstance(msg, ProbeReply):
                            member.rtt.on_reply(msg)
                        elif isinstance(msg, Fault):
                            self._hooks.event("fault", f"{msg.node}: {msg.kind}: {msg.detail}")
                            if msg.kind == "link":
                                await self.link_fault(member.node)
                        elif not isinstance(msg, Heartbeat):
                            log.warning("scheduler: unexpected %s from %s", msg, member.node)
                except TransportError as exc:
                    reason = f"control link closed: {exc}"
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if self._members.get(member.node) is member and member.alive:
                member.alive = False
                self._detector.forget(member.node)
                log.warning("scheduler: %s is dead (%s)", member.node, reason)
                try:
                    self._problems_send.send_nowait(("dead", member.node, None, self._clock()))
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    log.warning("scheduler: not running; %s's loss is not acted on", member.node)

    async def link_fault(self, node: NodeName) -> None:
        """``node``'s downstream edge failed (``node`` may be this coordinator)."""
        successor = self._successor_of(node)
        if successor is not None:
            self._detector.corroborate(successor, f"{node} reported the edge into it broken")
            await self._problems_send.send(("link", node, successor, self._clock()))

    # --- the watchdog and the recoverer ---------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._watch)
            task_status.started()
            async with self._problems:
                async for kind, node, successor, at in self._problems:
                    if kind == "dead":
                        await self._recover(node, at)
                    elif kind == "link":
                        nursery.start_soon(self._relink_later, node, successor, at)
                    elif kind == "relink":
                        await self._relink(node, successor, at)
                    elif kind == "rejoin":
                        await self._rejoin(node, at)

    async def _watch(self) -> None:
        while True:
            for seen in self._detector.tick(self._clock()):
                member = self._members.get(NodeName(seen.node))
                if member is None or not member.alive:
                    continue
                how = f"silent for {seen.silence_s:.2f} s"
                lag = f"phi {seen.phi:.1f}, scheduler lag {self._detector.lag_s:.2f} s"
                if seen.state != "dead":
                    what = "suspected" if seen.state == "suspect" else "no longer suspected"
                    log.warning("scheduler: %s %s (%s, %s)", member.node, what, how, lag)
                    self._hooks.event("suspect", f"{member.node} {what} ({how}, {lag})")
                    continue
                member.alive = False
                self._detector.forget(member.node)
                log.warning(
                    "scheduler: %s %s: dead (%s; %s)", member.node, how, lag, seen.confirmed_by
                )
                await self._problems_send.send(("dead", member.node, None, member.last_seen))
                await abandon(member.conn)  # frozen: do not wait for its close
            await trio.sleep(self._policy.heartbeat_s)

    async def _beat(self, member: _Member) -> None:
        """Heartbeats to one member, in its own task: a member whose socket stopped draining
        blocks only this task, never the watchdog (and a send is never cut mid-frame)."""
        try:
            while member.alive:
                await member.conn.send(Heartbeat(node=self._node, sent_at=time.time()))
                await trio.sleep(self._policy.heartbeat_s)
        except TransportError:
            return  # its serve task sees the close

    async def _redial_return(self, member: _Member) -> None:
        """A tail registered: if its return link is not up (this coordinator restarted while
        the ring stayed warm), have it re-dial this coordinator."""
        await trio.sleep(self._policy.heartbeat_s)
        if self._return_up() or not member.alive:
            return
        self._hooks.event("join", f"asking {member.node} to re-dial the return link")
        try:
            await self._order(member, Rewire(self._return_address, False))
        except (_RecoveryFailed, trio.TooSlowError) as exc:
            log.warning("scheduler: %s could not re-dial the return link: %s", member.node, exc)

    def _slot_of(self, node: NodeName) -> int | None:
        for i, slot in enumerate(self._slots):
            if slot.holder == node:
                return i
        return None

    def _successor_of(self, node: NodeName) -> NodeName | None:
        if node == self._node:
            return self._slots[0].holder
        i = self._slot_of(node)
        if i is None:
            return None
        return self._slots[i + 1].holder if i + 1 < len(self._slots) else self._node

    def _address_after(self, i: int) -> str:
        return self._slots[i + 1].address if i + 1 < len(self._slots) else self._return_address

    async def _relink_later(self, node: NodeName, successor: NodeName | None, at: float) -> None:
        # A dead successor also breaks the edge into it; give the watchdog the time to say so.
        await trio.sleep(self._policy.dead_after_s + self._policy.heartbeat_s)
        if self._successor_of(node) == successor and self._alive(successor):
            await self._problems_send.send(("relink", node, successor, at))

    def _alive(self, node: NodeName | None) -> bool:
        if node == self._node:
            return True
        member = self._members.get(node) if node is not None else None
        return member is not None and member.alive

    async def _relink(self, node: NodeName, successor: NodeName | None, at: float) -> None:
        if self._successor_of(node) != successor or not self._alive(successor):
            return
        i = self._slot_of(node) if node != self._node else -1
        if i is None:
            return
        address = self._address_after(i) if i >= 0 else self._slots[0].address
        started = self._clock()
        self._hooks.pause(f"edge {node} -> {successor} broke; re-dialling")
        try:
            await self._rewire(node, address, replay=False)
        except _RecoveryFailed as exc:
            await self._give_up(node, successor or node, at, started, str(exc))
            return
        done = self._clock()
        self._recoveries.append(
            Recovery(
                NodeName(successor or ""),
                node,
                successor,
                "relink",
                started - at,
                done - started,
                done - at,
            )
        )
        await self._hooks.resume(f"edge {node} -> {successor} re-dialled in {done - started:.3f} s")

    async def _recover(self, dead: NodeName, at: float) -> None:
        i = self._slot_of(dead)
        member = self._members.get(dead)
        if i is None:
            if member is not None and member.role == "standby":
                self._hooks.event("fault", f"standby {dead} lost")
            return
        slot = self._slots[i]
        started = self._clock()
        self._hooks.pause(f"{dead} (layers {slot.first}..{slot.last}) lost; splicing a standby")
        try:
            picked = await self._pick_standby(slot)
            if picked is None:
                return  # it registered again: its queued rejoin takes it back (_rejoin)
            standby, kind = picked
            with trio.fail_after(self._policy.splice_timeout_s):
                order = Activate(slot.name, slot.first, slot.last, self._address_after(i))
                slot_holder_before = slot.holder
                slot.holder = standby.node  # the return link must accept it if it is the tail
                try:
                    await self._order(standby, order)
                except _RecoveryFailed:
                    slot.holder = slot_holder_before
                    raise
                slot.address = standby.address
                standby.role = "stage"
                predecessor = self._slots[i - 1].holder if i > 0 else self._node
                await self._rewire(predecessor, standby.address, replay=True)
        except (_RecoveryFailed, trio.TooSlowError) as exc:
            detail = str(exc) or f"splice took longer than {self._policy.splice_timeout_s:g} s"
            await self._give_up(slot.name, dead, at, started, detail)
            return
        self._fenced[dead] = standby.node
        done = self._clock()
        self._recoveries.append(
            Recovery(slot.name, dead, standby.node, kind, started - at, done - started, done - at)
        )
        detail = (
            f"{standby.node} replaced {dead} ({kind}) in {done - at:.3f} s "
            f"(detected {started - at:.3f} s, spliced {done - started:.3f} s)"
        )
        log.warning("scheduler: %s", detail)
        await self._hooks.resume(detail)

    async def _rejoin(self, node: NodeName, at: float) -> None:
        """``node`` was declared dead (at ``at``), nobody took its slot, and it registered
        again: take it back. Its own edge is re-dialled to its successor (no replay: the
        successor's KV is intact), then its predecessor's edge into it with replay, so its KV
        is rebuilt from the log exactly as a standby's would be (a node that only froze keeps
        its KV and recomputes the same values); then the requests resync."""
        i = self._slot_of(node)
        if i is None or not self._alive(node):
            return
        slot, started = self._slots[i], self._clock()
        self._hooks.pause(f"{node} is back and was not replaced; taking it back into {slot.name}")
        predecessor = self._slots[i - 1].holder if i > 0 else self._node
        try:
            await self._rewire(node, self._address_after(i), replay=False)
            await self._rewire(predecessor, slot.address, replay=True)
        except (_RecoveryFailed, trio.TooSlowError) as exc:
            await self._give_up(slot.name, node, at, started, str(exc) or "rejoin timed out")
            return
        done = self._clock()
        self._recoveries.append(
            Recovery(slot.name, node, node, "rejoin", started - at, done - started, done - at)
        )
        detail = (
            f"{node} rejoined its slot {slot.name} (not replaced) {done - at:.3f} s after it "
            f"was lost (re-synced in {done - started:.3f} s)"
        )
        log.warning("scheduler: %s", detail)
        await self._hooks.resume(detail)

    def _replaced_by(self, reg: Register) -> NodeName | None:
        """Who holds the slot ``reg``'s node was replaced in, if it was: a node declared dead
        whose slot another took, or a stage claiming a slot another live node holds."""
        if reg.node in self._fenced:
            return self._fenced[reg.node]
        for slot in self._slots:
            if reg.role == "stage" and slot.name == reg.slot and slot.holder != reg.node:
                return slot.holder if self._alive(slot.holder) else None
        return None

    async def _give_up(
        self, slot: NodeName, lost: NodeName, at: float, started: float, detail: str
    ) -> None:
        done = self._clock()
        self._recoveries.append(
            Recovery(slot, lost, None, "failed", started - at, done - started, done - at, detail)
        )
        await self._hooks.fail(f"{lost} lost and the ring could not be repaired: {detail}")

    async def _pick_standby(self, slot: Slot) -> tuple[_Member, str] | None:
        """A live standby for ``slot`` (hot, else cold), waiting for one to register; None
        once the slot's own (dead) holder has registered again."""
        deadline = self._clock() + self._policy.join_deadline_s
        while True:
            if self._alive(slot.holder):
                return None
            live = [m for m in self._members.values() if m.alive and m.role == "standby"]
            for m in live:
                if (m.first, m.last) == (slot.first, slot.last):
                    return m, "hot"
            for m in live:
                if (m.first, m.last) == _NO_BLOCK:
                    return m, "cold"
            wait = deadline - self._clock()
            if wait <= 0:
                raise _RecoveryFailed(
                    f"no standby for layers {slot.first}..{slot.last} registered within "
                    f"{self._policy.join_deadline_s:g} s (failover.join_deadline_s)"
                )
            self._hooks.event("fault", f"waiting up to {wait:.0f} s for a standby to join")
            with trio.move_on_after(wait):
                await self._joined.wait()

    async def _rewire(self, node: NodeName, address: str, *, replay: bool) -> None:
        if node == self._node:
            if self._ring_link is None:
                raise _RecoveryFailed("this coordinator has no ring link to rewire")
            try:
                await self._ring_link.rewire(address, replay=replay)
            except TransportError as exc:
                raise _RecoveryFailed(str(exc)) from exc
            return
        member = self._members.get(node)
        if member is None or not member.alive:
            raise _RecoveryFailed(f"{node} is not reachable to rewire")
        await self._order(member, Rewire(address, replay))

    async def _order(self, member: _Member, order: Activate | Rewire) -> None:
        assert member.replies is not None
        try:
            await member.conn.send(order)
        except TransportError as exc:
            raise _RecoveryFailed(f"{member.node}: {exc}") from exc
        with trio.fail_after(self._policy.splice_timeout_s):
            # The member's serve task forwards its Ready; replies are in order per member.
            reply = await member.replies.receive()
        if not reply.ok:
            raise _RecoveryFailed(f"{member.node}: {reply.action} failed: {reply.detail}")


class _RecoveryFailed(Exception):
    pass


__all__ = ["Recovery", "RingHooks", "Scheduler", "SchedulerStatistics", "Slot"]
