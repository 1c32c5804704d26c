"""The transport interface: ``Connection``, ``Network``, their errors, and shared plumbing.

An actor talks to a peer through a ``Connection`` (typed ``Message`` in, typed ``Message``
out) that it got from a ``Network``: by dialing an address or by being handed one in a
``serve`` handler. Which network it is (memory channels, WebSockets, an emulated WAN) is
decided by the composition root, never by the actor.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Protocol, Self

import attrs
import trio

from shard.messages import Message

log = logging.getLogger("shard.transport")


class TransportError(Exception):
    """The peer is unreachable or went away: connect failed or timed out, connection reset.

    The message always names the peer address, so an operator knows which link broke.
    """


class ConnectionClosed(TransportError):
    """The connection is closed: the peer closed it, or this side already did."""


class Connection(Protocol):
    """One bidirectional, FIFO, message-oriented link to a peer.

    ``send`` may be called from several tasks (frames never interleave); ``receive`` from one
    task at a time. A cancelled ``send`` may leave a partial frame behind: close the
    connection. Errors: ``send`` raises ``ConnectionClosed`` / ``TransportError``;
    ``receive`` raises ``ConnectionClosed`` once the peer closed (after every message it sent
    before closing was received) and ``WireError`` on a malformed frame, after having reset
    this connection.
    """

    @property
    def peer(self) -> str:
        """Human-readable address of the other end."""
        ...

    async def send(self, msg: Message) -> None: ...

    async def receive(self) -> Message: ...

    async def aclose(self) -> None: ...


Handler = Callable[[Connection], Awaitable[None]]


class Network(Protocol):
    """How actors reach each other; injected so tests control it.

    Use a network as an async context manager (``async with network:``): connections it
    dials may need background tasks (a WebSocket reader, a delay pump) and those live in a
    nursery that the context owns. Leaving the context closes what is still open.
    ``serve`` owns its own nursery and works in or out of the context.
    """

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def dial(self, address: str) -> Connection: ...

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None: ...


@attrs.frozen
class ConnectionStatistics:
    """Counters of one connection. ``bytes_*`` count frames as they cross the transport
    (sealed wire frames for WebSocket; encoded frames for memory with ``encode_frames``,
    else 0)."""

    frames_sent: int = 0
    frames_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@attrs.define
class Counters:
    """Mutable counters behind ``ConnectionStatistics``."""

    frames_sent: int = 0
    frames_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def sent(self, nbytes: int) -> None:
        self.frames_sent += 1
        self.bytes_sent += nbytes

    def received(self, nbytes: int) -> None:
        self.frames_received += 1
        self.bytes_received += nbytes

    def snapshot(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            self.frames_sent, self.frames_received, self.bytes_sent, self.bytes_received
        )


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``.

    Errors: ``ValueError`` naming the address when it is not of that form.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"address {address!r} is not host:port (e.g. 127.0.0.1:7000)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def join_address(host: str, port: int) -> str:
    """``(host, port)`` -> ``"host:port"``, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def abandon(conn: Connection, *, grace_s: float = 0.1) -> None:
    """Close ``conn`` whose peer is dead, frozen or being replaced: shielded, and bounded by
    ``grace_s`` — a frozen peer never answers a WebSocket close handshake, and waiting for it
    would stall a recovery (the transport closes the socket anyway when the wait is cut)."""
    with trio.CancelScope(shield=True), trio.move_on_after(grace_s):
        await conn.aclose()


class TaskHost:
    """The nursery behind ``async with network:``, for connections that need tasks.

    Leaving the context normally first lets ``close_all`` close the open connections
    gracefully, then cancels whatever is left; leaving it on an exception cancels at once. The
    body's exception propagates unchanged, not wrapped in an exception group.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._cm: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def nursery(self) -> trio.Nursery:
        """Errors: ``RuntimeError`` when the network is not open."""
        if self._nursery is None:
            raise RuntimeError(
                f"{self._owner}.dial() needs the network open: `async with network: ...`"
            )
        return self._nursery

    async def enter(self) -> None:
        if self._cm is not None:
            raise RuntimeError(f"{self._owner} is already open")
        cm = trio.open_nursery()
        self._nursery = await cm.__aenter__()
        self._cm = cm

    async def exit(
        self, exc: BaseException | None, close_all: Callable[[], Awaitable[None]]
    ) -> None:
        cm, nursery = self._cm, self._nursery
        assert cm is not None
        assert nursery is not None
        try:
            if exc is None:
                await close_all()
        finally:
            self._nursery = None
            self._cm = None
            nursery.cancel_scope.cancel()
            # Not given the body's exception: that one keeps propagating from the caller's
            # `async with`; the nursery only adds what its own tasks raised (bugs).
            await cm.__aexit__(None, None, None)
