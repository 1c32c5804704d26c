"""SpotChecker: the spot checks of a swarm that audits, an actor beside the scheduler.

The scheduler reads every control link; what concerns spot checks it sends here, on the
checker's inbox: each ring chunk a node copied (``Copied``: ``shard.transport.mirror``) and
each verdict an auditor sent back (``Answered``). The checker feeds the copies to the audit
hub (``shard.audit.hub``) and picks, for each audit it makes due, a live auditor, else a
standby, holding the audited block — from the scheduler's registry, a snapshot read
(``Roster``); none: the audit is skipped, warned once per cause, then at debug until one
holds it. A verdict is taken only as the answer to a request sent to its auditor; a failed
audit is a strike (``shard.audit.strikes``) with its evidence kept in a file
(``shard.audit.evidence_files``), and at ``audit.strikes`` the node is evicted. What the
scheduler must do goes back on the checker's outbox: send a request on an auditor's control
link (``Ask``; the checker has recorded it as asked first, so its verdict is taken), a line
for the router's events (``Noted``) and an eviction (``Evict``: the scheduler declares the
node dead and replaces it by a standby exactly as after a crash). The checker touches no
connection.

Its lines go to the scheduler's log (``shard.failover.scheduler``): they are the scheduler's
view of the swarm.
"""

from __future__ import annotations

import logging
from typing import Protocol

import attrs
import trio

from shard.audit.evidence_files import EvidenceShelf
from shard.audit.hub import AuditHub, Holder
from shard.audit.strikes import AuditStatistics, StrikeBook
from shard.messages import AuditCounts, NodeName
from shard.messages.audit import AuditCopy, AuditRequest, AuditVerdict
from shard.spec.audit import AuditSpec

__all__ = [
    "Answered",
    "Ask",
    "Auditor",
    "Copied",
    "Evict",
    "Noted",
    "Roster",
    "SpotChecker",
    "SpotEvent",
    "SpotOutcome",
]

log = logging.getLogger("shard.failover.scheduler")


@attrs.frozen
class Copied:
    """Scheduler -> checker: ``sender``'s copy of a ring chunk."""

    sender: NodeName
    copy: AuditCopy


@attrs.frozen
class Answered:
    """Scheduler -> checker: a verdict that came on ``auditor``'s control link."""

    auditor: NodeName
    verdict: AuditVerdict


@attrs.frozen
class Noted:
    """Checker -> scheduler: a line for the router's events (an ``audit`` note)."""

    text: str


@attrs.frozen
class Ask:
    """Checker -> scheduler: send ``request`` to ``auditor`` on its control link."""

    auditor: NodeName
    request: AuditRequest


@attrs.frozen
class Evict:
    """Checker -> scheduler: ``node`` failed ``audit.strikes`` audits; declare it dead."""

    node: NodeName


SpotEvent = Copied | Answered
SpotOutcome = Ask | Noted | Evict


class Auditor(Protocol):
    """A node that can audit (a registry member)."""

    @property
    def node(self) -> NodeName: ...


class Roster(Protocol):
    """What the checker reads of the scheduler's registry
    (``shard.membership.registry.Registry``), as it stands now."""

    def holders(self) -> list[Holder]:
        """The ring's slots: who holds which block."""
        ...

    def auditor_for(self, first: int, last: int, accused: NodeName) -> Auditor | None:
        """A live auditor (else standby) out of the ring holding ``[first, last)`` that is
        not ``accused``; None: nobody."""
        ...


class SpotChecker:
    """See the module docstring. ``hub``: None when the swarm does not audit (copies are
    dropped, no verdict is asked for; its strikes stay at zero unless ``audited`` is called,
    as a test that runs its own auditor does). ``statistics`` and ``audit_counts`` are
    snapshot reads (the status feed asks them).

    Cancellation: cancelling ``run`` stops the checks. Errors: bugs propagate.
    """

    def __init__(
        self,
        hub: AuditHub | None,
        policy: AuditSpec,
        roster: Roster,
        inbox: trio.MemoryReceiveChannel[SpotEvent],
        outbox: trio.MemorySendChannel[SpotOutcome],
    ) -> None:
        self._hub = hub
        self._roster = roster
        self._inbox = inbox
        self._outbox = outbox
        self.strikes = StrikeBook(policy.strikes)
        self.evidence = EvidenceShelf(policy.evidence_dir)  # each strike's evidence, to a file
        #: audits skipped for want of a holder, by (first, last, accused): warned once each
        self._skipped: dict[tuple[int, int, NodeName], int] = {}

    def statistics(self) -> AuditStatistics:
        return self.strikes.statistics()

    def audit_counts(self) -> AuditCounts:
        """Spot-check counters for the status feed."""
        a = self.strikes.statistics()
        return AuditCounts(a.audits, a.strikes, a.evictions, a.evicted, self.evidence.recent)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._outbox:
            task_status.started()
            async for event in self._inbox:
                if isinstance(event, Copied):
                    await self.copied(event.sender, event.copy)
                elif self._hub is not None and self._hub.answered(event.auditor, event.verdict):
                    await self.audited(event.verdict)
                else:
                    log.warning(
                        "scheduler: %s sent a verdict nobody asked it for; ignored", event.auditor
                    )

    async def copied(self, sender: NodeName, copy: AuditCopy) -> None:
        """A node's copy of a ring chunk: send each audit it makes due (none without a hub:
        the swarm does not audit)."""
        if self._hub is None:
            return
        for req in self._hub.copied(sender, copy, self._roster.holders()):
            await self._send_audit(req)

    async def _send_audit(self, req: AuditRequest) -> None:
        auditor = self._roster.auditor_for(req.first, req.last, req.accused)
        cause = (req.first, req.last, req.accused)
        if auditor is None:  # once per cause, not per chunk: with audits on it was every chunk
            skipped = self._skipped[cause] = self._skipped.get(cause, 0) + 1
            if skipped == 1:
                log.warning("scheduler: no auditor or standby holds [%d, %d); audit of %s "
                            "skipped (the next ones at debug, until one holds it)",
                            req.first, req.last, req.accused)  # fmt: skip
            else:
                log.debug("scheduler: audit of %s skipped again (%d so far)", req.accused, skipped)
            return
        self._skipped.pop(cause, None)  # held again: a later gap is worth a warning again
        assert self._hub is not None  # requests come from the hub
        self._hub.asked(auditor.node, req)
        await self._outbox.send(Ask(auditor.node, req))

    async def audited(self, verdict: AuditVerdict) -> None:
        """An auditor's verdict on a ring node, answering a request sent to it. A failed
        audit is a strike; at ``audit.strikes`` the node is evicted (the scheduler replaces
        it; its predecessor replays its log, so no committed token is lost)."""
        evict = self.strikes.record(verdict)
        if verdict.ok:
            log.info(
                "scheduler: audit of %s (session %d, chunk %d) by %s: ok (%s)",
                verdict.accused, verdict.session, verdict.index, verdict.auditor, verdict.detail,
            )  # fmt: skip
            return
        node = verdict.accused
        note = f"{node} failed an audit ({verdict.detail}); strike {self.strikes.strikes(node)}"
        note += await self.evidence.keep(verdict.evidence)  # "; evidence in PATH"
        log.warning("scheduler: %s", note)
        await self._outbox.send(Noted(note))
        if evict:
            await self._outbox.send(Evict(node))
