"""Spot checks in a node process: what a stage, standby or auditor adds when its swarm audits.

A swarm with ``[audit] enabled`` has every supervised stage copy its ring chunks up its control
link (``shard.transport.mirror``; the scheduler's ``AuditHub`` says why) and every standby or
auditor (``[[standby]] role = "auditor"``) that holds a block answer audit requests for it
(``shard.audit.auditor``). Without it, nothing here runs and the node's network is its own.

``weights_of`` is how a node holds its block, for the node itself (a standby or auditor holds
it as the stage it stands for, so its replays run that stage's kernels) and for the
coordinator, which declares each accused's in its audit requests.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.audit.auditor import QUANTIZED, audit_offloaded
from shard.audit.hold import HoldFailed
from shard.audit.hub import AuditHub
from shard.coordinator.config import Hold
from shard.coordinator.events import RingError
from shard.messages import NodeName, SessionId
from shard.messages.audit import AuditCopy, AuditRequest, AuditVerdict
from shard.model.llama import StageModel
from shard.nodes.compose import signing_identity
from shard.spec.nodes import StandbySpec
from shard.spec.swarm import SpecError, SwarmSpec
from shard.transport import Network
from shard.transport.mirror import MirrorNetwork


@attrs.frozen
class Auditing:
    """A node's network (mirrored when the swarm audits), the copies its control link carries
    (None: none), and how it answers an audit request (None: it cannot)."""

    network: Network
    copies: trio.MemoryReceiveChannel[AuditCopy] | None = None
    audit: Callable[[AuditRequest], Awaitable[AuditVerdict]] | None = None


def weights_of(spec: SwarmSpec, name: str) -> str | None:
    """How node ``name`` holds its block (``[swarm] weights`` and the node's own): its own
    ``weights``, else — a standby or auditor with ``layers_of`` — its stage's quantized form,
    else the swarm's (a float ``weights`` only names the node's own dtype). A node the spec
    does not name (one that joined) holds the swarm's."""
    try:
        node = spec.node(name)
    except SpecError:
        return spec.weights
    if node.runtime.weights is None and isinstance(node, StandbySpec) and node.layers_of:
        stage = spec.runtime(node.layers_of).weights
        if stage in QUANTIZED:
            return stage
    return spec.runtime(name).weights


def auditing(
    spec: SwarmSpec, name: str, network: Network, model: StageModel | None, *, supervised: bool
) -> Auditing:
    """How node ``name`` takes part in spot checks (``model``: the block it holds, if any)."""
    if not spec.audit.enabled or not supervised:  # no control link: nobody to copy to
        return Auditing(network)
    # Unbuffered: a ring send waits until its copy is on the control link's queue.
    copies_send, copies = trio.open_memory_channel[AuditCopy](0)
    mirrored = MirrorNetwork(network, copies_send.send)
    if model is None:
        return Auditing(mirrored, copies)
    identity = signing_identity(spec, name)
    limiter = trio.CapacityLimiter(1)  # a standby audits; once in the ring it is sent none
    device_class = "cuda" if model.device.type == "cuda" else "cpu"

    async def audit(req: AuditRequest) -> AuditVerdict:
        return await audit_offloaded(
            model, req, node=NodeName(name), identity=identity, device_class=device_class,
            policy=spec.audit, limiter=limiter, now=int(time.time()),
            weights=weights_of(spec, name),
        )  # fmt: skip

    return Auditing(mirrored, copies, audit)


def hold_gate(hub: AuditHub | None) -> Hold | None:
    """``[audit] mode = "hold"``: the coordinator's release gate — a request's verdict waits
    for the hub's confirmations (``shard.audit.hold``); one that cannot be confirmed ends
    the request with a ``RingError`` holding only the tokens released before it. None when
    the swarm does not audit, or samples."""
    book = hub.hold if hub is not None else None
    if book is None:
        return None

    async def hold(session: SessionId, seq: int, released: Sequence[int]) -> None:
        try:
            await book.wait(session, seq)
        except HoldFailed as exc:
            msg = f'tokens withheld ([audit] mode = "hold"): {exc}'
            raise RingError(msg, committed=released) from None

    return hold
