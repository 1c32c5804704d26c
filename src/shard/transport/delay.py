"""``DelayNetwork``: any ``Network`` plus one-way latency and an optional bandwidth cap.

Each direction of a dialed connection is an emulated link: a frame handed over at time ``t``
arrives at ``t + serialization + latency``, where serialization is ``bytes * 8 / bps`` and a
frame waits for the one before it to finish serializing. Latency is not serialized: many
frames can be in flight at once, in order, as on a real link. Time is ``trio.current_time()``,
so under ``trio.testing.MockClock(autojump_threshold=0)`` a 100 ms WAN costs no wall time.

The dialer owns the edge: a ``DelayNetwork`` delays both directions of the connections it
dials (``latency_s(local_name, address)`` outgoing, ``latency_s(address, local_name)``
incoming) and serves without delay. So each edge is delayed exactly once even when both ends
use a ``DelayNetwork``, and a per-edge ``latency_s`` sees the two node names on both
directions (a listener does not know who dialed it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from shard.messages import Message
from shard.transport.base import (
    Connection,
    ConnectionClosed,
    Handler,
    HostedNetwork,
    Network,
    TransportError,
)
from shard.wire import WireError, WireLimits, encode

#: Frames one direction holds in flight before ``send`` blocks. A real link holds its
#: bandwidth-delay product and pushes back when that is full; a rendezvous channel here would
#: serialize the latency (one frame in flight at a time).
IN_FLIGHT_FRAMES = 1024

#: How long ``aclose`` waits past the last frame's arrival for the inner connection to take
#: it: a peer that stopped reading must not hold ``aclose`` (often shielded) forever.
DRAIN_GRACE_S = 1.0

_SIZING_LIMITS = WireLimits(
    max_frame_bytes=1 << 40, max_header_bytes=1 << 40, max_tensor_bytes=1 << 40
)

Latency = Callable[[str, str], float] | float


def wire_size(msg: Message) -> int:
    """Bytes ``msg`` occupies on the wire (as ``shard.wire.encode`` would send it)."""
    return len(encode(msg, limits=_SIZING_LIMITS))


class EmulatedLink:
    """One direction of a link: when does a frame of ``nbytes`` handed over at ``t`` arrive?"""

    def __init__(self, latency_s: float, bandwidth_bps: float) -> None:
        if not latency_s >= 0 or not bandwidth_bps >= 0:
            raise ValueError(f"latency {latency_s!r} s and bandwidth {bandwidth_bps!r} b/s")
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self._free_at = -math.inf

    def arrival(self, t: float, nbytes: int) -> float:
        start = max(t, self._free_at)
        if self.bandwidth_bps > 0:
            start += nbytes * 8 / self.bandwidth_bps
        self._free_at = start
        return start + self.latency_s


_Incoming = Message | TransportError | WireError


class DelayedConnection:
    """A connection whose two directions are ``EmulatedLink``s; created by ``DelayNetwork``.

    Three tasks (in the network's nursery) run it: a pump delaying outgoing frames, a reader
    stamping incoming frames on arrival, and a pump releasing them when their time comes.
    ``aclose`` lets frames already sent arrive, then closes the inner connection.

    Errors: as the inner connection's, delivered in order: a peer's close or a malformed
    frame reaches ``receive`` a latency after it happened, behind earlier frames.
    """

    def __init__(
        self,
        inner: Connection,
        outgoing: EmulatedLink,
        incoming: EmulatedLink,
        size: Callable[[Message], int],
    ) -> None:
        self._inner = inner
        self._outgoing = outgoing
        self._incoming = incoming
        self._size = size
        self._out_send, self._out_recv = trio.open_memory_channel[tuple[float, Message]](
            IN_FLIGHT_FRAMES
        )
        self._in_send, self._in_recv = trio.open_memory_channel[tuple[float, _Incoming]](
            IN_FLIGHT_FRAMES
        )
        self._ready_send, self._ready_recv = trio.open_memory_channel[_Incoming](0)
        self._send_error: TransportError | None = None
        self._drained = trio.Event()
        self._closing = False
        self._last_arrival = -math.inf
        self._scope = trio.CancelScope()

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the pumps until the connection is closed.

        Cancellation: stops delivering at once; frames in flight are lost (a cut cable).
        Errors: the inner connection's errors are handed to ``send``/``receive``; anything
        else propagates.
        """
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_out)
                nursery.start_soon(self._read_in)
                nursery.start_soon(self._pump_in)
                task_status.started()

    async def send(self, msg: Message) -> None:
        if self._send_error is not None:
            raise self._send_error
        size = self._size(msg) if self._outgoing.bandwidth_bps > 0 else 0
        arrival = self._outgoing.arrival(trio.current_time(), size)
        self._last_arrival = arrival
        try:
            await self._out_send.send((arrival, msg))
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self.peer}: connection already closed here") from None
        except trio.BrokenResourceError:
            raise self._send_error or ConnectionClosed(f"{self.peer}: closed") from None

    async def receive(self) -> Message:
        try:
            item = await self._ready_recv.receive()
        except trio.ClosedResourceError:
            raise ConnectionClosed(f"{self.peer}: connection already closed here") from None
        except trio.EndOfChannel:
            raise ConnectionClosed(f"{self.peer}: connection closed") from None
        if isinstance(item, TransportError | WireError):
            raise item
        return item

    async def aclose(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._out_send.close()
        try:
            with trio.move_on_at(self._last_arrival + DRAIN_GRACE_S):
                await self._drained.wait()
        finally:
            self._scope.cancel()
            self._ready_recv.close()
            await self._inner.aclose()

    async def _pump_out(self) -> None:
        try:
            async with self._out_recv:
                async for arrival, msg in self._out_recv:
                    await trio.sleep_until(arrival)
                    await self._inner.send(msg)
        except TransportError as exc:
            self._send_error = exc
        finally:
            self._drained.set()

    async def _read_in(self) -> None:
        async with self._in_send:
            while True:
                item: _Incoming
                try:
                    item = await self._inner.receive()
                except (TransportError, WireError) as exc:
                    await self._in_send.send((trio.current_time(), exc))
                    return
                await self._in_send.send((trio.current_time(), item))

    async def _pump_in(self) -> None:
        async with self._in_recv, self._ready_send:
            async for arrived_at, item in self._in_recv:
                size = 0
                if self._incoming.bandwidth_bps > 0 and not isinstance(item, Exception):
                    size = self._size(item)
                await trio.sleep_until(self._incoming.arrival(arrived_at, size))
                await self._ready_send.send(item)


class DelayNetwork(HostedNetwork[DelayedConnection]):
    """Wraps any ``Network``, adding one-way latency (and a bandwidth cap) to dialed edges.

    ``latency_s`` is seconds one way, or ``f(src, dst) -> seconds`` called with
    ``(local_name, address)`` and ``(address, local_name)`` for each dialed connection.
    ``bandwidth_bps`` (0: unlimited) caps each direction; sizes are wire-encoded sizes.

    It does not own ``inner``: open both (``async with inner, DelayNetwork(inner, ...) as
    net:``); one ``inner`` may be shared by many wrappers, one per node.

    Cancellation: leaving the context lets in-flight frames arrive and closes dialed
    connections; leaving it on an error cuts them. Errors: those of ``inner``.
    """

    def __init__(
        self,
        inner: Network,
        latency_s: Latency,
        *,
        bandwidth_bps: float = 0.0,
        local_name: str = "?",
        size: Callable[[Message], int] = wire_size,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._latency = latency_s
        self._bandwidth_bps = bandwidth_bps
        self._local_name = local_name
        self._size = size

    def _link(self, src: str, dst: str) -> EmulatedLink:
        latency = self._latency(src, dst) if callable(self._latency) else self._latency
        return EmulatedLink(latency, self._bandwidth_bps)

    async def dial(self, address: str) -> DelayedConnection:
        nursery = self._nursery
        outgoing = self._link(self._local_name, address)
        incoming = self._link(address, self._local_name)
        inner = await self._inner.dial(address)
        conn = DelayedConnection(inner, outgoing, incoming, self._size)
        try:
            await nursery.start(self._run, conn)
        except BaseException:
            with trio.CancelScope(shield=True):
                await inner.aclose()
            raise
        return conn

    async def _run(
        self,
        conn: DelayedConnection,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with self._tracking(conn):
            await conn.run(task_status=task_status)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """``inner.serve``, undelayed: the dialing side delays both directions."""
        await self._inner.serve(address, handler, task_status=task_status)
