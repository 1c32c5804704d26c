"""A client of a running swarm: send a ``GenerateRequest`` to the coordinator and read its
pieces back on a channel — each commit's ``TokensOut``, then one ``GenerateDone`` — with
``async with stream(...) as pieces``; ``request`` is the same for a caller that wants only
the ``GenerateDone``.

Given several coordinator addresses (the primary's and a standby coordinator's,
docs/failover.md), the request carries a random ``resume`` key; when the connection breaks
before the end, the client dials the next address (in turn, for up to ``reconnect_s``) and
sends the request again with the key and the count of tokens it already has: the coordinator
that took over goes on from the request's committed tokens and sends only the rest.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from shard.errors import HandshakeError
from shard.messages import GenerateDone, GenerateRequest, Hello, NodeName, TokensOut
from shard.transport import Network
from shard.transport.guard import CONNECTION_ERRORS
from shard.transport.links import HANDSHAKE_TIMEOUT_S, dial_peer

log = logging.getLogger(__name__)

#: What ends a link to a coordinator (it died, or answered wrongly).
_LINK_ERRORS: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, HandshakeError)

#: How long a re-dial waits for one address before the next is tried.
_REDIAL_S = 1.0


class ClientError(Exception):
    """The coordinator could not be reached or answered something unexpected."""


Piece = TokensOut | GenerateDone
"""What a request's channel carries: its commits' text, then its completion."""

#: Pieces buffered before the connection waits for the reader.
_BUFFER = 64


@asynccontextmanager
async def stream(
    network: Network,
    address: str | Sequence[str],
    req: GenerateRequest,
    *,
    swarm: str,
    connect_timeout_s: float = 10.0,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    reconnect_s: float = 60.0,
) -> AsyncIterator[trio.MemoryReceiveChannel[Piece]]:
    """Run one request on the swarm whose coordinator listens at ``address`` (or at one of
    several: see the module docstring); yields the channel of its pieces: a ``TokensOut``
    per commit, then its ``GenerateDone``, then the channel ends.

    Leaving the block early closes the connection. Errors (raised from the block):
    ``ClientError``; with one address, the connection's errors as they are."""
    send, receive = trio.open_memory_channel[Piece](_BUFFER)
    timeouts = (connect_timeout_s, handshake_timeout_s, reconnect_s)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run, send, network, address, req, swarm, timeouts)
            async with receive:
                yield receive
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # one error (the connection's, or the caller's own)
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def request(
    network: Network,
    address: str | Sequence[str],
    req: GenerateRequest,
    *,
    swarm: str,
    connect_timeout_s: float = 10.0,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    reconnect_s: float = 60.0,
) -> GenerateDone:
    """``stream``'s ``GenerateDone`` alone (the streamed text is dropped)."""
    async with stream(
        network,
        address,
        req,
        swarm=swarm,
        connect_timeout_s=connect_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
        reconnect_s=reconnect_s,
    ) as pieces:
        async for piece in pieces:
            if isinstance(piece, GenerateDone):
                return piece
    raise ClientError(f"request {req.request}: the stream ended without its completion")


async def _run(
    send: trio.MemorySendChannel[Piece],
    network: Network,
    address: str | Sequence[str],
    req: GenerateRequest,
    swarm: str,
    timeouts: tuple[float, float, float],
) -> None:
    """``stream``'s connection: dial, send, relay every piece to ``send``; re-dial the next
    address when a link breaks (several addresses only)."""
    connect_timeout_s, handshake_timeout_s, reconnect_s = timeouts
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if len(addresses) > 1 and not req.resume:
        req = attrs.evolve(req, resume=secrets.token_hex(16))
    have = 0  # output tokens received, across connections
    at, deadline, timeout_s = 0, None, connect_timeout_s
    async with send:
        while True:
            try:
                conn = await dial_peer(
                    network,
                    addresses[at],
                    Hello(node=NodeName("client"), role="client", swarm=swarm),
                    timeout_s=timeout_s,
                    handshake_timeout_s=handshake_timeout_s,
                )
                try:
                    await conn.send(attrs.evolve(req, have=have))
                    while True:
                        msg = await conn.receive()
                        if isinstance(msg, TokensOut) and msg.request == req.request:
                            have += len(msg.token_ids)
                            await send.send(msg)
                        elif isinstance(msg, GenerateDone) and msg.request == req.request:
                            await send.send(msg)
                            return
                        else:
                            raise ClientError(
                                f"unexpected {type(msg).__name__} from {addresses[at]}"
                            )
                finally:
                    with trio.CancelScope(shield=True):
                        await conn.aclose()
            except _LINK_ERRORS as exc:
                if len(addresses) == 1:
                    raise
                now = trio.current_time()
                deadline = now + reconnect_s if deadline is None else deadline
                if now > deadline:
                    raise ClientError(
                        f"no coordinator of {', '.join(addresses)} finished the request "
                        f"within {reconnect_s:g} s of the first break: {exc}"
                    ) from exc
                log.info("coordinator %s: %s; trying the next", addresses[at], exc)
                at, timeout_s = (at + 1) % len(addresses), _REDIAL_S
                await trio.sleep(0.1)
