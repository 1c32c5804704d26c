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
- ``relink`` — an edge between live nodes broke: re-dial the same edge (no replay: the
  successor's KV is intact), then resume.

No standby in time, or an order that fails: the ring is lost (``RingLost``), and the requests
fail with the tokens they committed. The router hears ``Pause``, ``Resume`` and ``RingLost``
on its control channel; each repair's timings go into ``recoveries``.
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
            with trio.fail_after(self._policy.splice_timeout_s):
                await self._splice(i, standby)
        except (RecoveryFailed, trio.TooSlowError) as exc:
            detail = str(exc) or f"splice took longer than {self._policy.splice_timeout_s:g} s"
            await self._give_up(slot.name, dead, at, started, detail)
            return
        reg.fenced[dead] = standby.node
        if self._replanner is not None:
            self._replanner.spliced(dead, standby.node)
        done = self._clock()
        self.recoveries.append(
            Recovery(slot.name, dead, standby.node, kind, started - at, done - started, done - at)
        )
        detail = (
            f"{standby.node} replaced {dead} ({kind}) in {done - at:.3f} s "
            f"(detected {started - at:.3f} s, spliced {done - started:.3f} s)"
        )
        log.warning("scheduler: %s", detail)
        spliced = Spliced(slot.first, slot.last, dead, standby.node)
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
        slot, started = reg.slots[i], self._clock()
        await self._to_router.send(
            Pause(f"{node} is back and was not replaced; taking it back into {slot.name}")
        )
        try:
            await self._rewire(node, reg.address_after(i), replay=False)
            await self._rewire(reg.predecessor_of(i), slot.address, replay=True)
        except (RecoveryFailed, trio.TooSlowError) as exc:
            await self._give_up(slot.name, node, at, started, str(exc) or "rejoin timed out")
            return
        done = self._clock()
        self.recoveries.append(
            Recovery(slot.name, node, node, "rejoin", started - at, done - started, done - at)
        )
        detail = (
            f"{node} rejoined its slot {slot.name} (not replaced) {done - at:.3f} s after it "
            f"was lost (re-synced in {done - started:.3f} s)"
        )
        log.warning("scheduler: %s", detail)
        await self._to_router.send(Resume(detail))

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
        await self._rewire(reg.predecessor_of(i), slot.address, replay=True)

    async def _give_up(
        self, slot: NodeName, lost: NodeName, at: float, started: float, detail: str
    ) -> None:
        done = self._clock()
        self.recoveries.append(
            Recovery(slot, lost, None, "failed", started - at, done - started, done - at, detail)
        )
        await self._to_router.send(
            RingLost(f"{lost} lost and the ring could not be repaired: {detail}")
        )

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


__all__ = ["Recovery", "Splicer"]
