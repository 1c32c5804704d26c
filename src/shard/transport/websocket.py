"""``WebSocketNetwork``: peers in other processes, one binary WebSocket message per frame.

Each frame is ``sealer.seal(wire.encode(msg))``; the receiver opens and decodes it. A frame
that fails to open or decode closes that one WebSocket with 1008 (policy violation) and
raises ``WireError`` to whoever was receiving; the server keeps serving everyone else.

trio-websocket's defaults are changed on purpose: ``max_message_size`` follows the wire limits
(its 1 MiB default is smaller than one activation chunk), and the socket is read 64 KiB at a
time (with its 4 KiB default a 64 KiB round trip on loopback took 1.7-3.0 ms instead of
0.8 ms: see docs/transport.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Protocol

import trio
import trio_websocket
from trio_websocket import HandshakeError

from shard.errors import HandshakeError as Refusal
from shard.messages import Message
from shard.transport.base import (
    ConnectionClosed,
    ConnectionStatistics,
    Counters,
    Handler,
    HostedNetwork,
    TransportError,
    join_address,
    open_listeners,
    split_address,
)
from shard.transport.guard import serve_one
from shard.wire import PlainSealer, Sealer, WireError, WireLimits, decode, encode

log = logging.getLogger("shard.transport")

RECEIVE_BUFFER_BYTES = 64 * 1024
#: Room for what a sealer adds to an encoded frame (nonce, tag, counters).
SEAL_OVERHEAD_BYTES = 4096
#: trio-websocket's queue between its reader task and ``receive``: one decoded message, so the
#: reader can still answer pings and close frames while an actor is busy with the last one.
MESSAGE_QUEUE = 1
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009


class Handshake(Protocol):
    """Runs on a raw WebSocket right after it opened and before any wire frame, on both sides
    (``dialer`` says which): authenticates the peer and returns the connection's ``Sealer``
    (``shard.transport.secure``). To refuse the peer it tells it why, closes the WebSocket and
    raises ``shard.errors.HandshakeError``: ``dial`` raises that unchanged; ``serve`` logs it
    and drops the connection."""

    async def __call__(
        self, ws: trio_websocket.WebSocketConnection, *, peer: str, dialer: bool
    ) -> Sealer: ...


class WebSocketConnection:
    """One WebSocket, client or server side, carrying sealed wire frames."""

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        peer: str,
        sealer: Sealer,
        limits: WireLimits,
        close_s: float,
    ) -> None:
        self._ws = ws
        self._peer = peer
        self._sealer = sealer
        self._limits = limits
        self._close_s = close_s
        # Seal and hand over under one lock: a sealer numbers frames, so the order frames are
        # sealed in must be the order they are written.
        self._send_lock = trio.Lock()
        self._counters = Counters()
        self._reader_gone = False
        self._closing: trio.CancelScope | None = None
        self.released = trio.Event()

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def sealer(self) -> Sealer:
        """This connection's sealer (after a secure handshake it knows the peer's identity)."""
        return self._sealer

    def statistics(self) -> ConnectionStatistics:
        return self._counters.snapshot()

    async def send(self, msg: Message) -> None:
        frame = encode(msg, limits=self._limits)
        async with self._send_lock:
            sealed = self._sealer.seal(frame)
            try:
                await self._ws.send_message(sealed)
            except trio_websocket.ConnectionClosed as exc:
                raise ConnectionClosed(f"{self._peer}: {_describe(exc)}") from None
        self._counters.sent(len(sealed))

    async def receive(self) -> Message:
        try:
            data = await self._ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            if self._refused_here(exc.reason):
                raise WireError(
                    f"frame: larger than {self._limits.max_frame_bytes} bytes from {self._peer}"
                    "; connection closed (1009)"
                ) from None
            raise ConnectionClosed(f"{self._peer}: {_describe(exc)}") from None
        try:
            if isinstance(data, str):
                raise WireError("frame: a text WebSocket message, expected binary")
            msg = decode(self._sealer.open(data), limits=self._limits)
        except WireError as exc:
            await self._close(POLICY_VIOLATION, str(exc))
            exc.add_note(f"from {self._peer} (WebSocket); connection closed (1008)")
            raise
        self._counters.received(len(data))
        return msg

    async def aclose(self) -> None:
        await self._close(1000, None)

    def _refused_here(self, reason: trio_websocket.CloseReason | None) -> bool:
        # trio-websocket closes with 1009 itself when a message exceeds our cap, and reports
        # it exactly like a peer's 1009 except for the text, which names the cap. A peer's
        # 1009 (it refused our frame) is a ConnectionClosed for us, not a malformed frame.
        return (
            reason is not None
            and reason.code == MESSAGE_TOO_BIG
            and reason.reason
            == f"Exceeded maximum message size: {max_message_size(self._limits)} bytes"
        )

    async def _close(self, code: int, reason: str | None) -> None:
        # The close handshake waits for the peer's answer, which only the reader task can
        # see. So it is bounded (a dead peer must not hang an aclose, often called shielded)
        # and cut short when the reader is cancelled. trio-websocket closes the socket anyway.
        if reason is not None:
            reason = reason.encode()[:120].decode(errors="ignore")  # close frames cap at 123 B
        try:
            with trio.move_on_after(self._close_s) as scope:
                if self._closing is None:
                    self._closing = scope
                if self._reader_gone:
                    scope.cancel()
                await self._ws.aclose(code, reason)
        finally:
            self.released.set()

    async def watch_reader(self) -> None:
        """Run beside the reader task, in its nursery, until cancelled with it.

        Cancellation: is the point; it tells a pending close handshake not to wait for an
        answer no one will read.
        """
        try:
            await trio.sleep_forever()
        finally:
            self._reader_gone = True
            if self._closing is not None:
                self._closing.cancel()


def max_message_size(limits: WireLimits) -> int:
    """trio-websocket's per-message cap for frames under ``limits``, sealed."""
    return limits.max_frame_bytes + SEAL_OVERHEAD_BYTES


def _why(failure: BaseException) -> str:
    """A failed dial's reason; a refused upgrade says the server's reason (its HTTP body)."""
    if isinstance(failure, trio_websocket.ConnectionRejected):
        body = (failure.body or b"").decode(errors="replace")[:300]
        return f"refused (HTTP {failure.status_code}: {body})"
    return repr(failure)


def _describe(exc: trio_websocket.ConnectionClosed) -> str:
    reason = exc.reason
    if reason is None:
        return "connection closed"
    detail = f": {reason.reason}" if reason.reason else ""
    return f"connection closed ({reason.code} {reason.name}{detail})"


class WebSocketNetwork(HostedNetwork[WebSocketConnection]):
    """A ``Network`` over trio-websocket; addresses are ``host:port``.

    ``connect_timeout_s`` bounds a dial (TCP connect, WebSocket handshake and ``handshake``),
    a client's opening handshakes on the server, and every close handshake. ``handshake``,
    when given, replaces ``sealer_factory``: each connection's sealer comes out of it.
    ``max_peer_connections`` caps the connections ``serve`` holds open (or in their
    handshakes) per remote host; one more is answered HTTP 503 with the reason and closed.

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
        max_peer_connections: int | None = None,
    ) -> None:
        super().__init__()
        self._limits = limits or WireLimits()
        self._max_peer_connections = max_peer_connections
        self._per_peer: dict[str, int] = {}  # remote host -> connections open or opening
        self._sealer_factory = sealer_factory
        self._handshake = handshake
        self._timeout_s = connect_timeout_s

    async def dial(self, address: str) -> WebSocketConnection:
        try:
            host, port = split_address(address)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        conn: WebSocketConnection = await self._nursery.start(self._hold, host, port, address)
        return conn

    async def _hold(
        self,
        host: str,
        port: int,
        address: str,
        *,
        task_status: trio.TaskStatus[WebSocketConnection] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        opened: list[WebSocketConnection] = []
        failure: BaseException | None = None
        refused: Refusal | None = None
        try:
            await self._client(host, port, address, opened, task_status)
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
        host: str,
        port: int,
        address: str,
        opened: list[WebSocketConnection],
        task_status: trio.TaskStatus[WebSocketConnection],
    ) -> None:
        # We own the socket and the reader task (rather than trio-websocket's open_websocket)
        # so the socket is closed on every path: trio-websocket leaves a client's socket open
        # when the server is the one that closes.
        deadline = trio.current_time() + self._timeout_s
        with trio.fail_at(deadline):
            stream = await trio.open_tcp_stream(host, port)
        async with stream, trio.open_nursery() as nursery:
            with trio.fail_at(deadline):
                ws = await trio_websocket.wrap_client_stream(
                    nursery,
                    stream,
                    join_address(host, port),
                    "/",
                    message_queue_size=MESSAGE_QUEUE,
                    max_message_size=max_message_size(self._limits),
                    receive_buffer_size=RECEIVE_BUFFER_BYTES,
                )
                sealer = await self._open_sealer(ws, address, dialer=True)
            conn = WebSocketConnection(ws, address, sealer, self._limits, self._timeout_s)
            nursery.start_soon(conn.watch_reader)
            opened.append(conn)
            try:
                with self._tracking(conn):
                    task_status.started(conn)
                    await conn.released.wait()
            finally:
                nursery.cancel_scope.cancel()

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
        other exception propagates and ends the server.
        """
        host, _ = split_address(address)
        listeners = await open_listeners(address)
        bound = join_address(host, listeners[0].socket.getsockname()[1])
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, partial(self._accept, handler), listeners)
            task_status.started(bound)

    async def _accept(self, handler: Handler, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:  # already reset by the client
            host, port = "?", 0
        peer = join_address(host, port)
        cap = self._max_peer_connections
        if cap is not None and self._per_peer.get(host, 0) >= cap:
            reason = (
                f"too many connections from {host}: at most {cap} at once "
                "(limits.max_peer_connections); close some and retry"
            )
            log.warning("refused %s: %s", peer, reason)
            await self._reject(stream, reason)
            return
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        try:
            await self._serve_stream(handler, stream, peer)
        finally:
            self._per_peer[host] -= 1
            if not self._per_peer[host]:
                del self._per_peer[host]

    async def _reject(self, stream: trio.SocketStream, reason: str) -> None:
        """Answer the WebSocket upgrade with HTTP 503 and ``reason``, then close."""
        async with stream, trio.open_nursery() as nursery:
            with trio.move_on_after(self._timeout_s):
                try:
                    request = await trio_websocket.wrap_server_stream(
                        nursery, stream, message_queue_size=MESSAGE_QUEUE
                    )
                    await request.reject(503, body=reason.encode())
                except trio_websocket.ConnectionClosed:
                    pass
            nursery.cancel_scope.cancel()

    async def _serve_stream(self, handler: Handler, stream: trio.SocketStream, peer: str) -> None:
        async with stream, trio.open_nursery() as nursery:
            ws: trio_websocket.WebSocketConnection | None = None
            sealer: Sealer | None = None
            refused: Refusal | None = None
            with trio.move_on_after(self._timeout_s):
                try:
                    request = await trio_websocket.wrap_server_stream(
                        nursery,
                        stream,
                        message_queue_size=MESSAGE_QUEUE,
                        max_message_size=max_message_size(self._limits),
                        receive_buffer_size=RECEIVE_BUFFER_BYTES,
                    )
                    ws = await request.accept()
                    sealer = await self._open_sealer(ws, peer, dialer=False)
                except trio_websocket.ConnectionClosed:
                    pass
                except Refusal as exc:
                    refused = exc
            try:
                if refused is not None:
                    log.warning("handshake with %s failed: %s", peer, refused)
                    return
                if ws is None or sealer is None:
                    what = "a WebSocket" if ws is None else "the secure"
                    log.info("client %s did not complete %s handshake", peer, what)
                    return
                conn = WebSocketConnection(ws, peer, sealer, self._limits, self._timeout_s)
                nursery.start_soon(conn.watch_reader)
                await serve_one(conn, handler)
            finally:
                nursery.cancel_scope.cancel()
