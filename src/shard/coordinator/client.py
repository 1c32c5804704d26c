"""A client of a running swarm: send a ``GenerateRequest`` to the coordinator, stream the
committed tokens back, return the ``GenerateDone``.

Given several coordinator addresses (the primary's and a standby coordinator's,
docs/failover.md), the request carries a random ``resume`` key; when the connection breaks
before the end, the client dials the next address (in turn, for up to ``reconnect_s``) and
sends the request again with the key and the count of tokens it already has: the coordinator
that took over goes on from the request's committed tokens and sends only the rest.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

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


async def request(
    network: Network,
    address: str | Sequence[str],
    req: GenerateRequest,
    *,
    swarm: str,
    on_text: Callable[[TokensOut], None] | None = None,
    connect_timeout_s: float = 10.0,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    reconnect_s: float = 60.0,
) -> GenerateDone:
    """Run one request on the swarm whose coordinator listens at ``address`` (or at one of
    several: see the module docstring).

    Errors: ``ClientError``; with one address, the connection's errors as they are."""
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if len(addresses) > 1 and not req.resume:
        req = attrs.evolve(req, resume=secrets.token_hex(16))
    have = [0]  # output tokens received, across connections

    def received(msg: TokensOut) -> None:
        have[0] += len(msg.token_ids)
        if on_text is not None:
            on_text(msg)

    at, deadline, timeout_s = 0, None, connect_timeout_s
    while True:
        try:
            return await _once(
                network,
                addresses[at],
                attrs.evolve(req, have=have[0]),
                swarm=swarm,
                on_text=received,
                connect_timeout_s=timeout_s,
                handshake_timeout_s=handshake_timeout_s,
            )
        except _LINK_ERRORS as exc:
            if len(addresses) == 1:
                raise
            now = trio.current_time()
            deadline = now + reconnect_s if deadline is None else deadline
            if now > deadline:
                raise ClientError(
                    f"no coordinator of {', '.join(addresses)} finished the request within "
                    f"{reconnect_s:g} s of the first break: {exc}"
                ) from exc
            log.info("coordinator %s: %s; trying the next", addresses[at], exc)
            at, timeout_s = (at + 1) % len(addresses), _REDIAL_S
            await trio.sleep(0.1)


async def _once(
    network: Network,
    address: str,
    req: GenerateRequest,
    *,
    swarm: str,
    on_text: Callable[[TokensOut], None],
    connect_timeout_s: float,
    handshake_timeout_s: float,
) -> GenerateDone:
    hello = Hello(node=NodeName("client"), role="client", swarm=swarm)
    conn = await dial_peer(
        network,
        address,
        hello,
        timeout_s=connect_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
    )
    try:
        await conn.send(req)
        while True:
            msg = await conn.receive()
            if isinstance(msg, TokensOut) and msg.request == req.request:
                on_text(msg)
            elif isinstance(msg, GenerateDone) and msg.request == req.request:
                return msg
            else:
                raise ClientError(f"unexpected {type(msg).__name__} from {address}")
    finally:
        with trio.CancelScope(shield=True):
            await conn.aclose()
