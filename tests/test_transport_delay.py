"""DelayNetwork: one-way latency and bandwidth per edge, checked in virtual time.

Every test but the last runs under ``MockClock(autojump_threshold=0)`` (pytest-trio's
``autojump_clock``), so timings are exact and cost no wall time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from shard.messages import ChunkSeq, Epoch, Probe, SessionId, Tensor, Verify
from shard.transport import (
    Connection,
    ConnectionClosed,
    DelayNetwork,
    Handler,
    MemoryNetwork,
    WebSocketNetwork,
)
from shard.transport.delay import wire_size

LATENCY_S = 0.05


@asynccontextmanager
async def served(network: DelayNetwork, handler: Handler, listen: str = "b") -> AsyncIterator[str]:
    async with network, trio.open_nursery() as nursery:
        yield await nursery.start(network.serve, listen, handler)
        nursery.cancel_scope.cancel()


def stamped(arrivals: list[tuple[int, float]]) -> Handler:
    """A handler recording (nonce, arrival time) of each Probe and echoing it back."""

    async def handler(conn: Connection) -> None:
        while True:
            msg = await conn.receive()
            assert isinstance(msg, Probe)
            arrivals.append((msg.nonce, trio.current_time()))
            await conn.send(msg)

    return handler


async def test_message_arrives_exactly_latency_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A frame arrives one latency after it was sent, and its echo one more latency later."""
    arrivals: list[tuple[int, float]] = []
    network = DelayNetwork(MemoryNetwork(), LATENCY_S, local_name="a")
    with trio.fail_after(10):
        async with served(network, stamped(arrivals)) as address:
            conn = await network.dial(address)
            sent_at = trio.current_time()
            await conn.send(Probe(nonce=1, sent_at=sent_at))
            await conn.receive()
            returned_at = trio.current_time()
            await conn.aclose()
    assert arrivals[0][1] - sent_at == pytest.approx(LATENCY_S)
    assert returned_at - sent_at == pytest.approx(2 * LATENCY_S)


async def test_latency_is_not_serialized(autojump_clock: trio.testing.MockClock) -> None:
    """Ten frames sent back to back each arrive one latency after their send, in order."""
    arrivals: list[tuple[int, float]] = []
    network = DelayNetwork(MemoryNetwork(), LATENCY_S)
    sent: list[float] = []
    with trio.fail_after(10):
        async with served(network, stamped(arrivals)) as address:
            conn = await network.dial(address)
            for i in range(10):
                sent.append(trio.current_time())
                await conn.send(Probe(nonce=i, sent_at=sent[-1]))
                await trio.sleep(0.001)
            for _ in range(10):
                await conn.receive()
            await conn.aclose()
    assert [nonce for nonce, _ in arrivals] == list(range(10))
    for (_, arrived), sent_at in zip(arrivals, sent, strict=True):
        assert arrived - sent_at == pytest.approx(LATENCY_S)
    assert arrivals[-1][1] - sent[0] < 2 * LATENCY_S


async def test_bandwidth_cap_delays_by_size(autojump_clock: trio.testing.MockClock) -> None:
    """With a cap, a frame waits bytes*8/bps to serialize, behind the frames before it."""
    bps = 8e6  # 1 MB/s
    tensor = Tensor(dtype="float32", shape=(25_000,), data=bytes(100_000))
    big = Verify(session=SessionId(1), epoch=Epoch(0), seq=ChunkSeq(0), start=0, hidden=tensor)
    arrivals: list[float] = []

    async def handler(conn: Connection) -> None:
        while True:
            await conn.receive()
            arrivals.append(trio.current_time())

    network = DelayNetwork(MemoryNetwork(), LATENCY_S, bandwidth_bps=bps)
    with trio.fail_after(10):
        async with served(network, handler) as address:
            conn = await network.dial(address)
            t0 = trio.current_time()
            await conn.send(big)
            await conn.send(big)
            await conn.aclose()
    serialize_s = wire_size(big) * 8 / bps
    assert serialize_s > 0.01
    assert arrivals[0] - t0 == pytest.approx(serialize_s + LATENCY_S)
    assert arrivals[1] - t0 == pytest.approx(2 * serialize_s + LATENCY_S)


async def test_per_edge_latency_each_way(autojump_clock: trio.testing.MockClock) -> None:
    """A latency function is asked for each direction of a dialed edge by node name."""
    table = {("a", "b"): 0.010, ("b", "a"): 0.030}
    asked: list[tuple[str, str]] = []

    def latency(src: str, dst: str) -> float:
        asked.append((src, dst))
        return table[src, dst]

    arrivals: list[tuple[int, float]] = []
    network = DelayNetwork(MemoryNetwork(), latency, local_name="a")
    with trio.fail_after(10):
        async with served(network, stamped(arrivals)) as address:
            conn = await network.dial(address)
            t0 = trio.current_time()
            await conn.send(Probe(nonce=1, sent_at=t0))
            await conn.receive()
            rtt = trio.current_time() - t0
            await conn.aclose()
    assert sorted(asked) == [("a", "b"), ("b", "a")]
    assert arrivals[0][1] - t0 == pytest.approx(0.010)
    assert rtt == pytest.approx(0.040)


async def test_close_arrives_after_frames_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Frames sent before aclose still arrive, then the peer sees ConnectionClosed."""
    got: list[int] = []
    closed = trio.Event()

    async def handler(conn: Connection) -> None:
        try:
            while True:
                msg = await conn.receive()
                assert isinstance(msg, Probe)
                got.append(msg.nonce)
        except ConnectionClosed:
            closed.set()

    network = DelayNetwork(MemoryNetwork(), LATENCY_S)
    with trio.fail_after(10):
        async with served(network, handler) as address:
            conn = await network.dial(address)
            for i in range(5):
                await conn.send(Probe(nonce=i, sent_at=0.0))
            await conn.aclose()
            await closed.wait()
    assert got == list(range(5))


async def test_leaving_the_network_closes_dialed_connections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Connections still open when the network's context ends are closed, not leaked."""
    network = DelayNetwork(MemoryNetwork(), LATENCY_S)
    with trio.fail_after(10):
        async with served(network, stamped([])) as address:
            conn = await network.dial(address)
        with pytest.raises(ConnectionClosed):
            await conn.send(Probe(nonce=1, sent_at=0.0))


async def test_delay_over_websocket_real_time() -> None:
    """Over real WebSockets on loopback a round trip takes at least two latencies."""
    inner = WebSocketNetwork()
    network = DelayNetwork(inner, LATENCY_S)
    with trio.fail_after(10):
        async with inner, served(network, stamped([]), "127.0.0.1:0") as address:
            conn = await network.dial(address)
            t0 = trio.current_time()
            await conn.send(Probe(nonce=1, sent_at=t0))
            await conn.receive()
            assert trio.current_time() - t0 >= 2 * LATENCY_S
            await conn.aclose()
