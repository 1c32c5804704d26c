"""An audit skipped for want of a holder is said once per cause, not on every chunk.

In process, no network: the spot checker's ``_send_audit`` with a roster where nobody can
audit, as with ``[audit] enabled`` and nothing holding the accused's block.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio

from shard.audit.checker import SpotChecker, SpotEvent, SpotOutcome
from shard.audit.hub import AuditHub, Holder
from shard.messages import NodeName
from shard.spec.audit import AuditSpec


class NobodyAudits:
    """A registry read where no auditor or standby holds any block."""

    def holders(self) -> list[Holder]:
        return []

    def auditor_for(self, first: int, last: int, accused: NodeName) -> None:
        return None


def _checker() -> SpotChecker:
    _, inbox = trio.open_memory_channel[SpotEvent](0)
    outbox, _ = trio.open_memory_channel[SpotOutcome](64)
    hub = AuditHub(AuditSpec(enabled=True), NodeName("coord"))
    return SpotChecker(hub, AuditSpec(enabled=True), NobodyAudits(), inbox, outbox)


async def test_a_skipped_audit_is_warned_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    """Five chunks of s0 and two of s1 with nobody to audit them: one warning for each
    accused block (it was a warning per chunk), the rest at debug with a running count."""
    checker = _checker()
    chunks = [("s0", 0, 2)] * 5 + [("s1", 2, 4)] * 2
    with caplog.at_level(logging.DEBUG, logger="shard.failover.scheduler"):
        for accused, first, last in chunks:
            req = SimpleNamespace(accused=NodeName(accused), first=first, last=last)
            await checker._send_audit(req)  # type: ignore[arg-type]  # the fields it reads
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "scheduler: no auditor or standby holds [0, 2); audit of s0 skipped (the next ones "
        "at debug, until one holds it)",
        "scheduler: no auditor or standby holds [2, 4); audit of s1 skipped (the next ones "
        "at debug, until one holds it)",
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug[-1] == "scheduler: audit of s1 skipped again (2 so far)"
    assert "scheduler: audit of s0 skipped again (5 so far)" in debug
