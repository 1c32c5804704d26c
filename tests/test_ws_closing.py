"""A peer that keeps talking WebSocket while this node closes its connection: the node serves on.

After a malformed frame a node closes that connection (1008) and waits for the peer's close.
A hostile peer answers instead with a ping, or with a frame over the size cap. trio-websocket's
reader then tries to answer (a pong, a 1009 close) in a state where wsproto forbids sending
and raises ``LocalProtocolError`` in the reader task, which ran in the connection's nursery:
uncaught, it ended the whole node (the sealed link fuzz hit it once on CI). Here the frames are
written by hand on a raw socket, in exactly that order, against a listening
``WebSocketNetwork`` and against a dialled one.

Charter: 127.0.0.1 and port 0 only; every test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Awaitable, Callable

import pytest
import trio
import wsproto
import wsproto.events

from shard.messages import Probe
from shard.transport import Connection, ConnectionClosed, WebSocketNetwork
from shard.transport.base import split_address
from shard.transport.guard import serve_one
from shard.wire import WireError, WireLimits

DEADLINE_S = 20
LIMITS = WireLimits(max_frame_bytes=64 << 10)
PING = 0x9
BINARY = 0x2


def frame(opcode: int, payload: bytes, *, masked: bool, length: int | None = None) -> bytes:
    """One WebSocket frame (FIN set) carrying ``payload``; ``length`` overrides the length
    written in the header (a frame that announces more than it carries, so far)."""
    n = len(payload) if length is None else length
    head = bytes([0x80 | opcode])
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def after_close(kind: str, *, masked: bool) -> bytes:
    """What the hostile peer sends once this node has begun to close."""
    if kind == "ping":
        return frame(PING, b"still here", masked=masked)
    big = LIMITS.max_frame_bytes * 4
    return frame(BINARY, bytes(big), masked=masked)


async def read_until_close(stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
    """Read until the other side's Close arrives (this node is then closing)."""
    while True:
        data = await stream.receive_some(1 << 16)
        assert data, "the node dropped the socket before sending its close"
        ws.receive_data(data)
        if any(isinstance(e, wsproto.events.CloseConnection) for e in ws.events()):
            return


async def served(address: str, kind: str) -> None:
    """As a client: upgrade, send a malformed frame, and once the node closes, ``kind``."""
    host, port = split_address(address)
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(ws.send(wsproto.events.Request(host=address, target="/")))
        while not any(isinstance(e, wsproto.events.AcceptConnection) for e in ws.events()):
            ws.receive_data(await stream.receive_some(1 << 16))
        await stream.send_all(ws.send(wsproto.events.BytesMessage(b"not a wire frame")))
        await read_until_close(stream, ws)
        await linger(stream, after_close(kind, masked=True))


async def linger(stream: trio.SocketStream, data: bytes) -> None:
    """Send ``data`` and read on until the other side ends the socket (it may reset it while
    the data is still going out: what a node does with a peer it cut)."""
    with trio.move_on_after(2):
        try:
            await stream.send_all(data)
            while await stream.receive_some(1 << 16):
                pass
        except trio.BrokenResourceError:
            pass


async def reader(conn: Connection) -> None:
    """A link that only reads (the malformed frame ends it with 1008)."""
    while True:
        await conn.receive()


@pytest.mark.parametrize("kind", ["ping", "oversized"])
async def test_a_listening_node_serves_on_when_a_closing_peer_pings_or_floods(kind: str) -> None:
    """The malformed frame's connection ends (WireError at the handler, logged), the ping
    or oversized frame after the node's close ends nothing else: a second, honest
    connection is served afterwards, and ``serve`` is still running."""
    ended: list[BaseException] = []

    async def handler(conn: Connection) -> None:
        try:
            await reader(conn)
        except (WireError, ConnectionClosed) as exc:
            ended.append(exc)
            raise

    async def echo(conn: Connection) -> None:
        await conn.send(await conn.receive())

    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork(limits=LIMITS) as server, trio.open_nursery() as nursery:
            routes: list[Callable[[Connection], Awaitable[None]]] = [handler, echo]

            async def route(conn: Connection) -> None:
                await serve_one(conn, routes.pop(0))

            address = await nursery.start(server.serve, "127.0.0.1:0", route)
            await served(address, kind)
            async with WebSocketNetwork(limits=LIMITS) as client:
                conn = await client.dial(address)
                await conn.send(Probe(7, 0.0))
                assert await conn.receive() == Probe(7, 0.0)
                await conn.aclose()
            assert ended and isinstance(ended[0], WireError)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", ["ping", "oversized"])
async def test_a_dialling_node_survives_a_server_that_pings_or_floods_while_it_closes(
    kind: str,
) -> None:
    """The same from the dialling side: a hostile listener sends a malformed frame, and
    once this node closes, a ping or an oversized frame. The dialler's receive fails with
    WireError, its network closes cleanly, and nothing escapes the ``async with``."""
    accepted = trio.Event()

    async def hostile(stream: trio.SocketStream) -> None:
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        async with stream:
            request = None
            while request is None:
                ws.receive_data(await stream.receive_some(1 << 16))
                request = next(
                    (e for e in ws.events() if isinstance(e, wsproto.events.Request)), None
                )
            await stream.send_all(ws.send(wsproto.events.AcceptConnection()))
            accepted.set()
            await stream.send_all(ws.send(wsproto.events.BytesMessage(b"not a wire frame")))
            await read_until_close(stream, ws)
            await linger(stream, after_close(kind, masked=False))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, hostile, 0)
            port = listeners[0].socket.getsockname()[1]
            async with WebSocketNetwork(limits=LIMITS) as client:
                conn = await client.dial(f"127.0.0.1:{port}")
                with pytest.raises(WireError):
                    await conn.receive()
                with pytest.raises(ConnectionClosed):
                    await conn.send(Probe(1, 0.0))
            assert accepted.is_set()
            nursery.cancel_scope.cancel()
