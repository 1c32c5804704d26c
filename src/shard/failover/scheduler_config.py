"""What the scheduler (``shard.failover.scheduler.Scheduler``) is built from: its record,
made once by the coordinator's root from the spec (``SchedulerConfig``), and its channels
(``SchedulerChannels``)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from shard.failover.events import RingControl
from shard.membership.registry import Slot
from shard.messages import Fault, NodeName
from shard.messages.audit import AuditCopy
from shard.placement import ModelFacts
from shard.spec.audit import AuditSpec
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec

__all__ = ["SchedulerChannels", "SchedulerConfig"]


def _slots(slots: Sequence[Slot]) -> tuple[Slot, ...]:
    return tuple(slots)


@attrs.frozen
class SchedulerConfig:
    """The scheduler's node, the ring's slots and where the tail's return link dials
    (``return_address``); its failover policy and spot-check policy (``audit``; None: the
    swarm does not audit); ``formation``: the ring forms from joining nodes (``slots``
    empty), for this model (``shard.formation``)."""

    node: NodeName
    slots: tuple[Slot, ...] = attrs.field(converter=_slots)
    return_address: str
    policy: FailoverSpec = FailoverSpec()
    audit: AuditSpec | None = None
    formation: tuple[FormationSpec, ModelFacts] | None = None


@attrs.frozen
class SchedulerChannels:
    """``to_router``: what it tells the coordinator's router; ``ring_faults``: the faults of
    this node's own ring link; ``own_copies``: this node's own links' copies of ring chunks
    (its ring link's and its return link's, when the swarm audits), spot-checked like a
    stage's."""

    to_router: trio.MemorySendChannel[RingControl]
    ring_faults: trio.MemoryReceiveChannel[Fault] | None = None
    own_copies: trio.MemoryReceiveChannel[AuditCopy] | None = None
