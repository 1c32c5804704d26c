"""The scheduler's records (``shard.failover.scheduler.Scheduler``): what it is built from —
its own, made once by the coordinator's root from the spec (``SchedulerConfig``), and its
channels (``SchedulerChannels``) — and what it reports (``SchedulerStatistics``)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from shard.audit.checker import SpotEvent, SpotOutcome
from shard.failover.events import RingControl
from shard.failover.splice import Recovery
from shard.formation.mesh import MeshStatistics
from shard.membership.registry import Slot
from shard.messages import Fault, NodeName
from shard.messages.audit import AuditCopy
from shard.placement import ModelFacts
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec

__all__ = ["SchedulerChannels", "SchedulerConfig", "SchedulerStatistics"]


def _slots(slots: Sequence[Slot]) -> tuple[Slot, ...]:
    return tuple(slots)


@attrs.frozen
class SchedulerConfig:
    """The scheduler's node, the ring's slots and where the tail's return link dials
    (``return_address``); its failover policy; ``formation``: the ring forms from joining
    nodes (``slots`` empty), for this model (``shard.formation``)."""

    node: NodeName
    slots: tuple[Slot, ...] = attrs.field(converter=_slots)
    return_address: str
    policy: FailoverSpec = FailoverSpec()
    formation: tuple[FormationSpec, ModelFacts] | None = None


@attrs.frozen
class SchedulerChannels:
    """``to_router``: what it tells the coordinator's router; ``ring_faults``: the faults of
    this node's own ring link; ``own_copies``: this node's own links' copies of ring chunks
    (its ring link's and its return link's, when the swarm audits), spot-checked like a
    stage's; ``spot_checks`` / ``spot_outcomes``: the spot checker's inbox and outbox
    (``shard.audit.checker``; None: the swarm does not audit)."""

    to_router: trio.MemorySendChannel[RingControl]
    ring_faults: trio.MemoryReceiveChannel[Fault] | None = None
    own_copies: trio.MemoryReceiveChannel[AuditCopy] | None = None
    spot_checks: trio.MemorySendChannel[SpotEvent] | None = None
    spot_outcomes: trio.MemoryReceiveChannel[SpotOutcome] | None = None


@attrs.frozen
class SchedulerStatistics:
    members: tuple[tuple[NodeName, str, bool], ...]  # (node, role, alive)
    slots: tuple[tuple[NodeName, NodeName], ...]  # (slot, holder)
    standbys: tuple[NodeName, ...]
    recoveries: tuple[Recovery, ...]
    #: slots given up on that wait for a node able to hold their block (one line each)
    waiting: tuple[str, ...] = ()
    #: (node, median control-link round trip in seconds, None until measured)
    rtt_s: tuple[tuple[NodeName, float | None], ...] = ()
    #: the RTT mesh between joined nodes (``[formation]``; None without)
    mesh: MeshStatistics | None = None
