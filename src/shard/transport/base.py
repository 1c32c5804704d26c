"""The transport interface: ``Connection``, ``Network``, their errors, and shared plumbing.

An actor talks to a peer through a ``Connection`` (typed ``Message`` in, typed ``Message``
out) that it got from a ``Network``: by dialing an address or by being handed one in a
``serve`` handler. Which network it is (memory channels, WebSockets, an emulated WAN) is
decided by the composition root, never by the actor.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from types import TracebackType
from typing import Generic, Protocol, Self, TypeVar

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


class ListenError(TransportError):
    """This process cannot listen on an address: the port is taken, the host is not one of
    this machine's, or the port needs privileges. The message names the address and what to
    do."""


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
    ``serve`` owns its own nursery and works in or out of the context. Implementations get
    that lifecycle from ``NetworkBase`` (nothing to own) or ``HostedNetwork`` (a nursery).
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


async def open_listeners(address: str) -> list[trio.SocketListener]:
    """TCP listeners on ``host:port`` (port 0: any free port).

    Errors: ``ValueError`` when ``address`` is not host:port; ``ListenError`` when it cannot
    be bound, in one line naming the address and what to do.
    """
    host, port = split_address(address)
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenError(f"cannot listen on {address}: {_why(host, port, exc)}") from None


def _why(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} is already in use (another node, a swarm from the same spec or "
            "another program is listening there); stop it, or give this node another port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; listen on one of its own addresses"
    if exc.errno == errno.EACCES:
        return f"permission denied for port {port}; use a port from 1024 up"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host {host!r} ({exc.strerror})"
    return exc.strerror or str(exc)


async def abandon(conn: Connection, *, grace_s: float = 0.1) -> None:
    """Close ``conn`` whose peer is dead, frozen or being replaced: shielded, and bounded by
    ``grace_s`` — a frozen peer never answers a WebSocket close handshake, and waiting for it
    would stall a recovery (the transport closes the socket anyway when the wait is cut)."""
    with trio.CancelScope(shield=True), trio.move_on_after(grace_s):
        await conn.aclose()


class NetworkBase:
    """The ``async with network:`` lifecycle that every ``Network`` shares.

    ``__aenter__`` and ``__aexit__`` call the hooks ``_enter`` and ``_exit``, which by default
    own nothing: a memory network dials without tasks, and a wrapper that does not own its
    inner network leaves opening it to whoever does.
    """

    async def __aenter__(self) -> Self:
        await self._enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(exc)

    async def _enter(self) -> None:
        """Take what the open network owns (default: nothing)."""

    async def _exit(self, exc: BaseException | None) -> None:
        """Release it; ``exc`` is the body's exception, if any (default: nothing)."""


C = TypeVar("C", bound=Connection)


class HostedNetwork(NetworkBase, Generic[C]):
    """A network whose dialed connections need tasks, in a nursery that the context owns.

    A subclass starts a connection's tasks in ``_nursery`` and keeps it in ``_open`` (with
    ``_tracking``) while it is open. Leaving the context normally first closes the open
    connections, concurrently and gracefully, then cancels whatever is left; leaving it on an
    exception cancels at once. The body's exception propagates unchanged, not wrapped in an
    exception group.
    """

    def __init__(self) -> None:
        self._cm: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._tasks: trio.Nursery | None = None
        self._open: set[C] = set()

    @property
    def _nursery(self) -> trio.Nursery:
        """Errors: ``RuntimeError`` when the network is not open."""
        if self._tasks is None:
            raise RuntimeError(
                f"{type(self).__name__}.dial() needs the network open: `async with network: ...`"
            )
        return self._tasks

    @contextmanager
    def _tracking(self, conn: C) -> Iterator[C]:
        """Keep ``conn`` in ``_open`` for the duration of the block."""
        self._open.add(conn)
        try:
            yield conn
        finally:
            self._open.discard(conn)

    async def _enter(self) -> None:
        if self._cm is not None:
            raise RuntimeError(f"{type(self).__name__} is already open")
        cm = trio.open_nursery()
        self._tasks = await cm.__aenter__()
        self._cm = cm

    async def _exit(self, exc: BaseException | None) -> None:
        cm, nursery = self._cm, self._tasks
        assert cm is not None
        assert nursery is not None
        try:
            if exc is None:
                async with trio.open_nursery() as closing:
                    for conn in list(self._open):
                        closing.start_soon(conn.aclose)
        finally:
            self._tasks = None
            self._cm = None
            nursery.cancel_scope.cancel()
            # Not given the body's exception: that one keeps propagating from the caller's
            # `async with`; the nursery only adds what its own tasks raised (bugs).
            await cm.__aexit__(None, None, None)
