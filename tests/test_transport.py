"""The ``Connection``/``Network`` contract, run against every network implementation.

Charter: addresses are 127.0.0.1 with port 0 (or memory names); every I/O test runs under a
``trio.fail_after`` deadline; no sleeps to wait for state.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest
import trio

from shard.messages import (
    ChunkSeq,
    Epoch,
    Fault,
    Hello,
    Hop,
    NodeName,
    Probe,
    SessionId,
    Tensor,
    Verdict,
    Verify,
)
from shard.transport import (
    Connection,
    ConnectionClosed,
    DelayNetwork,
    Handler,
    MemoryNetwork,
    Network,
    TransportError,
    WebSocketNetwork,
)

DEADLINE_S = 20


@asynccontextmanager
async def delayed(inner: Network, latency_s: float) -> AsyncIterator[Network]:
    async with inner, DelayNetwork(inner, latency_s) as network:
        yield network


NETWORKS: dict[str, Callable[[], AbstractAsyncContextManager[Network]]] = {
    "memory": MemoryNetwork,
    "memory-encoded": lambda: MemoryNetwork(encode_frames=True),
    "websocket": WebSocketNetwork,
    "delay-memory": lambda: delayed(MemoryNetwork(), 0.0),
    "delay-websocket": lambda: delayed(WebSocketNetwork(), 0.001),
}
LISTEN = {
    "memory": "node-a",
    "memory-encoded": "node-a",
    "websocket": "127.0.0.1:0",
    "delay-memory": "node-a",
    "delay-websocket": "127.0.0.1:0",
}
KINDS = pytest.mark.parametrize("kind", list(NETWORKS))


def tensor_1mib(seed: int = 0) -> Tensor:
    data = random.Random(seed).randbytes(512 * 512 * 4)  # incompressible on purpose
    return Tensor(dtype="float32", shape=(512, 512), data=data)


def sample_messages() -> list[object]:
    hop = Hop(node=NodeName("s0"), compute_s=0.25, received_at=1.0, sent_at=1.5)
    return [
        Hello(node=NodeName("coord"), role="coordinator", swarm="test"),
        Probe(nonce=7, sent_at=12.5),
        Verify(
            session=SessionId(3),
            epoch=Epoch(1),
            seq=ChunkSeq(9),
            start=40,
            hidden=tensor_1mib(),
            draft=(5, 6, 7),
            hops=(hop,),
        ),
        Verdict(
            session=SessionId(3),
            epoch=Epoch(1),
            seq=ChunkSeq(9),
            start=40,
            target_ids=(5, 6, 8, 1),
            accepted=2,
        ),
        Fault(node=NodeName("s1"), kind="link", detail="gone", session=SessionId(3)),
    ]


async def echo(conn: Connection) -> None:
    while True:
        await conn.send(await conn.receive())


@asynccontextmanager
async def served(kind: str, handler: Handler) -> AsyncIterator[tuple[Network, str]]:
    """Open a network of ``kind``, serve ``handler`` on it, yield (network, bound address)."""
    async with NETWORKS[kind]() as network, trio.open_nursery() as nursery:
        address = await nursery.start(network.serve, LISTEN[kind], handler)
        yield network, address
        nursery.cancel_scope.cancel()


async def unused_address(kind: str) -> str:
    if not kind.endswith("websocket"):
        return "nobody-here"
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    return f"127.0.0.1:{port}"


@KINDS
async def test_round_trip_of_message_types(kind: str) -> None:
    """Every message type, a 1 MiB tensor included, comes back equal through an echo peer."""
    with trio.fail_after(DEADLINE_S):
        async with served(kind, echo) as (network, address):
            conn = await network.dial(address)
            for msg in sample_messages():
                await conn.send(msg)  # type: ignore[arg-type]
                assert await conn.receive() == msg
            await conn.aclose()


@KINDS
async def test_fifo_order_of_1000_messages(kind: str) -> None:
    """1000 messages sent back to back arrive in the order sent."""
    received: list[int] = []
    done = trio.Event()

    async def collect(conn: Connection) -> None:
        while len(received) < 1000:
            msg = await conn.receive()
            assert isinstance(msg, Probe)
            received.append(msg.nonce)
        done.set()

    with trio.fail_after(DEADLINE_S):
        async with served(kind, collect) as (network, address):
            conn = await network.dial(address)
            for i in range(1000):
                await conn.send(Probe(nonce=i, sent_at=0.0))
            await done.wait()
            await conn.aclose()
    assert received == list(range(1000))


@KINDS
async def test_client_close_reaches_server(kind: str) -> None:
    """A dialer closing its end makes the server's receive raise ConnectionClosed."""
    outcome: list[BaseException] = []
    finished = trio.Event()

    async def handler(conn: Connection) -> None:
        try:
            assert await conn.receive() == Probe(nonce=1, sent_at=0.0)
            await conn.receive()
        except ConnectionClosed as exc:
            outcome.append(exc)
        finally:
            finished.set()

    with trio.fail_after(DEADLINE_S):
        async with served(kind, handler) as (network, address):
            conn = await network.dial(address)
            await conn.send(Probe(nonce=1, sent_at=0.0))
            await conn.aclose()
            await finished.wait()
            with pytest.raises(ConnectionClosed):
                await conn.send(Probe(nonce=2, sent_at=0.0))
    assert len(outcome) == 1


@KINDS
async def test_server_close_reaches_client(kind: str) -> None:
    """A server closing the connection makes the dialer's receive raise ConnectionClosed."""

    async def handler(conn: Connection) -> None:
        await conn.send(Probe(nonce=1, sent_at=0.0))
        await conn.aclose()

    with trio.fail_after(DEADLINE_S):
        async with served(kind, handler) as (network, address):
            conn = await network.dial(address)
            assert await conn.receive() == Probe(nonce=1, sent_at=0.0)
            with pytest.raises(ConnectionClosed):
                await conn.receive()
            await conn.aclose()


@KINDS
async def test_dial_to_nothing_raises_transport_error(kind: str) -> None:
    """Dialing an address nobody serves raises TransportError naming the address."""
    with trio.fail_after(DEADLINE_S):
        async with NETWORKS[kind]() as network:
            address = await unused_address(kind)
            with pytest.raises(TransportError, match=address.replace(".", r"\.")):
                await network.dial(address)


@KINDS
async def test_handler_transport_error_ends_only_that_connection(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler raising TransportError is logged with its peer; the server keeps serving."""

    async def handler(conn: Connection) -> None:
        msg = await conn.receive()
        if isinstance(msg, Probe) and msg.nonce == 0:
            raise TransportError("handler gave up on this peer")
        await echo_once(conn, msg)

    async def echo_once(conn: Connection, msg: object) -> None:
        await conn.send(msg)  # type: ignore[arg-type]
        await conn.receive()

    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with served(kind, handler) as (network, address):
            bad = await network.dial(address)
            await bad.send(Probe(nonce=0, sent_at=0.0))
            with pytest.raises(ConnectionClosed):
                await bad.receive()
            good = await network.dial(address)
            await good.send(Probe(nonce=1, sent_at=0.0))
            assert await good.receive() == Probe(nonce=1, sent_at=0.0)
            await good.aclose()
            await bad.aclose()
    assert "handler gave up on this peer" in caplog.text


@KINDS
async def test_handler_bug_propagates_out_of_serve(kind: str) -> None:
    """A handler raising anything but WireError/TransportError ends the server with it."""

    async def handler(conn: Connection) -> None:
        await conn.receive()
        raise KeyError("a bug, not a peer problem")

    with trio.fail_after(DEADLINE_S), pytest.RaisesGroup(KeyError, flatten_subgroups=True):
        async with served(kind, handler) as (network, address):
            conn = await network.dial(address)
            await conn.send(Probe(nonce=0, sent_at=0.0))
            await trio.sleep_forever()


async def test_dial_needs_open_network() -> None:
    """Dialing a WebSocket network outside `async with` says how to fix it."""
    with pytest.raises(RuntimeError, match="async with network"):
        await WebSocketNetwork().dial("127.0.0.1:1")
