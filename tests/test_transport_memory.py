"""MemoryNetwork specifics: the optional codec pass, and names as addresses."""

from __future__ import annotations

import pytest
import trio

from shard.messages import Probe
from shard.transport import Connection, ConnectionClosed, MemoryNetwork, TransportError
from shard.transport.memory import MemoryConnection
from shard.wire import WireError, WireLimits


async def test_encoded_malformed_frame_closes_connection() -> None:
    """With encode_frames, a malformed frame raises WireError after closing the connection."""
    into, incoming = trio.open_memory_channel[object](1)
    outgoing, from_conn = trio.open_memory_channel[object](1)
    conn = MemoryConnection("peer-x", outgoing, incoming, WireLimits())  # type: ignore[arg-type]
    with trio.fail_after(5):
        await into.send(b"\x00 not a frame")
        with pytest.raises(WireError) as raised:
            await conn.receive()
        assert "peer-x" in "".join(raised.value.__notes__)
        with pytest.raises(ConnectionClosed):
            await conn.send(Probe(nonce=1, sent_at=0.0))
        with pytest.raises(trio.EndOfChannel):
            await from_conn.receive()


async def test_encoded_statistics_count_bytes() -> None:
    """With encode_frames, statistics count the encoded bytes each way."""

    async def echo(conn: Connection) -> None:
        await conn.send(await conn.receive())

    network = MemoryNetwork(encode_frames=True)
    with trio.fail_after(5):
        async with network, trio.open_nursery() as nursery:
            await nursery.start(network.serve, "echo", echo)
            conn = await network.dial("echo")
            await conn.send(Probe(nonce=1, sent_at=0.0))
            await conn.receive()
            stats = conn.statistics()
            await conn.aclose()
            nursery.cancel_scope.cancel()
    assert stats.frames_sent == stats.frames_received == 1
    assert stats.bytes_sent == stats.bytes_received > 0


async def test_serving_a_name_twice_is_refused() -> None:
    """A second serve on a name already served raises TransportError; the first still works."""

    async def idle(conn: Connection) -> None:
        await conn.receive()

    network = MemoryNetwork()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(network.serve, "x", idle)
            with pytest.raises(TransportError, match="already in use"):
                await network.serve("x", idle)
            conn = await network.dial("x")
            await conn.aclose()
            nursery.cancel_scope.cancel()
        with pytest.raises(TransportError, match="refused"):
            await network.dial("x")
