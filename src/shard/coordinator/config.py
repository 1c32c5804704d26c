"""What the coordinator's actors are built from, as records: the ``Coordinator``'s own
(``CoordinatorConfig``, made once by the coordinator node's root from the spec), its channels
(``CoordinatorChannels``) and what it works with beside them (``CoordinatorAides``); and, for
each request it drives, what every ``RequestDriver`` of it shares (``DriverShared``) and that
request's own plan (``RequestPlan``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.coordinator.checkpoint import Checkpointer, CheckpointStore
from shard.coordinator.gate import RingGate
from shard.coordinator.ledger import Ledger
from shard.coordinator.receipt_log import ReceiptLog
from shard.decode.control import SpeculationConfig
from shard.decode.draft import Drafter
from shard.decode.state import DecodeState
from shard.failover.events import RingControl
from shard.failover.replay import ReplayLog
from shard.messages import Message, NodeName, Sampling, SessionId
from shard.spec.limits import Limits
from shard.trust.receipts import RunJob, RunSigner

__all__ = [
    "CoordinatorAides",
    "CoordinatorChannels",
    "CoordinatorConfig",
    "DriverShared",
    "Hold",
    "RequestPlan",
]

Hold = Callable[[SessionId, int, Sequence[int]], Awaitable[None]]
"""``[audit] mode = "hold"``: awaited before a verdict's tokens are sent, with the session,
the verdict's ``seq`` and the tokens released before; it returns once every stage's part of
that verdict was confirmed by an audit, or raises ``RingError`` (``shard.audit.hold``)."""


def _ids(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(ids)


@attrs.frozen
class CoordinatorConfig:
    """The coordinator's node name and the model's end-of-sequence ids; its limits and
    default speculation; ``incarnation``, in the high bits of session ids, keeps its sessions
    apart from a predecessor's (``shard.stage.executor``); ``feature_dim``, the target's
    hidden size: the width of the features a proposer may ask for
    (``shard.coordinator.features``; None: any width)."""

    node: NodeName
    eos_ids: tuple[int, ...] = attrs.field(converter=_ids)
    limits: Limits = Limits()
    speculation: SpeculationConfig = SpeculationConfig()
    incarnation: int = 0
    feature_dim: int | None = None


@attrs.frozen
class CoordinatorChannels:
    """The ring link's send side (``to_ring``), what comes back (``from_ring``: verdicts,
    faults, receipts) and the scheduler's messages (``control``; None: no scheduler, a test's
    ring)."""

    to_ring: trio.MemorySendChannel[Message]
    from_ring: trio.MemoryReceiveChannel[Message]
    control: trio.MemoryReceiveChannel[RingControl] | None = None


@attrs.frozen
class CoordinatorAides:
    """What a coordinator works with beside its channels (each None: not used).

    ``drafter``: the draft proposers; ``signer``: the key it signs run receipts with;
    ``checkpoints`` keeps each running request's committed tokens (a restarted coordinator
    can ``resume_request`` it); ``sent_log``: the log of what each session sent (default: a
    fresh one; the ring link replays it to a standby that replaces stage 0);
    ``nonces(session)``: the job nonce a receipt-signing session sends (default: 16 random
    bytes; a swarm that audits derives it from the session's committed audit seed,
    ``shard.audit.hub``); ``hold``: each request's release gate in ``[audit] mode = "hold"``;
    ``receipts``: every request signs a receipt, kept there
    (``shard.coordinator.receipt_log``)."""

    drafter: Drafter | None = None
    signer: RunSigner | None = None
    checkpoints: CheckpointStore | None = None
    sent_log: ReplayLog | None = None
    nonces: Callable[[SessionId], bytes] | None = None
    hold: Hold | None = None
    receipts: ReceiptLog | None = None


@attrs.frozen
class DriverShared:
    """What every request driver of one coordinator shares: the ring gate, the ledger, the
    limits, the drafter, the features' width and the release gate (``CoordinatorConfig``,
    ``CoordinatorAides``)."""

    ring: RingGate
    ledger: Ledger
    limits: Limits
    drafter: Drafter | None = None
    feature_dim: int | None = None
    hold: Hold | None = None


@attrs.frozen
class RequestPlan:
    """One request as its driver runs it: its session, its receipt's job (None: unsigned),
    its prompt ids, decode state and sampling, its speculation, and its checkpoint file
    (rewritten on each commit before the ids are sent; None: not checkpointed)."""

    sid: SessionId
    job: RunJob | None
    prompt_ids: Sequence[int]
    state: DecodeState
    sampling: Sampling
    speculation: SpeculationConfig
    checkpoint: Checkpointer | None = None
