"""Splicing: the scheduler's repairs of the ring, one at a time (``shard.failover.scheduler``
queues them).

- ``recover`` — a ring node died: pause the requests, pick a standby holding the same block
  (hot), else a spare that loads it (cold), else wait ``join_deadline_s`` for one to register;
  ``Activate`` it (it dials the dead node's successor), then ``Rewire`` the dead node's
  predecessor to it with replay, so the standby rebuilds every live session's KV from the
  predecessor's log (stage 0: the coordinator's own link replays token ids). Then resume.
- ``rejoin`` — a node declared dead but not replaced registered again (it froze, or
  restarted): its own edge is re-dialled, then its predecessor's into it with replay, as for
  a standby; then resume. Only a node whose slot another really holds is refused.
  A node that comes back idle (a ``--join`` node restarted: it registers as a standby) is
  activated into its slot instead, as a standby would be.
- ``relink`` — an edge between live nodes broke: re-dial the same edge (no replay: the
  successor's KV is intact), then resume.
- ``late`` — a slot still waits for a node (below) and one registered: splice the first
  that can hold the block (a standby of it, a spare that loads it, or the lost node back).

No standby in time, or an order that fails: the ring is lost (``RingLost``), and the requests
fail with the tokens they committed. A slot whose holder is dead stays open (``waiting``)
however long it takes: the ring is down, not dead, and the router hears ``Resume`` once a
node that can hold the block has been spliced in. The router hears ``Pause``, ``Resume`` and
``RingLost`` on its control channel; each repair's timings go into ``recoveries``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from shard.failover.edge import DownstreamLink
from shard.failover.events import (
    NodeDead,
    Pause,
    Rejoin,
    Relink,
    Resume,
    RingControl,
    RingLost,
    RingNote,
    Spliced,
)
from shard.logs import NOTE
from shard.membership.registry import NO_BLOCK, Member, RecoveryFailed, Registry, Slot
from shard.messages import Activate, NodeName, Rewire
from shard.spec.failover import FailoverSpec
from shard.transport import TransportError

log = logging.getLogger(__name__)


@attrs.frozen
class Recovery:
    """One recovery: what died, who replaced it, and how long each part took (seconds).

    ``kind``: ``hot`` / ``cold`` (a standby with / without the block spliced in for ``lost``),
    ``rejoin`` (``lost`` was declared dead, was not replaced, and came back into its slot),
    ``relink`` (the edge from ``lost`` — alive — to ``replacement`` was re-dialled; ``slot`` is
    the successor's), ``failed`` (``detail`` says why; the requests of the moment failed),
    ``late`` (a slot given up on — a ``failed`` before it — was repaired once a node came:
    ``detail`` starts with how, ``hot`` / ``cold`` / ``rejoin``). ``detect_s`` runs from the
    failure (last heartbeat, closed link, reported fault) to the start of the repair; for a
    relink it includes the grace period that lets a dead successor be found first, for a late
    repair the whole wait. ``total_s`` is how long the slot was out of the ring.
    """

    slot: NodeName
    lost: NodeName
    replacement: NodeName | None
    kind: str  # "hot" | "cold" | "rejoin" | "relink" | "failed" | "late"
    detect_s: float
    splice_s: float
    total_s: float
    detail: str = ""


@attrs.frozen
class Waiting:
    """A ring slot whose holder died and that no node took in time: it stays open, and the
    first node that registers and can hold ``[first, last)`` is spliced in (``Splicer.late``).
    ``at``: when ``lost`` was lost."""

    slot: NodeName
    first: int
    last: int
    lost: NodeName
    at: float

    def describe(self) -> str:
        return (
            f"layers [{self.first}, {self.last}) lost with {self.lost}; waiting for a node that "
            f"can hold them (a standby of that block, a spare, or {self.lost} back)"
        )


class Replanner(Protocol):
    """Which live standby takes a slot whose holder died (None: none can, wait for one), and
    what follows once it has: a formed swarm's re-plan (``shard.formation``)."""

    def choose(self, slot: Slot, live: Sequence[Member]) -> Member | None: ...

    def spliced(self, dead: NodeName, standby: NodeName) -> None: ...


class Splicer:
    """Carries out repairs on the registry's ring (see the module docstring).

    Not an actor: the scheduler's problem loop calls it, one repair at a time, and waits for
    each to finish before the next (a repair must see the ring the last one left).
    ``replanner`` replaces the default pick (a standby holding the block, else any spare).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        ring_link: DownstreamLink | None,
        to_router: trio.MemorySendChannel[RingControl],
        policy: FailoverSpec,
        clock: Callable[[], float],
        replanner: Replanner | None = None,
    ) -> None:
        self._replanner = replanner
        self._registry = registry
        self._ring_link = ring_link
        self._to_router = to_router
        self._policy = policy
        self._clock = clock
        self.recoveries: list[Recovery] = []
        #: slots given up on, by name, until a node that can hold their block is spliced in
        self.waiting: dict[NodeName, Waiting] = {}

    async def relink(self, problem: Relink) -> None:
        reg, node, successor, at = self._registry, problem.node, problem.successor, problem.at
        if reg.successor_of(node) != successor or not reg.alive(successor):
            return
        i = reg.slot_of(node) if node != reg.node else -1
        if i is None:
            return
        address = reg.address_after(i) if i >= 0 else reg.slots[0].address
        started = self._clock()
        await self._to_router.send(Pause(f"edge {node} -> {successor} broke; re-dialling"))
        try:
            await self._rewire(node, address, replay=False)
        except RecoveryFailed as exc:
            await self._give_up(node, successor, at, started, str(exc))
            return
        done = self._clock()
        self.recoveries.append(
            Recovery(successor, node, successor, "relink", started - at, done - started, done - at)
        )
        await self._to_router.send(
            Resume(f"edge {node} -> {successor} re-dialled in {done - started:.3f} s")
        )

    async def recover(self, problem: NodeDead) -> None:
        reg, dead, at = self._registry, problem.node, problem.at
        i = reg.slot_of(dead)
        member = reg.members.get(dead)
        if i is None:
            if member is not None and member.role in ("standby", "auditor"):
                await self._to_router.send(RingNote("fault", f"{member.role} {dead} lost"))
            return
        slot = reg.slots[i]
        started = self._clock()
        await self._to_router.send(
            Pause(f"{dead} (layers {slot.first}..{slot.last}) lost; splicing a standby")
        )
        try:
            picked = await self._pick_standby(slot)
            if picked is None:
                return  # it registered again: its queued Rejoin takes it back (rejoin)
            standby, kind = picked
            await self._splice_within(i, standby)
        except (RecoveryFailed, trio.TooSlowError) as exc:
            detail = str(exc) or f"splice took longer than {self._policy.splice_timeout_s:g} s"
            await self._give_up(slot.name, dead, at, started, detail)
            return
        await self._replaced(slot, dead, standby, kind, at, started)

    async def late(self) -> None:
        """A node registered while slots wait (``waiting``): splice into each the first live
        node that can hold its block now (hot, else cold; with a re-planner, its choice).
        One that cannot be spliced keeps its slot waiting."""
        reg = self._registry
        for name, waiting in list(self.waiting.items()):
            i = next((j for j, s in enumerate(reg.slots) if s.name == name), None)
            if i is None or reg.alive(reg.slots[i].holder):
                del self.waiting[name]  # taken meanwhile (its holder came back: a rejoin)
                continue
            slot = reg.slots[i]
            picked = self._pick_now(slot)
            if picked is None:
                able = ", ".join(reg.standbys()) or "none"
                log.info("scheduler: still %s (live standbys: %s)", waiting.describe(), able)
                continue
            standby, kind = picked
            started = self._clock()
            await self._to_router.send(
                Pause(f"{standby.node} joined; splicing it into {name}'s slot ({kind})")
            )
            try:
                await self._splice_within(i, standby)
            except (RecoveryFailed, trio.TooSlowError) as exc:
                detail = str(exc) or "splice timed out (failover.splice_timeout_s)"
                await self._give_up(name, waiting.lost, waiting.at, started, detail)
                continue
            await self._replaced(slot, waiting.lost, standby, kind, waiting.at, started)

    async def _splice_within(self, i: int, standby: Member) -> None:
        with trio.fail_after(self._policy.splice_timeout_s):
            await self._splice(i, standby)

    async def _replaced(
        self, slot: Slot, dead: NodeName, standby: Member, kind: str, at: float, started: float
    ) -> None:
        """``standby`` holds ``slot`` now (``dead`` lost it at ``at``): fence ``dead`` off,
        record the recovery (``late`` for a slot that was given up on) and resume."""
        self._registry.fenced[dead] = standby.node
        done = self._clock()
        late = self.waiting.pop(slot.name, None) is not None
        detail = (
            f"{standby.node} replaced {dead} ({kind}) in {done - at:.3f} s "
            f"(detected {started - at:.3f} s, spliced {done - started:.3f} s)"
        )
        if late:
            detail = (
                f"{standby.node} replaced {dead} ({kind}, late) {done - at:.3f} s after it was lost"
            )
        self.recoveries.append(
            Recovery(
                slot.name, dead, standby.node, "late" if late else kind, started - at,
                done - started, done - at, f"{kind}: {detail}" if late else "",
            )
        )  # fmt: skip
        log.log(NOTE, "scheduler: %s", detail)
        spliced = Spliced(slot.first, slot.last, dead, standby.node)
        await self._resume(detail, spliced)

    async def _resume(self, detail: str, spliced: Spliced | None = None) -> None:
        """The ring is whole again — unless other slots still wait (the ring stays down).
        ``spliced``: the standby put in a dead node's place, for the run receipts."""
        if self.waiting:
            still = "; ".join(w.describe() for w in self.waiting.values())
            await self._to_router.send(RingLost(f"{detail}; still {still}"))
            return
        await self._to_router.send(Resume(detail, spliced))

    async def rejoin(self, problem: Rejoin) -> None:
        """``node`` was declared dead (at ``at``), nobody took its slot, and it registered
        again: take it back. Its own edge is re-dialled to its successor (no replay: the
        successor's KV is intact), then its predecessor's edge into it with replay, so its KV
        is rebuilt from the log exactly as a standby's would be (a node that only froze keeps
        its KV and recomputes the same values); then the requests resync."""
        reg, node, at = self._registry, problem.node, problem.at
        i = reg.slot_of(node)
        if i is None or not reg.alive(node):
            return
        slot, started, member = reg.slots[i], self._clock(), reg.members[node]
        idle = member.role != "stage"  # it came back serving nothing (a restarted --join node)
        if idle and member.role != "standby":
            log.warning("scheduler: %s came back as %s: not taken into the ring", node, member.role)
            return
        await self._to_router.send(
            Pause(f"{node} is back and was not replaced; taking it back into {slot.name}")
        )
        try:
            if idle:  # activate it into its slot, as a standby
                await self._splice_within(i, member)
            else:
                await self._rewire(node, reg.address_after(i), replay=False)
                await self._rewire(reg.predecessor_of(i), slot.address, replay=True)
        except (RecoveryFailed, trio.TooSlowError) as exc:
            await self._give_up(slot.name, node, at, started, str(exc) or "rejoin timed out")
            return
        done = self._clock()
        late = self.waiting.pop(slot.name, None) is not None
        detail = (
            f"{node} rejoined its slot {slot.name} (not replaced{', late' if late else ''}) "
            f"{done - at:.3f} s after it was lost (re-synced in {done - started:.3f} s)"
        )
        self.recoveries.append(
            Recovery(
                slot.name, node, node, "late" if late else "rejoin", started - at,
                done - started, done - at, f"rejoin: {detail}" if late else "",
            )
        )  # fmt: skip
        log.log(NOTE, "scheduler: %s", detail)
        await self._resume(detail)

    async def _splice(self, i: int, standby: Member) -> None:
        """Put ``standby`` in slot ``i``: activate it, then rewire its predecessor to it."""
        reg = self._registry
        slot = reg.slots[i]
        behind_nat = standby.node in reg.behind_nat  # a joined node nobody reaches
        order = Activate(slot.name, slot.first, slot.last, reg.address_after(i), behind_nat)
        holder_before = slot.holder
        slot.holder = standby.node  # the return link must accept it if it is the tail
        try:
            await standby.order(order, timeout_s=self._policy.splice_timeout_s)
        except RecoveryFailed:
            slot.holder = holder_before
            raise
        slot.address = reg.dial_address(standby)
        standby.role = "stage"
        if self._replanner is not None:  # it holds the slot now, even if the rewire fails
            self._replanner.spliced(holder_before, standby.node)
        await self._rewire(reg.predecessor_of(i), slot.address, replay=True)

    async def _give_up(
        self, slot: NodeName, lost: NodeName, at: float, started: float, detail: str
    ) -> None:
        """The requests fail (``RingLost``); a slot whose holder is dead stays open for the
        next node that can hold its block (``waiting``), and the message says so."""
        done = self._clock()
        self.recoveries.append(
            Recovery(slot, lost, None, "failed", started - at, done - started, done - at, detail)
        )
        why = f"{lost} lost and the ring could not be repaired: {detail}"
        reg = self._registry
        i = next((j for j, s in enumerate(reg.slots) if s.name == slot), None)
        if i is not None and not reg.alive(reg.slots[i].holder):
            s = reg.slots[i]
            waiting = self.waiting.setdefault(slot, Waiting(slot, s.first, s.last, lost, at))
            why += f"; {waiting.describe()}: it is spliced in whenever it registers"
        log.warning("scheduler: %s", why)
        await self._to_router.send(RingLost(why))

    async def _pick_standby(self, slot: Slot) -> tuple[Member, str] | None:
        """A live standby for ``slot`` (hot, else cold), waiting for one to register; None
        once the slot's own (dead) holder has registered again."""
        deadline = self._clock() + self._policy.join_deadline_s
        while True:
            if self._registry.alive(slot.holder):
                return None
            picked = self._pick_now(slot)
            if picked is not None:
                return picked
            wait = deadline - self._clock()
            if wait <= 0:
                raise RecoveryFailed(
                    f"no standby for layers {slot.first}..{slot.last} registered within "
                    f"{self._policy.join_deadline_s:g} s (failover.join_deadline_s)"
                )
            await self._to_router.send(
                RingNote("fault", f"waiting up to {wait:.0f} s for a standby to join")
            )
            with trio.move_on_after(wait):
                await self._registry.wait_joined()

    def _pick_now(self, slot: Slot) -> tuple[Member, str] | None:
        live = self._registry.live_standbys()
        hot = [m for m in live if (m.first, m.last) == (slot.first, slot.last)]
        if self._replanner is not None:
            chosen = self._replanner.choose(slot, live)
            return None if chosen is None else (chosen, "hot" if chosen in hot else "cold")
        if hot:
            return hot[0], "hot"
        for m in live:
            if (m.first, m.last) == NO_BLOCK:
                return m, "cold"
        return None

    async def _rewire(self, node: NodeName, address: str, *, replay: bool) -> None:
        if node == self._registry.node:
            if self._ring_link is None:
                raise RecoveryFailed("this coordinator has no ring link to rewire")
            try:
                await self._ring_link.rewire(address, replay=replay)
            except TransportError as exc:
                raise RecoveryFailed(str(exc)) from exc
            return
        member = self._registry.members.get(node)
        if member is None or not member.alive:
            raise RecoveryFailed(f"{node} is not reachable to rewire")
        await member.order(Rewire(address, replay), timeout_s=self._policy.splice_timeout_s)


__all__ = ["Recovery", "Splicer", "Waiting"]
