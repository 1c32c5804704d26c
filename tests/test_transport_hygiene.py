"""Connection hygiene after Hello (``PeerDeadlines`` on ``WebSocketNetwork.serve``): an idle
flood from one address no longer locks an honest client on it out (the host's connection
idle longest makes room, at ``max_peer_connections``), a message trickled after Hello is cut,
a connection with no message either way is cut, and honest long-lived links are not: one that
carries messages (heartbeats count), and a client whose request is running
(``IdleDeadline(…, conn)`` keeps it busy). On a client link heartbeats do not count: a flood
of heartbeating client links is reclaimed for an honest client like a silent one.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
Time is a ``MockClock`` running at real speed that each test also jumps: idleness is made by
jumping, never by sleeping (the thresholds are far above the real seconds a test takes).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

import shard.nodes.coordinator as coordinator_root
from shard.messages import (
    GenerateDone,
    GenerateRequest,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    Probe,
    RunStats,
    Welcome,
)
from shard.spec.limits import Limits
from shard.transport import Connection, ConnectionClosed, TransportError, WebSocketNetwork
from shard.transport.base import split_address
from shard.transport.guard import IdleDeadline, PeerDeadlines
from shard.transport.links import accept_peer, dial_peer
from shard.wire import encode

DEADLINE_S = 30
SWARM = "hygiene"
ME = NodeName("coord")
CAP = 8
DEADLINES = PeerDeadlines(idle_s=600.0, message_s=50.0, reclaim_idle_s=20.0)


def hello(node: str = "c") -> Hello:
    return Hello(NodeName(node), "client", SWARM)


async def echo_link(conn: Connection) -> None:
    """A link after Hello: echoes each message (a client's request and its answer)."""
    await accept_peer(conn, Welcome(ME, "coordinator", SWARM))
    while True:
        await conn.send(await conn.receive())


async def ask(conn: Connection, nonce: int) -> None:
    await conn.send(Probe(nonce, 0.0))
    assert await conn.receive() == Probe(nonce, 0.0)


async def test_an_honest_client_is_served_beside_an_idle_flood_from_its_address(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Seven idle connections and one honest long-lived link fill the cap (8) of 127.0.0.1:
    two honest clients are served, 2 of 2 (the two idle longest are closed for them, with
    a log line), the long-lived link and the first honest one are not touched; with no
    connection idle long enough a new one is refused (503) as before."""
    mock_clock.rate = 1.0
    caplog.set_level(logging.WARNING, logger="shard.transport")
    server = WebSocketNetwork(max_peer_connections=CAP, deadlines=DEADLINES)
    with trio.fail_after(DEADLINE_S + DEADLINES.reclaim_idle_s + 1):  # the deadline + the jump
        async with WebSocketNetwork() as client, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", echo_link)
            flood = [
                await dial_peer(client, address, hello(f"f{i}"), timeout_s=5) for i in "1234567"
            ]
            keeper = await dial_peer(client, address, hello("keeper"), timeout_s=5)
            with pytest.raises(TransportError, match="503"):  # none idle yet: refused
                await client.dial(address)
            mock_clock.jump(DEADLINES.reclaim_idle_s + 1)
            await ask(keeper, 1)  # the long-lived link carries a message: not idle
            honest = []
            for n in range(2):  # both stay open: the second needs a second idle one's room
                honest.append(await dial_peer(client, address, hello("honest"), timeout_s=5))
                await ask(honest[-1], 10 + n)
            await ask(keeper, 2)
            await ask(honest[0], 12)
            closed = 0
            for conn in flood:
                with trio.move_on_after(0.2) as still_open:
                    try:
                        await conn.receive()
                    except ConnectionClosed:
                        closed += 1
                assert still_open.cancelled_caught or closed
            nursery.cancel_scope.cancel()
    assert server.reclaimed == 2 and closed == 2
    reclaims = [r for r in caplog.records if "to make room for" in r.getMessage()]
    assert len(reclaims) == 2


def masked_frame(payload: bytes, *, opcode: int = 0x2, length: int | None = None) -> bytes:
    """A client's WebSocket frame header (+ ``payload``), masked with a zero key."""
    n = len(payload) if length is None else length
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    else:
        head += bytes([0x80 | 126]) + struct.pack(">H", n)
    return head + b"\0\0\0\0" + payload


async def raw_after_hello(address: str) -> trio.SocketStream:
    """A raw TCP client: WebSocket upgrade, a real Hello, its Welcome read."""
    host, port = split_address(address)
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(
        f"GET / HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += await stream.receive_some()
    assert answer.startswith(b"HTTP/1.1 101"), answer
    await stream.send_all(masked_frame(encode(hello("trickler"))))
    assert await stream.receive_some()  # the Welcome
    return stream


async def read_to_eof(stream: trio.SocketStream) -> None:
    while await stream.receive_some():
        pass


async def test_a_message_trickled_after_hello_is_cut(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """After Hello, a peer begins a 1,000-byte frame and sends one byte of it every tenth
    of message_s: once message_s has passed (the few bytes buy no time) the connection is
    cut, with a log line naming the trickle."""
    mock_clock.rate = 1.0
    caplog.set_level(logging.WARNING, logger="shard.transport")
    ended: list[BaseException] = []

    async def link(conn: Connection) -> None:
        try:
            await echo_link(conn)
        except BaseException as exc:
            ended.append(exc)
            raise

    server = WebSocketNetwork(deadlines=DEADLINES)
    tick = DEADLINES.message_s / 10
    with trio.fail_after(DEADLINE_S + DEADLINES.message_s):  # the deadline + the jumps
        async with server, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", link)
            stream = await raw_after_hello(address)
            await stream.send_all(masked_frame(b"", length=1000))
            for _ in range(10):
                await stream.send_all(b"x")
                await trio.testing.wait_all_tasks_blocked()
                assert not ended
                mock_clock.jump(tick)
            await stream.send_all(b"x")
            await read_to_eof(stream)  # the server hung up
            await stream.aclose()
            nursery.cancel_scope.cancel()
    assert ended and not isinstance(ended[0], AssertionError)
    assert any("a trickle" in r.getMessage() for r in caplog.records)


async def test_idle_links_are_cut_and_honest_long_lived_ones_are_not(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Over ten idle_s of virtual time: a link that exchanges a message every half idle_s
    (heartbeats would do), and a client whose request runs throughout, stay up; a link
    silent for idle_s is cut; the client is cut idle_s after its request ended."""
    mock_clock.rate = 1.0
    busy_ends = trio.Event()

    async def route(conn: Connection) -> None:
        first = await conn.receive()
        assert isinstance(first, Hello)
        await conn.send(Welcome(ME, "coordinator", SWARM))
        if first.node == "busy":
            idle = IdleDeadline(1e9, conn)
            idle.begin()
            await busy_ends.wait()
            idle.end()
            await trio.sleep_forever()
        while True:
            await conn.send(await conn.receive())

    server = WebSocketNetwork(deadlines=DEADLINES)
    step = DEADLINES.idle_s / 2
    with trio.fail_after(DEADLINE_S + 22 * step + 2):  # + the jumps
        async with WebSocketNetwork() as client, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", route)
            chatty = await dial_peer(client, address, hello("chatty"), timeout_s=5)
            busy = await dial_peer(client, address, hello("busy"), timeout_s=5)
            silent = await dial_peer(client, address, hello("silent"), timeout_s=5)
            for i in range(20):
                mock_clock.jump(step - 1)
                await ask(chatty, i)
                await trio.testing.wait_all_tasks_blocked()
                if i == 2:  # silent for more than idle_s by now
                    with pytest.raises(ConnectionClosed):
                        await silent.receive()
            assert server.served == 2  # chatty and busy, after 10 x idle_s
            busy_ends.set()
            await trio.testing.wait_all_tasks_blocked()
            for i in (98, 99):  # chatty talks on; the client, done, says nothing for idle_s
                mock_clock.jump(step + 1)
                await ask(chatty, i)
            with pytest.raises(ConnectionClosed):
                await busy.receive()
            nursery.cancel_scope.cancel()


async def test_a_message_the_node_is_too_busy_to_read_is_not_a_trickle(
    mock_clock: trio.testing.MockClock,
) -> None:
    """After Hello a peer sends two whole messages and half of a third while the node's link
    reads nothing (its queue full, the socket unread) for ten message_s: not cut; once the
    link reads again the third, finished, is received."""
    mock_clock.rate = 1.0
    reading = trio.Event()
    got: list[object] = []

    async def slow_link(conn: Connection) -> None:
        await accept_peer(conn, Welcome(ME, "coordinator", SWARM))
        await reading.wait()
        for _ in range(3):
            got.append(await conn.receive())
        await trio.sleep_forever()

    server = WebSocketNetwork(deadlines=DEADLINES)
    third = masked_frame(encode(Probe(3, 0.0)))
    with trio.fail_after(DEADLINE_S + 11 * DEADLINES.message_s):  # + the jumps
        async with server, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", slow_link)
            stream = await raw_after_hello(address)
            await stream.send_all(masked_frame(encode(Probe(1, 0.0))))
            await stream.send_all(masked_frame(encode(Probe(2, 0.0))) + third[:8])
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(10 * DEADLINES.message_s)
            await trio.testing.wait_all_tasks_blocked()
            reading.set()
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(DEADLINES.message_s / 2)  # caught up: the third's clock restarted
            await stream.send_all(third[8:])
            while len(got) < 3:
                await trio.testing.wait_all_tasks_blocked()
            assert got == [Probe(1, 0.0), Probe(2, 0.0), Probe(3, 0.0)]
            assert server.served == 1
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_heartbeat_flood_of_client_links_does_not_lock_out_an_honest_client(
    mock_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CAP client links (the coordinator's own ``_serve_client``) that send a Heartbeat every
    3 s and never a request fill 127.0.0.1's cap: a newcomer is refused while they are fresh,
    but once they have run nothing for reclaim_idle_s — heartbeats or not — an honest client
    is served (the one idle longest is closed for it, with a log line)."""
    mock_clock.rate = 1.0
    caplog.set_level(logging.DEBUG)

    async def complete(
        _coordinator: Any,
        _text: Any,
        request: GenerateRequest,
        emit: Callable[[Message], Awaitable[None]],
        _store: Any = None,
    ) -> None:
        await emit(
            GenerateDone(request.request, (), "", "length", RunStats(0, 0.0, 0.0, 0.0, 0, 0.0))
        )

    monkeypatch.setattr(coordinator_root, "complete", complete)
    limits = Limits(idle_timeout_s=300.0, message_timeout_s=5.0)

    async def client_link(conn: Connection) -> None:
        await accept_peer(conn, Welcome(ME, "coordinator", SWARM))
        await coordinator_root._serve_client(None, None, conn, limits=limits)  # type: ignore[arg-type]

    async def heartbeats(conn: Connection) -> None:
        with contextlib.suppress(TransportError):
            while True:
                await conn.send(Heartbeat(NodeName("f"), trio.current_time()))
                await trio.sleep(3)

    def heard() -> int:
        return sum("sent Heartbeat" in r.getMessage() for r in caplog.records)

    server = WebSocketNetwork(max_peer_connections=CAP, deadlines=DEADLINES)
    with trio.fail_after(DEADLINE_S + DEADLINES.reclaim_idle_s + 1):  # the deadline + the jump
        async with WebSocketNetwork() as client, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", client_link)
            flood = [
                await dial_peer(client, address, hello(f"f{i}"), timeout_s=5) for i in range(CAP)
            ]
            for conn in flood:
                nursery.start_soon(heartbeats, conn)
            with pytest.raises(TransportError, match="503"):  # all fresh: refused
                await client.dial(address)
            mock_clock.jump(DEADLINES.reclaim_idle_s + 1)  # every flood link heartbeats again
            while heard() < 2 * CAP:
                await trio.testing.wait_all_tasks_blocked()
            honest = await dial_peer(client, address, hello("honest"), timeout_s=5)
            await honest.send(GenerateRequest(1, "hi", 1))
            done = await honest.receive()
            assert isinstance(done, GenerateDone) and done.request == 1
            nursery.cancel_scope.cancel()
    assert server.reclaimed == 1
    assert sum("to make room for" in r.getMessage() for r in caplog.records) == 1
