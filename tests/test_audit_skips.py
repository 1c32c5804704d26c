"""An audit skipped for want of a holder is said once per cause, not on every chunk.

In process, no network: the scheduler's ``_send_audit`` with no auditor or standby
registered, as with ``[audit] enabled`` and nothing holding the accused's block.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio

from shard.failover.events import RingControl
from shard.failover.scheduler import Scheduler, Slot
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.messages import NodeName
from shard.spec.failover import FailoverSpec


def _scheduler() -> Scheduler:
    to_router, _ = trio.open_memory_channel[RingControl](64)
    slots = [Slot(NodeName("s0"), 0, 2, NodeName("s0"), "s0:1")]
    slots.append(Slot(NodeName("s1"), 2, 4, NodeName("s1"), "s1:1"))
    return Scheduler(
        SchedulerConfig(
            node=NodeName("coord"), slots=slots, return_address="coord:ret", policy=FailoverSpec()
        ),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
    )


async def test_a_skipped_audit_is_warned_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    """Five chunks of s0 and two of s1 with nobody to audit them: one warning for each
    accused block (it was a warning per chunk), the rest at debug with a running count."""
    scheduler = _scheduler()
    chunks = [("s0", 0, 2)] * 5 + [("s1", 2, 4)] * 2
    with caplog.at_level(logging.DEBUG, logger="shard.failover.scheduler"):
        for accused, first, last in chunks:
            req = SimpleNamespace(accused=NodeName(accused), first=first, last=last)
            await scheduler._send_audit(req)  # type: ignore[arg-type]  # the fields it reads
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
