"""``WebSocketConnection``: one WebSocket carrying sealed wire frames, and its size rules.

Each frame is ``sealer.seal(wire.encode(msg))``; the receiver opens and decodes it. A frame
that fails to open or decode closes that one WebSocket with 1008 (policy violation) and
raises ``WireError`` to whoever was receiving. A frame larger than ``OFFLOAD_BYTES`` is
sealed or opened and coded in a worker thread (decryption is proportional to its size), and
a received message's bytes go back to the node's ``ByteBudget`` once it is decoded.

Each connection (and pipe) keeps its ``Activity``: every whole message sent or received
touches it, so a listening network can tell an idle connection from a busy one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import cast

import trio
import trio_websocket
from wsproto.utilities import LocalProtocolError

from shard.compute import offload
from shard.messages import Message
from shard.transport.base import ConnectionClosed, ConnectionStatistics, Counters
from shard.transport.budget import BudgetedStream
from shard.transport.guard import Activity
from shard.wire import Sealer, WireError, WireLimits, decode, encode

log = logging.getLogger("shard.transport")

#: Room for what a sealer adds to an encoded frame (nonce, tag, counters).
SEAL_OVERHEAD_BYTES = 4096
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009
#: Frames bigger than this are sealed/opened and coded in a worker thread (64 MiB of ChaCha20
#: is ~50 ms of CPU; below 1 MiB the thread hop costs more than it saves).
OFFLOAD_BYTES = 1 << 20


class _GuardedReader:
    """The nursery that trio-websocket starts a connection's reader task in, with that task
    guarded (``guarded_reader``)."""

    def __init__(self, nursery: trio.Nursery, peer: str, ended: trio.Event | None) -> None:
        self._nursery = nursery
        self._peer = peer
        self._ended = ended

    def start_soon(self, fn: Callable[[], Awaitable[object]], *args: object) -> None:
        self._nursery.start_soon(self._run, fn, *args)

    async def _run(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        try:
            await fn(*args)
        except LocalProtocolError as exc:
            log.info("%s went on talking after its connection began to close (%s); cut",
                     self._peer, exc)  # fmt: skip
            self._nursery.cancel_scope.cancel()
        finally:
            if self._ended is not None:
                self._ended.set()


def guarded_reader(
    nursery: trio.Nursery, peer: str, ended: trio.Event | None = None
) -> trio.Nursery:
    """``nursery`` as trio-websocket's ``wrap_*_stream`` should get it: one connection's.

    trio-websocket's reader task answers the peer itself (a pong for a ping, a 1009 close for
    a message over the cap). Once this side has begun to close (say, after a malformed frame)
    wsproto forbids those answers and raises ``LocalProtocolError`` in the reader task, and a
    peer decides when that happens: a ping or a big frame after the close was enough to end
    the whole node. Guarded, it ends only this connection: ``nursery`` (the connection's own)
    is cancelled, logged at info (the malformed frame before it was already logged).
    ``ended``, when given, is set once the reader task is over (the peer's end closed, or
    the connection was cut)."""
    return cast(trio.Nursery, _GuardedReader(nursery, peer, ended))


class WebSocketConnection:
    """One WebSocket, client or server side, carrying sealed wire frames."""

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        peer: str,
        sealer: Sealer,
        limits: WireLimits,
        close_s: float,
        stream: BudgetedStream | None = None,
        activity: Activity | None = None,
    ) -> None:
        self._ws = ws
        self._stream = stream
        self._peer = peer
        self.activity = activity or Activity()
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
        async with self._send_lock:
            if _payload_bytes(msg) > OFFLOAD_BYTES:
                sealed = await offload.run_sync(self._encode_seal, msg)
            else:
                sealed = self._encode_seal(msg)
            try:
                await self._ws.send_message(sealed)
            except trio_websocket.ConnectionClosed as exc:
                raise ConnectionClosed(f"{self._peer}: {_describe(exc)}") from None
        self._counters.sent(len(sealed))
        self.activity.touch()

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
            try:
                msg = await self._open_decode(data)
            finally:
                if self._stream is not None:
                    self._stream.take_message()  # decoded (or dropped): off the budget
        except WireError as exc:
            await self._close(POLICY_VIOLATION, str(exc))
            exc.add_note(f"from {self._peer} (WebSocket); connection closed (1008)")
            raise
        self._counters.received(len(data))
        self.activity.touch()
        return msg

    def _encode_seal(self, msg: Message) -> bytes:
        return self._sealer.seal(encode(msg, limits=self._limits))

    async def _open_decode(self, data: bytes | str) -> Message:
        if isinstance(data, str):
            raise WireError("frame: a text WebSocket message, expected binary")
        if len(data) > OFFLOAD_BYTES:
            return await offload.run_sync(self._open_decode_sync, data)
        return self._open_decode_sync(data)

    def _open_decode_sync(self, data: bytes) -> Message:
        return decode(self._sealer.open(data), limits=self._limits)

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


class WebSocketPipe:
    """A served WebSocket seen as whole messages, never opened or decoded (a relay's end of
    a relayed edge: ``shard.transport.paths.Pipe``). A message's bytes stay on the node's
    budget until ``release``."""

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        peer: str,
        stream: BudgetedStream,
        close_s: float,
        activity: Activity | None = None,
    ) -> None:
        self._ws = ws
        self._peer = peer
        self._stream = stream
        self._close_s = close_s
        self.activity = activity or Activity()
        self._reader_gone = False
        self._closing: trio.CancelScope | None = None

    @property
    def peer(self) -> str:
        return self._peer

    async def receive(self) -> object:
        try:
            message = await self._ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise ConnectionClosed(f"{self._peer}: {_describe(exc)}") from None
        self.activity.touch()
        return message

    def release(self) -> None:
        self._stream.take_message()

    async def send(self, item: object) -> None:
        if not isinstance(item, bytes | str):
            raise TypeError(f"a WebSocket pipe carries bytes or str, not {type(item).__name__}")
        try:
            await self._ws.send_message(item)
        except trio_websocket.ConnectionClosed as exc:
            raise ConnectionClosed(f"{self._peer}: {_describe(exc)}") from None
        self.activity.touch()

    async def aclose(self) -> None:
        # As WebSocketConnection._close: bounded, and cut short once the reader is gone (no
        # one could read the peer's answer).
        with trio.move_on_after(self._close_s) as scope:
            self._closing = scope
            if self._reader_gone:
                scope.cancel()
            await self._ws.aclose()

    async def watch_reader(self) -> None:
        """As ``WebSocketConnection.watch_reader``."""
        try:
            await trio.sleep_forever()
        finally:
            self._reader_gone = True
            if self._closing is not None:
                self._closing.cancel()


def max_message_size(limits: WireLimits) -> int:
    """trio-websocket's per-message cap for frames under ``limits``, sealed."""
    return limits.max_frame_bytes + SEAL_OVERHEAD_BYTES


def _payload_bytes(msg: Message) -> int:
    """Tensor bytes a message carries (what makes a frame large)."""
    hidden = getattr(msg, "hidden", None)
    data = getattr(hidden, "data", b"")
    return len(data) if isinstance(data, bytes | bytearray | memoryview) else 0


def _describe(exc: trio_websocket.ConnectionClosed) -> str:
    reason = exc.reason
    if reason is None:
        return "connection closed"
    detail = f": {reason.reason}" if reason.reason else ""
    return f"connection closed ({reason.code} {reason.name}{detail})"
