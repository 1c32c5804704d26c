"""The follow link between a primary coordinator and its standby (docs/failover.md,
"Standby coordinator").

The primary serves ``serve_follower`` on each connection whose ``Hello`` says
``link="follow"``: it sends every running request's checkpoint (``FollowCommit`` from offset
0), then, each time the checkpoint store changes, what the follower lacks — new output from
the offset it has, ``FollowEnd`` for requests that ended — and a ``Heartbeat`` when nothing
changed for ``heartbeat_s``. What is sent is a diff against what this follower was sent, so a
slow follower costs no queue: it gets the newest state when it reads again.

The standby runs ``follow``: it dials the primary, applies what it receives into a
``Followed`` record, and returns when the primary is gone — the connection closed (a killed
process: the kernel closes its sockets) or silent for ``dead_after_s`` — so its caller takes
over. Before the first successful handshake a refused dial is retried until
``connect_timeout_s``; later, a broken link is the primary's death (the standby does not
re-dial: see "Split brain" in the docs for why a generation fences a wrong guess).
"""

from __future__ import annotations

import logging
import time

import attrs
import trio

from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.errors import HandshakeError
from shard.messages import FollowCommit, FollowEnd, Heartbeat, Hello, NodeName
from shard.transport import Connection, Network, TransportError
from shard.transport.guard import CONNECTION_ERRORS
from shard.transport.links import dial_welcome

log = logging.getLogger(__name__)

#: What ends a link to a coordinator (it died, or answered wrongly).
_LINK_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, HandshakeError)


async def serve_follower(
    store: CheckpointStore,
    conn: Connection,
    *,
    node: NodeName,
    generation: int,
    heartbeat_s: float = 0.25,
) -> None:
    """Stream ``store``'s running requests to one follower until it goes away.

    Errors: the connection's ``TransportError`` (the caller's guard ends this link alone)."""
    sent: dict[str, int] = {}  # request -> output tokens this follower has
    while True:
        changed = store.changed
        for request, checkpoint in list(store.live.items()):
            have = sent.get(request)
            if have is None:
                await conn.send(_opening(checkpoint, generation))
            elif len(checkpoint.output_ids) > have:
                more = checkpoint.output_ids[have:]
                await conn.send(FollowCommit(request, have, more, generation=generation))
            sent[request] = len(checkpoint.output_ids)
        for request in [r for r in sent if r not in store.live]:
            await conn.send(FollowEnd(request))
            del sent[request]
        with trio.move_on_after(heartbeat_s):
            await changed.wait()
        if not changed.is_set():
            await conn.send(Heartbeat(node=node, sent_at=time.time()))


def _opening(checkpoint: RequestCheckpoint, generation: int) -> FollowCommit:
    return FollowCommit(
        checkpoint.request,
        0,
        checkpoint.output_ids,
        prompt_ids=checkpoint.prompt_ids,
        max_tokens=checkpoint.max_tokens,
        sampling=checkpoint.sampling,
        job=checkpoint.job,
        generation=generation,
        ignore_eos=checkpoint.ignore_eos,
    )


@attrs.define
class Followed:
    """What a standby knows of its primary: the running requests' checkpoints and the
    primary's generation (the standby takes over with the next)."""

    requests: dict[str, RequestCheckpoint] = attrs.Factory(dict)
    generation: int = 0

    def apply(self, msg: FollowCommit | FollowEnd) -> None:
        """One message of the follow link. A commit that does not continue what is known (a
        gap: never on one FIFO link) is logged and skipped."""
        if isinstance(msg, FollowEnd):
            self.requests.pop(msg.request, None)
            return
        self.generation = max(self.generation, msg.generation)
        if msg.request not in self.requests:  # its opening: the prompt and the budget
            self.requests[msg.request] = RequestCheckpoint(
                msg.request,
                msg.prompt_ids,
                msg.output_ids,
                msg.max_tokens,
                msg.sampling,
                msg.job,
                ignore_eos=msg.ignore_eos,
            )
            return
        known = self.requests.get(msg.request)
        if known is None or len(known.output_ids) != msg.offset:
            log.warning("follow: %s at %d does not continue what is known", msg.request, msg.offset)
            return
        output = (*known.output_ids, *msg.output_ids)
        self.requests[msg.request] = attrs.evolve(known, output_ids=output)


async def follow(
    network: Network,
    primary: str,
    hello: Hello,
    followed: Followed,
    *,
    dead_after_s: float,
    connect_timeout_s: float,
    handshake_timeout_s: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> str:
    """Follow the primary at ``primary`` into ``followed`` until it is gone; returns why.
    Started once the first handshake succeeded (the primary serves).

    Errors: ``TransportError`` / ``HandshakeError`` when the primary cannot be reached at
    first (within ``connect_timeout_s``)."""
    conn, welcome = await dial_welcome(
        network,
        primary,
        hello,
        timeout_s=connect_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
    )
    followed.generation = max(followed.generation, welcome.generation)
    task_status.started()
    try:
        while True:
            with trio.move_on_after(dead_after_s):
                msg = await conn.receive()
                if isinstance(msg, FollowCommit | FollowEnd):
                    followed.apply(msg)
                elif not isinstance(msg, Heartbeat):
                    log.warning("follow: unexpected %s from the primary; ignored", msg)
                continue
            return f"the primary at {primary} was silent for {dead_after_s:g} s"
    except _LINK_ERRORS as exc:
        return f"the follow link to the primary at {primary} broke: {exc}"
    finally:
        with trio.CancelScope(shield=True):
            try:
                await conn.aclose()
            except TransportError:
                pass


__all__ = ["Followed", "follow", "serve_follower"]
