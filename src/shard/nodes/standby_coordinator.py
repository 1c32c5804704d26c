"""A standby coordinator: follows the primary's checkpoints, takes over when it dies.

``shard up --role coordinator --standby-of ADDR`` (and ``swarm up`` for a spec whose
``[coordinator]`` names a ``standby`` address) runs ``run_standby_coordinator``: it dials the
primary's follow link (``shard.coordinator.follow``) and keeps every running request's
committed tokens. When the link breaks or goes silent for ``[failover] dead_after_s`` the
primary is taken for dead, and the standby starts a coordinator of its own at the standby
address with the next generation (so the stages fence the old one off:
``shard.failover.fence``) and the followed requests adopted: the stages' control links re-dial
it (they try both addresses), the ring is reused warm, and each client that comes back with
its request's key gets the rest of its output (docs/failover.md, "Standby coordinator").
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import trio

from shard.coordinator.follow import Followed, follow
from shard.logs import NOTE
from shard.messages import Hello, NodeName
from shard.nodes.coordinator import CoordinatorHandle, DrafterMaker, run_coordinator
from shard.nodes.drafter import make_drafter
from shard.spec.swarm import SpecError, SwarmSpec
from shard.transport import Network

log = logging.getLogger(__name__)


def taken_over(spec: SwarmSpec) -> SwarmSpec:
    """``spec`` as the standby runs it once it took over: the coordinator listens at the
    standby address (its API at ``standby_api``, else the spec's), with no standby of its own.

    Errors: ``SpecError`` when the spec names no standby address."""
    me = spec.coordinator
    if me.standby is None:
        raise SpecError(spec.source, "coordinator", "no standby address: set [coordinator] standby")
    api = spec.api if me.standby_api is None else attrs.evolve(spec.api, listen=me.standby_api)
    coordinator = attrs.evolve(me, listen=me.standby, standby=None, standby_api=None)
    return attrs.evolve(spec, coordinator=coordinator, api=api)


async def run_standby_coordinator(
    spec: SwarmSpec,
    *,
    network: Network,
    model_dir: Path,
    primary: str | None = None,
    startup_timeout_s: float = 120.0,
    drafts: DrafterMaker = make_drafter,
    takeovers: trio.MemorySendChannel[CoordinatorHandle] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow the primary at ``primary`` (the spec's coordinator address by default); ready
    once following. When it dies, run the coordinator in its place (its handle is sent on
    ``takeovers`` once it serves) until cancelled.

    Errors: the first dial's ``TransportError`` / ``HandshakeError``; then as
    ``run_coordinator``."""
    mine = taken_over(spec)
    primary = primary or str(spec.coordinator.listen)
    hello = Hello(node=NodeName(spec.coordinator.name), role="coordinator", swarm=spec.name)
    followed = Followed()
    why: list[str] = []

    async def watch(*, task_status: trio.TaskStatus[None]) -> None:
        why.append(
            await follow(
                network,
                primary,
                attrs.evolve(hello, link="follow"),
                followed,
                dead_after_s=spec.failover.dead_after_s,
                connect_timeout_s=startup_timeout_s,
                handshake_timeout_s=spec.limits.handshake_timeout_s,
                task_status=task_status,
            )
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(watch)
        task_status.started()
    generation = followed.generation + 1
    adopted = list(followed.requests.values())
    log.warning(
        "standby coordinator: %s; taking over at %s as generation %d with %d running request(s)",
        why[0],
        mine.coordinator.listen,
        generation,
        len(adopted),
    )
    async with trio.open_nursery() as nursery:
        handle: CoordinatorHandle = await nursery.start(
            lambda task_status: run_coordinator(
                mine,
                network=network,
                model_dir=model_dir,
                startup_timeout_s=startup_timeout_s,
                drafts=drafts,
                generation=generation,
                adopted=adopted,
                task_status=task_status,
            )
        )
        log.log(NOTE, "standby coordinator: took over; serving at %s", handle.address)
        if takeovers is not None:
            await takeovers.send(handle)


__all__ = ["run_standby_coordinator", "taken_over"]
