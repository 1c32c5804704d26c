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
from shard.transport.guard import serve_one
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
        frame: _Frame = msg if self._limits is None else encode(msg, limits=self._limits)
        try:
            await self._outgoing.send(frame)
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self._peer}: connection already closed here") from None
        except trio.BrokenResourceError:
            raise ConnectionClosed(f"{self._peer}: peer closed the connection") from None
        self._counters.sent(len(frame) if isinstance(frame, bytes) else 0)

    async def receive(self) -> Message:
        try:
            frame = await self._incoming.receive()
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self._peer}: connection already closed here") from None
        except trio.EndOfChannel:
            raise ConnectionClosed(f"{self._peer}: peer closed the connection") from None
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


class MemoryNetwork(NetworkBase):
    """An in-process ``Network``: ``serve`` registers a name, ``dial`` that name connects.

    Any string is an address; ``serve`` reports the same string as bound. Dialing needs no
    background task, so ``async with network:`` is optional here (but harmless).

    Errors: ``dial`` raises ``TransportError`` when nothing serves the name; ``serve`` raises
    ``TransportError`` when the name is already served.
    """

    def __init__(self, *, encode_frames: bool = False, limits: WireLimits | None = None) -> None:
        self._limits = (limits or WireLimits()) if encode_frames else None
        self._listeners: dict[str, trio.MemorySendChannel[MemoryConnection]] = {}
        self._clients = itertools.count(1)

    async def dial(self, address: str) -> MemoryConnection:
        listener = self._listeners.get(address)
        if listener is None:
            raise TransportError(f"{address}: connection refused (nothing serves that name)")
        to_server, server_in = trio.open_memory_channel[_Frame](BUFFERED_FRAMES)
        to_client, client_in = trio.open_memory_channel[_Frame](BUFFERED_FRAMES)
        client = MemoryConnection(address, to_server, client_in, self._limits)
        name = f"memory-client-{next(self._clients)}->{address}"
        server = MemoryConnection(name, to_client, server_in, self._limits)
        try:
            await listener.send(server)
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
        if address in self._listeners:
            raise TransportError(f"{address}: address already in use on this memory network")
        accept_send, accept_recv = trio.open_memory_channel[MemoryConnection](0)
        self._listeners[address] = accept_send
        try:
            async with accept_recv, trio.open_nursery() as nursery:
                task_status.started(address)
                async for conn in accept_recv:
                    nursery.start_soon(serve_one, conn, handler)
        finally:
            del self._listeners[address]
            accept_send.close()
