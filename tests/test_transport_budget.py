"""A node's received bytes are bounded in total: the frame accounting of ``BudgetedStream``,
and floods of large messages and of idle connections against a real ``WebSocketNetwork``.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import gc
import struct
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.transport import Connection, WebSocketNetwork
from shard.transport.base import split_address
from shard.transport.budget import BudgetedStream, ByteBudget
from shard.transport.websocket import max_message_size
from shard.wire import WireError, WireLimits

DEADLINE_S = 60
HTTP = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"


def frame(payload: bytes, *, opcode: int = 0x2, fin: bool = True, mask: bool = False) -> bytes:
    """One WebSocket frame (RFC 6455 section 5.2); a masked frame's key is zero."""
    head = bytes([(0x80 if fin else 0) | opcode])
    bit = 0x80 if mask else 0
    n = len(payload)
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + struct.pack(">H", n)
    else:
        head += bytes([bit | 127]) + struct.pack(">Q", n)
    return head + (b"\0\0\0\0" if mask else b"") + payload


async def feed(
    stream: BudgetedStream, peer: trio.abc.Stream, data: bytes, chunks: list[int]
) -> None:
    """Send ``data`` in pieces of the given sizes and read each through ``stream``."""
    at = 0
    for size in [*chunks, len(data)]:
        piece = data[at : at + max(size, 1)]
        if not piece:
            break
        at += len(piece)
        await peer.send_all(piece)
        got = b""
        while len(got) < len(piece):
            got += await stream.receive_some(len(piece) - len(got))
        assert got == piece  # the stream passes bytes through unchanged


def budgeted(total: int, max_message: int) -> tuple[BudgetedStream, trio.abc.Stream, ByteBudget]:
    ours, peer = trio.testing.memory_stream_pair()
    budget = ByteBudget(total)
    return BudgetedStream(ours, budget, max_message=max_message), peer, budget


async def test_data_frames_are_held_until_their_message_is_taken() -> None:
    """Payload bytes of data frames are held from their header until the application takes
    the message; control frames, frame headers and the HTTP upgrade are not counted."""
    stream, peer, budget = budgeted(1 << 20, 1 << 19)
    data = (
        HTTP
        + frame(b"a" * 300, fin=False)  # a message in three fragments ...
        + frame(b"", opcode=0x9)  # ... with a ping in between
        + frame(b"b" * 70_000, opcode=0x0, fin=False, mask=True)
        + frame(b"c" * 5, opcode=0x0)
        + frame(b"")  # an empty message
        + frame(b"d" * 125, opcode=0x8)  # a close frame: not counted
    )
    await feed(stream, peer, data, [len(HTTP) - 2, 3, 1, 1, 500, 9000])
    assert stream.held == budget.statistics().used == 300 + 70_000 + 5
    stream.take_message()
    assert stream.held == 0
    stream.take_message()  # the empty one
    stream.take_message()  # nothing left: a no-op
    assert budget.statistics().used == 0 and budget.statistics().peak == 70_305


async def test_a_message_past_the_cap_takes_only_the_cap() -> None:
    """A frame declaring more than ``max_message`` takes no more than that (trio-websocket
    closes such a connection with 1009); ``release_all`` gives everything back."""
    stream, peer, budget = budgeted(1 << 20, 1000)
    await feed(stream, peer, HTTP + frame(b"x" * 4000), [len(HTTP) + 4])
    assert stream.held == 1000
    stream.release_all()
    assert budget.statistics().used == 0


async def test_reading_waits_while_the_budget_is_spent() -> None:
    """A connection whose next frame does not fit waits (it stops reading) until another
    gives bytes back; then it goes on."""
    first, peer1, budget = budgeted(1000, 800)
    other, peer2 = trio.testing.memory_stream_pair()
    second = BudgetedStream(other, budget, max_message=800)
    with trio.fail_after(DEADLINE_S):
        await feed(first, peer1, HTTP + frame(b"x" * 700), [])
        await peer2.send_all(HTTP + frame(b"y" * 700))
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                got.append(bytes(await second.receive_some()))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and budget.statistics().waits == 1  # parked on the budget
            first.take_message()
        assert len(got[0]) == len(HTTP) + 2 + 2 + 700 and second.held == 700


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=6),
    fragments=st.integers(1, 3),
    cuts=st.lists(st.integers(1, 5000), max_size=20),
    mask=st.booleans(),
)
def test_any_split_of_any_messages_is_accounted_exactly(
    sizes: list[int], fragments: int, cuts: list[int], mask: bool
) -> None:
    """However messages are fragmented and the bytes split into reads, the stream holds
    exactly the payload of the messages not yet taken."""
    data = HTTP
    for n in sizes:
        payload = bytes(n)
        step = max(1, -(-n // fragments))
        parts = [payload[i : i + step] for i in range(0, n, step)] or [b""]
        for j, part in enumerate(parts):
            last = j == len(parts) - 1
            data += frame(part, opcode=0x2 if j == 0 else 0x0, fin=last, mask=mask)
            data += frame(b"p", opcode=0xA)  # a pong after every fragment

    async def main() -> None:
        stream, peer, budget = budgeted(1 << 22, 1 << 20)
        await feed(stream, peer, data, cuts)
        assert stream.held == sum(sizes)
        for n in sizes:
            before = stream.held
            stream.take_message()
            assert before - stream.held == n
        assert budget.statistics().used == 0

    trio.run(main)


@asynccontextmanager
async def gated_server(
    network: WebSocketNetwork, gate: trio.Event, received: list[int]
) -> AsyncIterator[str]:
    """A server whose handlers read nothing until ``gate`` is set, then read everything."""

    async def handler(conn: Connection) -> None:
        await gate.wait()
        while True:
            try:
                await conn.receive()
            except WireError:
                received.append(1)  # the flood is garbage: each message resets its sender
                return

    async with network, trio.open_nursery() as nursery:
        yield await nursery.start(network.serve, "127.0.0.1:0", handler)
        nursery.cancel_scope.cancel()


async def flood(budget_messages: int, peers: int) -> tuple[int, ByteBudget]:
    """``peers`` raw clients each send one message at the size cap (garbage, not a wire
    frame) to a node whose handlers do not read yet; returns the peak Python memory traced
    while the node was flooded, and its budget."""
    limits = WireLimits(max_frame_bytes=1 << 20, max_tensor_bytes=1 << 20)
    message = max_message_size(limits)
    network = WebSocketNetwork(limits=limits, max_buffer_bytes=budget_messages * message)
    payload = frame(bytes(message - 100), mask=True)  # one object shared by every sender
    gate = trio.Event()
    received: list[int] = []
    gc.collect()
    tracemalloc.start()
    try:
        with trio.fail_after(DEADLINE_S):
            async with gated_server(network, gate, received) as address:
                async with trio.open_nursery() as nursery:
                    for _ in range(peers):
                        nursery.start_soon(flood_one, address, payload)
                    await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                    _, peak = tracemalloc.get_traced_memory()
                    used = network.budget.statistics().used
                    assert used <= network.budget.total
                    gate.set()
                while len(received) < peers:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    finally:
        tracemalloc.stop()
    assert received == [1] * peers  # every message was served once the node read again
    assert network.budget.statistics().used == 0  # and its bytes all given back
    return peak, network.budget


async def test_a_flood_of_large_messages_costs_bounded_memory() -> None:
    """16 peers each sending a message at the size cap (1 MiB) to a node that is not
    reading: what it holds stays within its budget of 3 messages plus a stated slack;
    with room for 64 messages the same flood costs it more than 16 MiB."""
    peers = 16
    peak, budget = await flood(3, peers)
    stats = budget.statistics()
    assert stats.waits >= 1 and stats.peak <= stats.total
    # The stated bound: the budget, the copy trio-websocket makes joining the parts of each
    # message it completes (at most the budget), one 64 KiB read per connection, 2 MiB of
    # fixed overhead (tasks, sockets, wsproto).
    assert peak <= 2 * stats.total + peers * (64 << 10) + (2 << 20), peak
    unbounded, _ = await flood(64, peers)
    assert unbounded > peers << 20 > peak, (unbounded, peak)


async def flood_one(address: str, payload: bytes) -> None:
    """A raw WebSocket client: upgrade, send ``payload`` (one frame), wait to be closed."""
    host, port = split_address(address)
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(
            f"GET / HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some()
        assert answer.startswith(b"HTTP/1.1 101"), answer
        try:
            await stream.send_all(payload)
            await stream.receive_some()  # the close frame: hang up
        except trio.BrokenResourceError:
            pass


async def test_idle_connections_past_the_cap_are_closed_at_once() -> None:
    """1,200 idle TCP connections: the node keeps ``max_connections`` (64) of them and
    closes the rest before any handshake (the kept ones wait at most connect_timeout_s for
    theirs); when the server stops, the count goes back to 0."""
    network = WebSocketNetwork(max_connections=64, connect_timeout_s=DEADLINE_S)

    async def handler(conn: Connection) -> None:  # never reached: nobody completes a handshake
        raise AssertionError(conn)

    with trio.fail_after(DEADLINE_S):
        async with network, trio.open_nursery() as nursery:
            address = await nursery.start(network.serve, "127.0.0.1:0", handler)
            host, port = split_address(address)
            streams = [await trio.open_tcp_stream(host, port) for _ in range(1200)]
            await trio.testing.wait_all_tasks_blocked(cushion=0.2)
            assert network.served == 64
            eof: list[bool] = []
            with trio.move_on_after(2.0):  # the kept 64 never answer: read all at once
                async with trio.open_nursery() as readers:
                    for stream in streams:
                        readers.start_soon(read_one, stream, eof)
            assert eof == [True] * (1200 - 64)
            nursery.cancel_scope.cancel()
        for stream in streams:
            await stream.aclose()
    assert network.served == 0 and network.budget.statistics().used == 0


async def read_one(stream: trio.SocketStream, eof: list[bool]) -> None:
    eof.append(await stream.receive_some(1) == b"")
