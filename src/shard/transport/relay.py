"""``DelayRelay``: a TCP relay that adds WAN latency between processes, with no privileges.

Put one in front of each node (``--listen`` where peers dial, ``--target`` the node's real
address) and every byte crossing it is held for the one-way latency, in order. Each
direction is a pipe of timestamped chunks: a chunk read at ``t`` is written at
``t + serialization + latency``, so latency is not serialized (a window's worth of bytes can
be in flight, as on a real link). The relay knows nothing of WebSockets or frames.

Its memory is bounded: at most ``max_connections`` relayed at once (one more is accepted and
closed at once, with a log line), and each direction of each connection holds at most its
share of ``max_buffered_bytes`` (``max_buffered_bytes / (2 * max_connections)``, at least
one read) — when a direction's share is spent it stops reading its source, so TCP flow
control pushes back on the sender. A target that never reads therefore costs one share per
connection, never more, and never takes another connection's share.

Run it as ``shard relay --listen 127.0.0.1:7100 --target 127.0.0.1:7000 --latency-ms 25``.
"""

from __future__ import annotations

import logging
import math

import attrs
import trio

from shard.transport.base import join_address, open_listeners, split_address

log = logging.getLogger("shard.transport.relay")

CHUNK_BYTES = 64 * 1024
#: The most one direction ever holds in flight (the emulated link's buffer), whatever its share.
MAX_WINDOW_BYTES = 64 << 20
#: Connections relayed at once, by default; one more is accepted and closed at once.
MAX_CONNECTIONS = 64
#: Bytes held in flight by all connections together, by default (2 MiB per direction at 64).
MAX_BUFFERED_BYTES = 256 << 20

_EOF = b""


@attrs.frozen
class RelayStatistics:
    """What a relay has carried: connections accepted, open now, and bytes each way; how
    many it refused at its cap, and the bytes it holds in flight now (read, not yet written)."""

    connections: int
    open_connections: int
    bytes_to_target: int
    bytes_to_client: int
    refused_connections: int = 0
    buffered_bytes: int = 0


class _Window:
    """One direction's in-flight byte count against its share: the reader waits for room."""

    def __init__(self, share: int) -> None:
        self.share = share
        self.held = 0
        self._lot = trio.lowlevel.ParkingLot()

    async def room(self) -> int:
        """Wait until the direction may read more; how many bytes (at most one read)."""
        while self.held >= self.share:
            await self._lot.park()
        return min(CHUNK_BYTES, self.share - self.held)

    def release(self, n: int) -> None:
        self.held -= n
        self._lot.unpark_all()


class DelayRelay:
    """A delaying TCP relay actor: accepts on ``listen``, connects each client to ``target``.

    ``latency_s`` is added one way, in each direction; ``bandwidth_bps`` (0: unlimited) caps
    each direction of each connection. ``max_connections`` and ``max_buffered_bytes`` bound
    what it holds (see the module docstring).

    Cancellation: cancelling ``run`` stops listening and closes every relayed connection at
    once (bytes still in flight are dropped, like a cut cable).
    Errors: ``run`` raises ``OSError`` if ``listen`` cannot be bound. A client whose target
    refuses, or a connection reset on either side, only closes that relayed connection
    (logged at warning / debug); so does a connection over ``max_connections`` (warning).
    """

    def __init__(
        self,
        listen: str,
        target: str,
        *,
        latency_s: float,
        bandwidth_bps: float = 0.0,
        max_connections: int = MAX_CONNECTIONS,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        if not latency_s >= 0 or not bandwidth_bps >= 0:
            raise ValueError(f"latency {latency_s!r} s and bandwidth {bandwidth_bps!r} b/s")
        if max_connections < 1 or max_buffered_bytes < 2 * CHUNK_BYTES * max_connections:
            raise ValueError(
                f"max_connections {max_connections} must be at least 1 and max_buffered_bytes "
                f"{max_buffered_bytes} at least {2 * CHUNK_BYTES} per connection (one read "
                "each way)"
            )
        self._max_connections = max_connections
        #: One direction's share of the buffer budget, so all of them fit in it together.
        self.window_bytes = min(MAX_WINDOW_BYTES, max_buffered_bytes // (2 * max_connections))
        self._listen = split_address(listen)
        self._target = split_address(target)
        self._target_text = target
        self._latency_s = latency_s
        self._bandwidth_bps = bandwidth_bps
        self._connections = 0
        self._open = 0
        self._to_target = 0
        self._to_client = 0
        self._refused = 0
        self._slots = 0  # connections holding a slot under the cap (dialling or relaying)
        self._windows: set[_Window] = set()
        self._live: set[trio.CancelScope] = set()

    def sever(self) -> int:
        """Cut every connection relayed now (a cable cut; new ones still go through).
        Returns how many were cut."""
        for scope in self._live:
            scope.cancel()
        return len(self._live)

    def statistics(self) -> RelayStatistics:
        buffered = sum(w.held for w in self._windows)
        return RelayStatistics(
            self._connections,
            self._open,
            self._to_target,
            self._to_client,
            refused_connections=self._refused,
            buffered_bytes=buffered,
        )

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Relay until cancelled; reports the bound ``host:port`` once listening.

        Errors: ``ListenError`` when the listen address cannot be bound."""
        host, port = self._listen
        listeners = await open_listeners(join_address(host, port))
        bound = join_address(host, listeners[0].socket.getsockname()[1])
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._relay, listeners)
            task_status.started(bound)

    async def _relay(self, client: trio.SocketStream) -> None:
        self._connections += 1
        if self._slots >= self._max_connections:
            self._refused += 1
            log.warning(
                "relay: refused a connection: %d relayed already (the cap; --max-connections "
                "raises it); %d refused so far",
                self._slots,
                self._refused,
            )
            await client.aclose()
            return
        self._slots += 1
        try:
            await self._dial_and_relay(client)
        finally:
            self._slots -= 1

    async def _dial_and_relay(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*self._target)
        except OSError as exc:
            # INFO: at a swarm's start the relays run before their targets listen, and the
            # client retries; one that gives up says what it could not reach
            log.info("relay: target %s refused a client: %s", self._target_text, exc)
            await client.aclose()
            return
        self._open += 1
        cut = trio.CancelScope()
        self._live.add(cut)
        try:
            with cut:
                async with client, upstream, trio.open_nursery() as nursery:
                    scope = nursery.cancel_scope
                    nursery.start_soon(self._direction, client, upstream, True, scope)
                    nursery.start_soon(self._direction, upstream, client, False, scope)
        finally:
            self._live.discard(cut)
            self._open -= 1

    async def _direction(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        to_target: bool,
        connection: trio.CancelScope,
    ) -> None:
        window = _Window(self.window_bytes)
        # Bounded in bytes by the window, not in chunks: every chunk is at least one byte (the
        # EOF marker aside), so the window's bytes plus one also bound the chunks queued.
        pipe_send, pipe_recv = trio.open_memory_channel[tuple[float, bytes]](window.share + 1)
        self._windows.add(window)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, source, pipe_send, window)
                nursery.start_soon(self._write, pipe_recv, sink, to_target, window)
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as group:
            # A reset on either side ends the whole relayed connection, as it would end-to-end.
            log.debug("relay: connection reset: %r", group.exceptions)
            connection.cancel()
        finally:
            self._windows.discard(window)

    async def _read(
        self,
        source: trio.SocketStream,
        pipe: trio.MemorySendChannel[tuple[float, bytes]],
        window: _Window,
    ) -> None:
        free_at = -math.inf  # when the emulated link finishes serializing what it has
        async with pipe:
            while True:
                # Backpressure: no read while this direction's share is in flight.
                chunk = await source.receive_some(await window.room())
                window.held += len(chunk)
                start = max(trio.current_time(), free_at)
                if self._bandwidth_bps > 0:
                    start += len(chunk) * 8 / self._bandwidth_bps
                free_at = start
                await pipe.send((start + self._latency_s, chunk))
                if chunk == _EOF:
                    return

    async def _write(
        self,
        pipe: trio.MemoryReceiveChannel[tuple[float, bytes]],
        sink: trio.SocketStream,
        to_target: bool,
        window: _Window,
    ) -> None:
        async with pipe:
            async for due, chunk in pipe:
                await trio.sleep_until(due)
                if chunk == _EOF:
                    await sink.send_eof()
                    return
                await sink.send_all(chunk)
                window.release(len(chunk))
                if to_target:
                    self._to_target += len(chunk)
                else:
                    self._to_client += len(chunk)
