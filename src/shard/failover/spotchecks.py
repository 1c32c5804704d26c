"""Spot checks as the scheduler runs them (``Scheduler`` is a ``SpotChecks``): each ring chunk
a node copies (``shard.transport.mirror``) goes to the audit hub (``shard.audit.hub``), and
each audit it makes due is sent to a live auditor, else a standby, holding the audited block
(none: the audit is skipped, warned once per cause, then at debug until one holds it). A
verdict is taken only as the answer to a request sent to its auditor; a failed audit is a
strike (``shard.audit.strikes``) with its evidence kept in a file
(``shard.audit.evidence_files``), and at ``audit.strikes`` the node is evicted: declared dead
and replaced by a standby exactly as after a crash.

Its lines go to the scheduler's log (``shard.failover.scheduler``): they are the scheduler's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from shard.audit.evidence_files import EvidenceShelf
from shard.audit.hub import AuditHub, Holder
from shard.audit.strikes import StrikeBook
from shard.failover.detector import FailureDetector
from shard.failover.events import NodeDead, Problem, RingControl, RingNote
from shard.membership.registry import Registry
from shard.messages import AuditCounts, NodeName
from shard.messages.audit import AuditCopy, AuditRequest, AuditVerdict
from shard.spec.audit import AuditSpec
from shard.transport import TransportError, abandon

log = logging.getLogger("shard.failover.scheduler")


class SpotChecks:
    """The scheduler's spot checks (see the module docstring), mixed into ``Scheduler``:
    ``copied`` takes a node's copy of a chunk, ``audited`` an auditor's verdict. It uses the
    scheduler's registry, router channel, problem queue, failure detector and clock."""

    _registry: Registry
    _to_router: trio.MemorySendChannel[RingControl]
    _problems_send: trio.MemorySendChannel[Problem]
    _detector: FailureDetector
    _clock: Callable[[], float]

    def _start_spot_checks(self, audit: AuditSpec | None, audits: AuditHub | None) -> None:
        """``audits``: spot checks in a real swarm (``[audit] enabled``): None when nodes
        copy nothing."""
        #: audits skipped for want of a holder, by (first, last, accused): warned once each
        self._skipped: dict[tuple[int, int, NodeName], int] = {}
        audit = audit or AuditSpec()
        self.strikes = StrikeBook(audit.strikes)
        self.evidence = EvidenceShelf(audit.evidence_dir)  # each strike's evidence, to a file
        self.audits = audits

    def audit_counts(self) -> AuditCounts:
        """Spot-check counters for the status feed."""
        a = self.strikes.statistics()
        return AuditCounts(a.audits, a.strikes, a.evictions, a.evicted, self.evidence.recent)

    def _holders(self) -> list[Holder]:
        return [Holder(s.holder, s.first, s.last) for s in self._registry.slots]

    async def copied(self, sender: NodeName, copy: AuditCopy) -> None:
        """A node's copy of a ring chunk (``shard.transport.mirror``): send each audit it makes
        due to a live auditor (else standby) holding the audited block (none: the audit is
        skipped, logged)."""
        if self.audits is None:
            return
        for req in self.audits.copied(sender, copy, self._holders()):
            await self._send_audit(req)

    async def _send_audit(self, req: AuditRequest) -> None:
        m = self._registry.auditor_for(req.first, req.last, req.accused)
        cause = (req.first, req.last, req.accused)
        if m is None:  # once per cause, not per chunk: with audits on it was every chunk
            skipped = self._skipped[cause] = self._skipped.get(cause, 0) + 1
            if skipped == 1:
                log.warning("scheduler: no auditor or standby holds [%d, %d); audit of %s "
                            "skipped (the next ones at debug, until one holds it)",
                            req.first, req.last, req.accused)  # fmt: skip
            else:
                log.debug("scheduler: audit of %s skipped again (%d so far)", req.accused, skipped)
            return
        self._skipped.pop(cause, None)  # held again: a later gap is worth a warning again
        assert self.audits is not None  # requests come from the hub
        self.audits.asked(m.node, req)
        try:
            await m.conn.send(req)
        except TransportError as exc:
            log.warning("scheduler: audit of %s not sent to %s: %s", req.accused, m.node, exc)

    async def _verdict(self, node: NodeName, verdict: AuditVerdict) -> None:
        """A verdict from ``node``'s control link: taken only as the answer to a request
        sent to it (a node cannot accuse another on its own word)."""
        if self.audits is None or not self.audits.answered(node, verdict):
            log.warning("scheduler: %s sent a verdict nobody asked it for; ignored", node)
            return
        await self.audited(verdict)

    async def audited(self, verdict: AuditVerdict) -> None:
        """An auditor's verdict on a ring node. A failed audit is a strike; at ``audit.strikes``
        the node is evicted: declared dead and replaced by a standby exactly as after a crash
        (the predecessor replays its log, so no committed token is lost)."""
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
        await self._to_router.send(RingNote("audit", note))
        member = self._registry.members.get(node)
        if not evict or member is None or not member.alive:
            return
        member.alive = False
        self._detector.forget(node)
        log.warning("scheduler: %s evicted after failed audits", node)
        await self._to_router.send(RingNote("audit", f"{node} evicted after failed audits"))
        await self._problems_send.send(NodeDead(node, self._clock()))
        await abandon(member.conn)


__all__ = ["SpotChecks"]
