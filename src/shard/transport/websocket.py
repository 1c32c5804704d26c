"""``WebSocketNetwork``: peers in other processes, one binary WebSocket message per frame.

Each frame is ``sealer.seal(wire.encode(msg))`` on a ``WebSocketConnection``
(``shard.transport.wsconnection``). A frame that fails to open or decode closes that one
WebSocket with 1008 (policy violation); the server keeps serving everyone else.

trio-websocket's defaults are changed on purpose: ``max_message_size`` follows the wire limits
(its 1 MiB default is smaller than one activation chunk), and the socket is read 64 KiB at a
time (with its 4 KiB default a 64 KiB round trip on loopback took 1.7-3.0 ms instead of
0.8 ms: see docs/transport.md).

Floods cost bounded memory: every connection of a network, dialed or served, reads through
one ``ByteBudget`` (``max_buffer_bytes`` of received messages in total, see
``shard.transport.budget``), and a server closes connections past ``max_connections`` at once.

Idle and slow peers cost nothing for long: with ``deadlines`` (``PeerDeadlines``), every
served connection is cut once it carried no message either way, with no work running, for
``idle_s``, or once a message it began arriving takes longer than ``message_s`` (plus a
second per 64 KiB of it); and when one host's connections fill ``max_peer_connections``,
the one idle longest (at least ``reclaim_idle_s``) is closed to make room for the new one
rather than the new one refused — so an honest client is served beside an idle flood from
its own address (``shard.transport.perhost``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Protocol

import attrs
import trio
import trio_websocket
from trio_websocket import HandshakeError

from shard.errors import HandshakeError as Refusal
from shard.transport.base import (
    Handler,
    HostedNetwork,
    TransportError,
    join_address,
    open_listeners,
    split_address,
)
from shard.transport.budget import BudgetedStream, ByteBudget
from shard.transport.guard import Activity, PeerDeadlines, police, serve_one, serve_pipe
from shard.transport.paths import Piped, Route, Router, Sealed
from shard.transport.perhost import PerHost
from shard.transport.wsconnection import (
    MESSAGE_TOO_BIG,
    OFFLOAD_BYTES,
    POLICY_VIOLATION,
    SEAL_OVERHEAD_BYTES,
    WebSocketConnection,
    WebSocketPipe,
    guarded_reader,
    max_message_size,
)
from shard.wire import PlainSealer, Sealer, WireLimits

log = logging.getLogger("shard.transport")

RECEIVE_BUFFER_BYTES = 64 * 1024
#: trio-websocket's queue between its reader task and ``receive``: one decoded message, so the
#: reader can still answer pings and close frames while an actor is busy with the last one.
MESSAGE_QUEUE = 1
#: Default node-wide budget, in messages of ``max_message_size``: one being decoded and one
#: being read on each of the two ring links, for instance.
BUFFER_MESSAGES = 4
MAX_CONNECTIONS = 256


@attrs.frozen
class _Target:
    """What a dial asks for: where, which resource, and which side of the handshake."""

    host: str
    port: int
    address: str
    path: str
    dialer: bool


class Handshake(Protocol):
    """Runs on a raw WebSocket right after it opened and before any wire frame, on both sides
    (``dialer`` says which): authenticates the peer and returns the connection's ``Sealer``
    (``shard.transport.secure``). To refuse the peer it tells it why, closes the WebSocket and
    raises ``shard.errors.HandshakeError``: ``dial`` raises that unchanged; ``serve`` logs it
    and drops the connection."""

    async def __call__(
        self, ws: trio_websocket.WebSocketConnection, *, peer: str, dialer: bool
    ) -> Sealer: ...


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()  # no effect once the scope is left


def _why(failure: BaseException) -> str:
    """A failed dial's reason; a refused upgrade says the server's reason (its HTTP body)."""
    if isinstance(failure, trio_websocket.ConnectionRejected):
        body = (failure.body or b"").decode(errors="replace")[:300]
        return f"refused (HTTP {failure.status_code}: {body})"
    return repr(failure)


class WebSocketNetwork(HostedNetwork[WebSocketConnection]):
    """A ``Network`` over trio-websocket; addresses are ``host:port``.

    ``connect_timeout_s`` bounds a dial (TCP connect, WebSocket handshake and ``handshake``),
    a client's opening handshakes on the server, and every close handshake. ``handshake``,
    when given, replaces ``sealer_factory``: each connection's sealer comes out of it.
    ``max_buffer_bytes`` (default ``BUFFER_MESSAGES`` messages) bounds the received bytes all
    connections hold together; ``max_connections`` bounds the connections ``serve`` keeps
    (past it a new one is closed at once, before its WebSocket handshake).
    ``max_peer_connections`` caps the connections ``serve`` holds open (or in their
    handshakes) per remote host; one more is answered HTTP 503 with the reason and closed,
    unless ``deadlines`` let an idle one from that host make room (see the module docstring;
    None: no deadlines, nothing reclaimed).

    Cancellation: leaving ``async with network:`` closes dialed connections still open.
    Errors: ``dial`` raises ``TransportError`` (refused, unreachable, timed out, rejected);
    see ``WebSocketConnection`` for ``send``/``receive``.
    """

    def __init__(
        self,
        *,
        limits: WireLimits | None = None,
        sealer_factory: Callable[[], Sealer] = PlainSealer,
        connect_timeout_s: float = 10.0,
        handshake: Handshake | None = None,
        max_buffer_bytes: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_peer_connections: int | None = None,
        deadlines: PeerDeadlines | None = None,
    ) -> None:
        super().__init__()
        self._limits = limits or WireLimits()
        self._deadlines = deadlines
        self._per_host = PerHost(max_peer_connections, deadlines)
        message = max_message_size(self._limits)
        self.budget = ByteBudget(max_buffer_bytes or BUFFER_MESSAGES * message)
        if self.budget.total < message:
            raise ValueError(
                f"max_buffer_bytes {self.budget.total} cannot hold one message of {message}"
            )
        self._max_connections = max_connections
        self._served = 0
        self._sealer_factory = sealer_factory
        self._handshake = handshake
        self._timeout_s = connect_timeout_s

    async def dial(self, address: str) -> WebSocketConnection:
        return await self.dial_path(address, "/", dialer=True)

    async def dial_path(self, address: str, path: str, *, dialer: bool) -> WebSocketConnection:
        """Dial WebSocket resource ``path`` at ``address``, running the handshake hook as
        ``dialer`` (``shard.transport.paths``). Errors: as ``dial``."""
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        target = _Target(host, port, address, path, dialer)
        conn: WebSocketConnection = await self._nursery.start(self._hold, target)
        return conn

    async def _hold(
        self,
        target: _Target,
        *,
        task_status: trio.TaskStatus[WebSocketConnection] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        address = target.address
        opened: list[WebSocketConnection] = []
        failure: BaseException | None = None
        refused: Refusal | None = None
        try:
            await self._client(target, opened, task_status)
        except* Refusal as group:
            refused = group.exceptions[0]  # type: ignore[assignment]  # a leaf, not a group
        except* (
            HandshakeError,
            trio_websocket.ConnectionClosed,
            OSError,
            trio.TooSlowError,
        ) as group:
            failure = group.exceptions[0]
        if refused is not None:
            raise refused
        if failure is None:
            return
        if not opened:
            raise TransportError(f"{address}: could not connect: {_why(failure)}") from failure
        log.debug("connection to %s ended: %r", address, failure)

    async def _client(
        self,
        target: _Target,
        opened: list[WebSocketConnection],
        task_status: trio.TaskStatus[WebSocketConnection],
    ) -> None:
        # We own the socket and the reader task (rather than trio-websocket's open_websocket)
        # so the socket is closed on every path: trio-websocket leaves a client's socket open
        # when the server is the one that closes.
        host, port, address = target.host, target.port, target.address
        deadline = trio.current_time() + self._timeout_s
        with trio.fail_at(deadline):
            raw = await trio.open_tcp_stream(host, port)
        stream = self._budgeted(raw)
        ended = trio.Event()  # the reader task is over: the peer's end closed
        async with stream, trio.open_nursery() as nursery:
            # trio-websocket's client waits for the server's answer to its upgrade even once
            # the stream has ended (a relay that accepts, then finds nobody to forward to,
            # and closes): without the race each such dial took the whole connect timeout
            handshaking = trio.CancelScope()
            nursery.start_soon(_cancel_when, ended, handshaking)
            with trio.fail_at(deadline), handshaking:
                ws = await trio_websocket.wrap_client_stream(
                    guarded_reader(nursery, address, ended),
                    stream,  # type: ignore[arg-type]  # it needs only a trio Stream
                    join_address(host, port),
                    target.path,
                    message_queue_size=MESSAGE_QUEUE,
                    max_message_size=max_message_size(self._limits),
                    receive_buffer_size=RECEIVE_BUFFER_BYTES,
                )
            if handshaking.cancelled_caught:
                raise HandshakeError("the peer closed the connection during the handshake")
            with trio.fail_at(deadline):
                sealer = await self._open_sealer(ws, address, dialer=target.dialer)
            conn = WebSocketConnection(ws, address, sealer, self._limits, self._timeout_s, stream)
            nursery.start_soon(conn.watch_reader)
            opened.append(conn)
            try:
                with self._tracking(conn):
                    task_status.started(conn)
                    await conn.released.wait()
            finally:
                nursery.cancel_scope.cancel()
                stream.release_all()

    def _budgeted(self, stream: trio.abc.Stream) -> BudgetedStream:
        return BudgetedStream(stream, self.budget, max_message=max_message_size(self._limits))

    @property
    def served(self) -> int:
        """Connections ``serve`` holds open now."""
        return self._served

    @property
    def reclaimed(self) -> int:
        """Idle connections closed to make room under a host's cap (``shard.transport.perhost``)."""
        return self._per_host.reclaimed

    async def _open_sealer(
        self, ws: trio_websocket.WebSocketConnection, peer: str, *, dialer: bool
    ) -> Sealer:
        if self._handshake is None:
            return self._sealer_factory()
        return await self._handshake(ws, peer=peer, dialer=dialer)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (port 0: any free port) until cancelled.

        Reports the bound ``host:port`` through ``task_status``. Cancellation: stops
        listening, cancels the handlers and closes their connections. Errors: ``ListenError``
        (one line: which address, why, what to do) when the address cannot be bound; a
        handler's ``WireError``/``TransportError`` ends only its connection (logged); any
        other exception propagates and ends the server. A path other than ``/`` is refused
        (HTTP 404).
        """
        await self.serve_paths(address, handler, _no_paths, task_status=task_status)

    async def serve_paths(
        self,
        address: str,
        handler: Handler,
        router: Router,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As ``serve``; a WebSocket resource other than ``/`` is served as ``router`` says
        (``shard.transport.paths``), or refused with HTTP 404 when it says None."""
        host, _ = split_address(address)
        listeners = await open_listeners(address)
        bound = join_address(host, listeners[0].socket.getsockname()[1])
        accept = partial(self._accept, handler, router)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, accept, listeners)
            task_status.started(bound)

    async def _accept(self, handler: Handler, router: Router, raw: trio.SocketStream) -> None:
        try:
            host, port = raw.socket.getpeername()[:2]
        except OSError:  # already reset by the client
            host, port = "?", 0
        peer = join_address(host, port)
        if self._served >= self._max_connections:
            log.warning(
                "refused %s: %d connections open (limits.max_connections)", peer, self._served
            )
            await raw.aclose()
            return
        mine = self._per_host.admit(host, peer)
        if isinstance(mine, str):  # its host is at the cap, none idle: refused (logged)
            await self._reject(raw, mine)
            return
        self._served += 1
        stream = self._budgeted(raw)
        try:
            with mine.scope:
                await self._serve_stream(handler, router, stream, peer, mine.activity)
        finally:
            self._served -= 1
            self._per_host.release(host, mine)
            stream.release_all()

    async def _reject(self, stream: trio.SocketStream, reason: str) -> None:
        """Answer the WebSocket upgrade with HTTP 503 and ``reason``, then close."""
        async with stream, trio.open_nursery() as nursery:
            with trio.move_on_after(self._timeout_s):
                try:
                    request = await trio_websocket.wrap_server_stream(
                        guarded_reader(nursery, "a refused peer"),
                        stream,
                        message_queue_size=MESSAGE_QUEUE,
                    )
                    await request.reject(503, body=reason.encode())
                except trio_websocket.ConnectionClosed:
                    pass
            nursery.cancel_scope.cancel()

    async def _serve_stream(
        self,
        handler: Handler,
        router: Router,
        stream: BudgetedStream,
        peer: str,
        activity: Activity,
    ) -> None:
        async with stream, trio.open_nursery() as nursery:
            try:
                opened = await self._open_server(nursery, handler, router, stream, peer)
                if opened is None:
                    return
                ws, route, sealer = opened
                if self._deadlines is not None:
                    scope = nursery.cancel_scope
                    nursery.start_soon(police, stream, activity, self._deadlines, scope, peer)
                if isinstance(route, Piped):
                    pipe = WebSocketPipe(ws, peer, stream, self._timeout_s, activity)
                    nursery.start_soon(pipe.watch_reader)
                    await serve_pipe(pipe, route.handler)
                    return
                assert sealer is not None
                conn = WebSocketConnection(
                    ws, peer, sealer, self._limits, self._timeout_s, stream, activity
                )
                nursery.start_soon(conn.watch_reader)
                await serve_one(conn, route.handler)
            finally:
                nursery.cancel_scope.cancel()

    async def _open_server(
        self,
        nursery: trio.Nursery,
        handler: Handler,
        router: Router,
        stream: BudgetedStream,
        peer: str,
    ) -> tuple[trio_websocket.WebSocketConnection, Route, Sealer | None] | None:
        """The WebSocket upgrade, the route of its path and (for a ``Sealed`` route) the
        handshake, within ``connect_timeout_s``; None when any of it failed (logged)."""
        ws: trio_websocket.WebSocketConnection | None = None
        route: Route | None = None
        with trio.move_on_after(self._timeout_s):
            try:
                request = await trio_websocket.wrap_server_stream(
                    guarded_reader(nursery, peer),
                    stream,
                    message_queue_size=MESSAGE_QUEUE,
                    max_message_size=max_message_size(self._limits),
                    receive_buffer_size=RECEIVE_BUFFER_BYTES,
                )
                route = (
                    Sealed(handler, dialer=False) if request.path == "/" else router(request.path)
                )
                if route is None:
                    log.info("refused %s: no such path %r", peer, request.path[:80])
                    await request.reject(404, body=b"no such path on this node")
                    return None
                if isinstance(route, Piped) and route.ready is not None and not await route.ready():
                    await request.reject(410, body=b"the other end of this edge did not come")
                    return None
                ws = await request.accept()
                if isinstance(route, Piped):
                    return ws, route, None
                return ws, route, await self._open_sealer(ws, peer, dialer=route.dialer)
            except trio_websocket.ConnectionClosed:
                pass
            except Refusal as exc:
                log.warning("handshake with %s failed: %s", peer, exc)
                return None
        what = "a WebSocket" if ws is None else "the secure"
        log.info("client %s did not complete %s handshake", peer, what)
        return None


def _no_paths(path: str) -> Route | None:
    return None


__all__ = [
    "MESSAGE_TOO_BIG",
    "OFFLOAD_BYTES",
    "POLICY_VIOLATION",
    "SEAL_OVERHEAD_BYTES",
    "Handshake",
    "WebSocketConnection",
    "WebSocketNetwork",
    "max_message_size",
]
