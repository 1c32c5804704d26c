"""Ring links: the handshake on every connection and the pump from a connection to an actor.

Each stage dials its successor; the tail dials the coordinator's return endpoint (direct
return, one hop); the coordinator dials stage 0. A dialer sends ``Hello`` and waits for
``Welcome``; a listener checks the swarm name and protocol before answering. After the
handshake ``pump_in`` delivers what a ``Connection`` receives to an actor's memory channel (and
actors send on the connection itself), so actors never know whether their peer is in this
process or across the internet.
"""

from __future__ import annotations

import logging

import trio

from shard.errors import HandshakeError as HandshakeError  # defined there, re-exported here
from shard.messages import (
    HANDSHAKE_TIMEOUT_S as HANDSHAKE_TIMEOUT_S,
)
from shard.messages import (
    PROTOCOL_VERSION,
    Fault,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    Welcome,
)
from shard.transport import Connection, ConnectionClosed, Network, TransportError

log = logging.getLogger(__name__)

# Hello -> Welcome must finish within HANDSHAKE_TIMEOUT_S (shard.messages.ids, re-exported
# here) unless the caller says otherwise. Nodes pass their spec's limits.handshake_timeout_s.


async def dial_peer(
    network: Network,
    address: str,
    hello: Hello,
    *,
    timeout_s: float,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> Connection:
    """Dial ``address`` until it answers (peers may still be loading), then shake hands.

    Errors: ``TransportError`` when nothing answers within ``timeout_s``; ``HandshakeError``
    when the peer answers wrongly, or not within ``handshake_timeout_s``.
    """
    conn, _ = await dial_welcome(
        network, address, hello, timeout_s=timeout_s, handshake_timeout_s=handshake_timeout_s
    )
    return conn


async def dial_welcome(
    network: Network,
    address: str,
    hello: Hello,
    *,
    timeout_s: float,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> tuple[Connection, Welcome]:
    """``dial_peer``, also returning the peer's ``Welcome`` (a coordinator's generation)."""
    deadline = trio.current_time() + timeout_s
    delay = 0.05
    while True:
        try:
            conn = await network.dial(address)
            break
        except TransportError as exc:
            if trio.current_time() + delay > deadline:
                raise TransportError(
                    f"{hello.node}: could not reach {address} within {timeout_s:g} s ({exc}); "
                    "is that node running and is the address right?"
                ) from exc
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)
    return await _shake(conn, hello, address, timeout_s=handshake_timeout_s)


async def shake_hands(
    conn: Connection, hello: Hello, address: str, *, timeout_s: float
) -> Connection:
    """Dialer side of the handshake on an open ``conn``: send ``hello``, wait for ``Welcome``.

    Errors: ``HandshakeError`` (``conn`` closed) when the peer answers wrongly, or not within
    ``timeout_s``."""
    conn, _ = await _shake(conn, hello, address, timeout_s=timeout_s)
    return conn


async def _shake(
    conn: Connection, hello: Hello, address: str, *, timeout_s: float
) -> tuple[Connection, Welcome]:
    try:
        with trio.fail_after(timeout_s):
            await conn.send(hello)
            reply = await conn.receive()
    except (TransportError, trio.TooSlowError) as exc:
        await conn.aclose()
        raise HandshakeError(f"{hello.node}: no Welcome from {address}: {exc!r}") from exc
    if not isinstance(reply, Welcome):
        await conn.aclose()
        detail = reply.detail if isinstance(reply, Fault) else type(reply).__name__
        raise HandshakeError(f"{hello.node}: {address} refused the connection: {detail}")
    return conn, reply


async def accept_peer(
    conn: Connection, welcome: Welcome, *, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Hello:
    """Listener side of the handshake: read ``Hello``, check it, answer ``Welcome``.

    Errors: ``trio.TooSlowError`` when no ``Hello`` arrives within ``timeout_s``;
    ``HandshakeError`` for a wrong one."""
    with trio.fail_after(timeout_s):
        hello = await conn.receive()
    problem = None
    if not isinstance(hello, Hello):
        problem = f"expected Hello, got {type(hello).__name__}"
    elif hello.swarm != welcome.swarm:
        problem = f"swarm {hello.swarm!r} is not this swarm ({welcome.swarm!r})"
    elif hello.protocol != PROTOCOL_VERSION:
        problem = f"protocol {hello.protocol} is not {PROTOCOL_VERSION}"
    if problem is not None:
        try:
            await conn.send(Fault(node=welcome.node, kind="handshake", detail=problem))
        finally:
            await conn.aclose()
        raise HandshakeError(f"{welcome.node}: refused {conn.peer}: {problem}")
    assert isinstance(hello, Hello)
    await conn.send(welcome)
    return hello


async def pump_in(
    node: NodeName,
    conn: Connection,
    sink: trio.MemorySendChannel[Message],
    *,
    on_close: Fault | None = None,
) -> None:
    """Deliver everything received on ``conn`` to ``sink`` until the peer closes.

    When the peer goes away and ``on_close`` is given, that fault is delivered last, so the
    actor behind ``sink`` learns that its upstream is gone instead of waiting forever.
    """
    async with sink:
        try:
            while True:
                msg = await conn.receive()
                if not isinstance(msg, Heartbeat):  # keeps an idle edge alive, nothing else
                    await sink.send(msg)
        except ConnectionClosed:
            log.info("%s: %s closed the connection", node, conn.peer)
            if on_close is not None:
                await sink.send(on_close)
