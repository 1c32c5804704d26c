"""WebSocketNetwork specifics: hostile frames, limits, statistics, and the wire's cost.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing
import trio_websocket

from procs import free_ports
from shard.messages import ChunkSeq, Epoch, Message, Probe, SessionId, Tensor, Verify
from shard.transport import (
    Connection,
    ConnectionClosed,
    Handler,
    TransportError,
    WebSocketNetwork,
)
from shard.transport.base import split_address
from shard.transport.relay import DelayRelay
from shard.wire import WireError, WireLimits

DEADLINE_S = 20


@asynccontextmanager
async def served(
    handler: Handler, network: WebSocketNetwork | None = None
) -> AsyncIterator[tuple[WebSocketNetwork, str]]:
    async with network or WebSocketNetwork() as net, trio.open_nursery() as nursery:
        address = await nursery.start(net.serve, "127.0.0.1:0", handler)
        yield net, address
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_websocket(address: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A bare trio-websocket client (no wire codec) whose socket we close ourselves."""
    host, port = split_address(address)
    async with await trio.open_tcp_stream(host, port) as stream, trio.open_nursery() as nursery:
        yield await trio_websocket.wrap_client_stream(nursery, stream, address, "/")
        nursery.cancel_scope.cancel()


def recording_echo(errors: list[BaseException]) -> Handler:
    async def handler(conn: Connection) -> None:
        try:
            while True:
                await conn.send(await conn.receive())
        except WireError as exc:
            errors.append(exc)
            raise

    return handler


async def test_garbage_frame_closes_only_that_connection(caplog: pytest.LogCaptureFixture) -> None:
    """Junk bytes get their sender closed with 1008; an honest connection keeps working."""
    errors: list[BaseException] = []
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with served(recording_echo(errors)) as (network, address):
            honest = await network.dial(address)
            await honest.send(Probe(nonce=1, sent_at=0.0))
            assert await honest.receive() == Probe(nonce=1, sent_at=0.0)
            async with raw_websocket(address) as junk:
                await junk.send_message(b"\xff\x00 this is not a wire frame \x00" * 10)
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await junk.get_message()
            assert closed.value.reason is not None
            assert closed.value.reason.code == 1008
            await honest.send(Probe(nonce=2, sent_at=0.0))
            assert await honest.receive() == Probe(nonce=2, sent_at=0.0)
            await honest.aclose()
    assert len(errors) == 1
    assert isinstance(errors[0], WireError)
    assert "connection from 127.0.0.1:" in caplog.text


async def test_text_message_is_a_wire_error() -> None:
    """A text WebSocket message is rejected like any malformed frame."""
    errors: list[BaseException] = []
    with trio.fail_after(DEADLINE_S):
        async with served(recording_echo(errors)) as (_, address), raw_websocket(address) as junk:
            await junk.send_message("hello")
            with pytest.raises(trio_websocket.ConnectionClosed):
                await junk.get_message()
    assert len(errors) == 1


async def test_oversize_frame_is_refused() -> None:
    """A frame over the receiver's limit closes that connection; the sender learns it."""
    small = WireLimits(max_frame_bytes=64 * 1024, max_tensor_bytes=64 * 1024)
    errors: list[BaseException] = []
    big = Verify(
        session=SessionId(1),
        epoch=Epoch(0),
        seq=ChunkSeq(0),
        start=0,
        hidden=Tensor(dtype="float32", shape=(64, 1024), data=random.Random(1).randbytes(1 << 18)),
    )
    with trio.fail_after(DEADLINE_S):
        receiver = WebSocketNetwork(limits=small)
        async with (
            served(recording_echo(errors), receiver) as (_, address),
            WebSocketNetwork() as sender,
        ):
            conn = await sender.dial(address)
            with pytest.raises(ConnectionClosed, match="1009"):
                await send_then_receive(conn, big)
            await conn.aclose()
    assert len(errors) == 1
    assert "larger than" in str(errors[0])


async def send_then_receive(conn: Connection, msg: Message) -> Message:
    """One exchange; a peer refusing the frame mid-way makes ``send`` itself raise."""
    await conn.send(msg)
    return await conn.receive()


async def test_statistics_count_frames_and_bytes() -> None:
    """Each side counts the frames and sealed bytes it sent and received."""
    with trio.fail_after(DEADLINE_S):
        async with served(recording_echo([])) as (network, address):
            conn = await network.dial(address)
            for i in range(3):
                await conn.send(Probe(nonce=i, sent_at=0.0))
                await conn.receive()
            stats = conn.statistics()
            await conn.aclose()
    assert stats.frames_sent == stats.frames_received == 3
    assert stats.bytes_sent == stats.bytes_received > 0


async def test_report_rtt_64kib_websocket_vs_tcp() -> None:
    """Report (not assert) a 64 KiB round trip on loopback: raw TCP, trio-websocket, shard."""
    size, rounds = 64 * 1024, 200
    payload = random.Random(0).randbytes(size)  # incompressible: no codec gets a free ride
    results: dict[str, float] = {}
    with trio.fail_after(60):
        results["raw TCP"] = await _tcp_rtt(payload, rounds)
        for buffer in (4 * 1024, 64 * 1024):
            results[f"trio-websocket, {buffer // 1024} KiB reads"] = await _ws_rtt(
                payload, rounds, buffer
            )
        results["WebSocketNetwork (wire + seal)"] = await _network_rtt(payload, rounds)
    print()
    for name, median_s in results.items():
        print(f"64 KiB round trip, median of {rounds}: {name:34s} {median_s * 1e3:6.3f} ms")


async def _timed_rounds(rounds: int, one_round: Callable[[], Awaitable[None]]) -> float:
    samples = []
    for _ in range(rounds):
        t0 = trio.current_time()
        await one_round()
        samples.append(trio.current_time() - t0)
    return statistics.median(samples)


async def _tcp_rtt(payload: bytes, rounds: int) -> float:
    async def echo(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(1 << 20):
            await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)

        async def one_round() -> None:
            await stream.send_all(payload)
            got = 0
            while got < len(payload):
                got += len(await stream.receive_some(1 << 20))

        median = await _timed_rounds(rounds, one_round)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return median


async def _ws_rtt(payload: bytes, rounds: int, buffer: int) -> float:
    async def echo(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            while True:
                await ws.send_message(await ws.get_message())
        except trio_websocket.ConnectionClosed:
            pass

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: trio_websocket.serve_websocket(
                echo,
                "127.0.0.1",
                0,
                None,
                receive_buffer_size=buffer,
                task_status=task_status,
            )
        )
        async with trio_websocket.open_websocket(
            "127.0.0.1", server.port, "/", use_ssl=False, receive_buffer_size=buffer
        ) as ws:

            async def one_round() -> None:
                await ws.send_message(payload)
                await ws.get_message()

            median = await _timed_rounds(rounds, one_round)
        nursery.cancel_scope.cancel()
    return median


async def _network_rtt(payload: bytes, rounds: int) -> float:
    tensor = Tensor(dtype="float32", shape=(len(payload) // 4,), data=payload)
    msg = Verify(session=SessionId(1), epoch=Epoch(0), seq=ChunkSeq(0), start=0, hidden=tensor)

    async def echo(conn: Connection) -> None:
        while True:
            await conn.send(await conn.receive())

    async with served(echo) as (network, address):
        conn = await network.dial(address)

        async def one_round() -> None:
            await conn.send(msg)
            await conn.receive()

        median = await _timed_rounds(rounds, one_round)
        await conn.aclose()
    return median


async def test_cancelled_server_does_not_wait_for_a_silent_peer() -> None:
    """Cancelling a server whose close handshake awaits a silent peer ends promptly."""
    handled = trio.Event()

    async def handler(conn: Connection) -> None:
        handled.set()  # returning starts the close handshake; this peer never answers

    network = WebSocketNetwork(connect_timeout_s=60)
    with trio.fail_after(5):  # far below the 60 s close bound
        async with network, trio.open_nursery() as nursery:
            address = await nursery.start(network.serve, "127.0.0.1:0", handler)
            stream = await trio.open_tcp_stream(*split_address(address))
            await stream.send_all(
                f"GET / HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n".encode()
            )
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += await stream.receive_some(4096)
            assert reply.startswith(b"HTTP/1.1 101")
            await handled.wait()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        await stream.aclose()


class CountingSealer:
    """A toy sealer: prefixes a frame counter and checks it on open (order, no replay)."""

    def __init__(self) -> None:
        self.sent = 0
        self.opened = 0

    def seal(self, frame: bytes) -> bytes:
        self.sent += 1
        return self.sent.to_bytes(8, "big") + frame

    def open(self, data: bytes) -> bytes:
        self.opened += 1
        if int.from_bytes(data[:8], "big") != self.opened:
            raise WireError("seal: frame out of order")
        return data[8:]


async def test_frames_go_through_one_sealer_per_connection() -> None:
    """Every frame is sealed and opened in order by its connection's own sealer."""
    sealers: list[CountingSealer] = []

    def factory() -> CountingSealer:
        sealers.append(CountingSealer())
        return sealers[-1]

    network = WebSocketNetwork(sealer_factory=factory)
    with trio.fail_after(DEADLINE_S):
        async with served(recording_echo([]), network) as (_, address):
            conns = [await network.dial(address) for _ in range(2)]
            async with trio.open_nursery() as nursery:
                for conn in conns:
                    nursery.start_soon(_exchange_probes, conn, 20)
            for conn in conns:
                await conn.aclose()
    assert len(sealers) == 4  # two connections, both ends
    assert all(s.sent == s.opened == 20 for s in sealers)


async def _exchange_probes(conn: Connection, n: int) -> None:
    for i in range(n):
        await conn.send(Probe(nonce=i, sent_at=0.0))
        assert await conn.receive() == Probe(nonce=i, sent_at=0.0)


async def test_sealer_refusal_closes_with_policy_violation() -> None:
    """A frame the sealer refuses to open is a WireError: that connection closes (1008)."""
    errors: list[BaseException] = []
    receiver = WebSocketNetwork(sealer_factory=CountingSealer)
    with trio.fail_after(DEADLINE_S):
        async with (
            served(recording_echo(errors), receiver) as (_, address),
            WebSocketNetwork() as sender,  # plain frames: no counter prefix
        ):
            conn = await sender.dial(address)
            with pytest.raises(ConnectionClosed, match="1008"):
                await send_then_receive(conn, Probe(nonce=1, sent_at=0.0))
            await conn.aclose()
    assert [str(e) for e in errors] == ["seal: frame out of order"]


async def test_a_dial_the_far_end_closes_during_the_handshake_fails_at_once() -> None:
    """A dial whose connection is accepted and then closed before the WebSocket upgrade is
    answered — a delaying relay with nobody listening behind it, as while a swarm's nodes
    start — fails at once, not after the whole connect timeout (it took all 10 s before:
    trio-websocket's client waits for an answer on a stream that has ended). Then, once
    the node behind the relay listens, a dial through it connects."""

    async def accept_and_close(stream: trio.SocketStream) -> None:
        await stream.aclose()

    async def echo(conn: Connection) -> None:
        await conn.send(await conn.receive())

    network = WebSocketNetwork(connect_timeout_s=10)
    behind, front = (f"127.0.0.1:{p}" for p in free_ports(2))
    async with network, trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, accept_and_close, 0)
        closing = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        relay = DelayRelay(front, behind, latency_s=0.005)
        await nursery.start(relay.run)
        for address in (closing, front):
            began = trio.current_time()
            with pytest.raises(TransportError, match="could not connect"):
                await network.dial(address)
            assert trio.current_time() - began < 2.0, address
        await nursery.start(network.serve, behind, echo)
        conn = await network.dial(front)
        probe = Probe(nonce=1, sent_at=0.0)
        await conn.send(probe)
        assert await conn.receive() == probe
        await conn.aclose()
        nursery.cancel_scope.cancel()
