"""``MemoryNetwork``: peers in one process, connected by pairs of trio memory channels.

Messages cross as the very same frozen objects (zero copies) unless ``encode_frames`` is set,
in which case every message goes through ``shard.wire.encode``/``decode`` exactly as it would
between processes: an in-process test of the codec on real traffic.
"""

from __future__ import annotations

import itertools

import trio

from shard.messages import Message
from shard.transport.base import (
    ConnectionClosed,
    ConnectionStatistics,
    Counters,
    Handler,
    NetworkBase,
    TransportError,
)
from shard.transport.guard import serve_one, serve_pipe
from shard.transport.paths import Piped, Router, Sealed
from shard.wire import WireError, WireLimits, decode, encode

#: Frames one direction buffers before ``send`` blocks. A socket buffers too: with a
#: rendezvous channel, two peers that both send before they receive (a heartbeat crossing a
#: reply) would deadlock, which they never do over TCP.
BUFFERED_FRAMES = 64

_Frame = Message | bytes


class MemoryConnection:
    """One end of an in-process connection.

    ``aclose`` closes both directions at once: the peer's ``receive`` drains what was already
    sent, then raises ``ConnectionClosed``; the peer's ``send`` raises ``ConnectionClosed``.
    """

    def __init__(
        self,
        peer: str,
        outgoing: trio.MemorySendChannel[_Frame],
        incoming: trio.MemoryReceiveChannel[_Frame],
        limits: WireLimits | None,
    ) -> None:
        self._peer = peer
        self._outgoing = outgoing
        self._incoming = incoming
        self._limits = limits
        self._counters = Counters()

    @property
    def peer(self) -> str:
        return self._peer

    def statistics(self) -> ConnectionStatistics:
        return self._counters.snapshot()

    async def send(self, msg: Message) -> None:
        await self.send_frame(msg if self._limits is None else encode(msg, limits=self._limits))

    async def send_frame(self, frame: object) -> None:
        """Send one frame as it is (a message, or its encoded bytes): a relay's pipe."""
        if not isinstance(frame, bytes | Message):
            raise TypeError(f"a memory frame is a message or bytes, not {type(frame).__name__}")
        try:
            await self._outgoing.send(frame)
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self._peer}: connection already closed here") from None
        except trio.BrokenResourceError:
            raise ConnectionClosed(f"{self._peer}: peer closed the connection") from None
        self._counters.sent(len(frame) if isinstance(frame, bytes) else 0)

    async def receive_frame(self) -> _Frame:
        """The next frame as it came, not decoded (a relay's pipe)."""
        try:
            return await self._incoming.receive()
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self._peer}: connection already closed here") from None
        except trio.EndOfChannel:
            raise ConnectionClosed(f"{self._peer}: peer closed the connection") from None

    async def receive(self) -> Message:
        frame = await self.receive_frame()
        if not isinstance(frame, bytes):
            self._counters.received(0)
            return frame
        assert self._limits is not None
        try:
            msg = decode(frame, limits=self._limits)
        except WireError as exc:
            await self.aclose()
            exc.add_note(f"from {self._peer} (memory); connection closed")
            raise
        self._counters.received(len(frame))
        return msg

    async def aclose(self) -> None:
        self._outgoing.close()
        self._incoming.close()
        await trio.lowlevel.checkpoint()


class MemoryPipe:
    """A served memory connection seen as whole frames, never decoded (a relay's end of a
    relayed edge: ``shard.transport.paths.Pipe``)."""

    def __init__(self, conn: MemoryConnection) -> None:
        self._conn = conn

    @property
    def peer(self) -> str:
        return self._conn.peer

    async def receive(self) -> object:
        return await self._conn.receive_frame()

    def release(self) -> None:
        """Nothing to give back: a memory network has no byte budget."""

    async def send(self, item: object) -> None:
        await self._conn.send_frame(item)

    async def aclose(self) -> None:
        await self._conn.aclose()


class MemoryNetwork(NetworkBase):
    """An in-process ``Network``: ``serve`` registers a name, ``dial`` that name connects.

    Any string is an address; ``serve`` reports the same string as bound. Dialing needs no
    background task, so ``async with network:`` is optional here (but harmless). Paths
    (``shard.transport.paths``) travel beside each connection; there is no handshake, so a
    ``Sealed`` route's ``dialer`` changes nothing here, and a refused path is a connection
    closed at once.

    Errors: ``dial`` raises ``TransportError`` when nothing serves the name; ``serve`` raises
    ``TransportError`` when the name is already served.
    """

    def __init__(self, *, encode_frames: bool = False, limits: WireLimits | None = None) -> None:
        self._limits = (limits or WireLimits()) if encode_frames else None
        self._listeners: dict[str, trio.MemorySendChannel[tuple[MemoryConnection, str]]] = {}
        self._clients = itertools.count(1)

    async def dial(self, address: str) -> MemoryConnection:
        return await self.dial_path(address, "/", dialer=True)

    async def dial_path(self, address: str, path: str, *, dialer: bool) -> MemoryConnection:
        listener = self._listeners.get(address)
        if listener is None:
            raise TransportError(f"{address}: connection refused (nothing serves that name)")
        to_server, server_in = trio.open_memory_channel[_Frame](BUFFERED_FRAMES)
        to_client, client_in = trio.open_memory_channel[_Frame](BUFFERED_FRAMES)
        client = MemoryConnection(address, to_server, client_in, self._limits)
        name = f"memory-client-{next(self._clients)}->{address}"
        server = MemoryConnection(name, to_client, server_in, self._limits)
        try:
            await listener.send((server, path))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise TransportError(f"{address}: connection refused (listener stopped)") from None
        return client

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``address`` until cancelled, running ``handler`` once per connection.

        Cancellation: stops accepting, cancels the handlers and closes their connections.
        Errors: a handler's connection errors end only its connection (logged:
        ``shard.transport.guard.serve_one``); any other exception propagates and ends the server.
        """
        await self.serve_paths(address, handler, lambda path: None, task_status=task_status)

    async def serve_paths(
        self,
        address: str,
        handler: Handler,
        router: Router,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As ``serve``; a connection dialled to another path than ``/`` goes where
        ``router`` says (closed at once when it says None)."""
        if address in self._listeners:
            raise TransportError(f"{address}: address already in use on this memory network")
        accept_send, accept_recv = trio.open_memory_channel[tuple[MemoryConnection, str]](0)
        self._listeners[address] = accept_send
        try:
            async with accept_recv, trio.open_nursery() as nursery:
                task_status.started(address)
                async for conn, path in accept_recv:
                    route = Sealed(handler, dialer=False) if path == "/" else router(path)
                    if isinstance(route, Sealed):
                        nursery.start_soon(serve_one, conn, route.handler)
                    elif isinstance(route, Piped):
                        nursery.start_soon(_serve_piped, conn, route)
                    else:
                        await conn.aclose()
        finally:
            del self._listeners[address]
            accept_send.close()


async def _serve_piped(conn: MemoryConnection, route: Piped) -> None:
    if route.ready is not None and not await route.ready():
        await conn.aclose()
        return
    await serve_pipe(MemoryPipe(conn), route.handler)
