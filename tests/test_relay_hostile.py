"""The relay's listening paths against hostile peers: unknown paths and tickets, garbage at
every step of the signalling link, calls that break the rules, an end that never pairs, a
third end, an oversized message, a stalled upgrade and raw TCP garbage — each ends only its
own connection (with a reason where one can be given), the hub's tables stay bounded, and an
honest relayed edge works before and after; on the sealed wire a peer with no token never
gets a Welcome from the relay.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio_websocket

from procs import free_ports
from shard.errors import HandshakeError
from shard.messages import (
    CallMe,
    CallPlaced,
    CallRequest,
    Fault,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    Probe,
    Welcome,
)
from shard.transport import Connection, ConnectionClosed, TransportError, WebSocketNetwork
from shard.transport.links import accept_peer, dial_peer, shake_hands
from shard.transport.nat import NatNetwork, nat_address
from shard.transport.relayhub import RelayHub
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.channel import PeerRefused
from shard.wire import WireLimits, encode
from trust_fixtures import NOW, OTHER_AUTHORITY, credentials, policy

DEADLINE_S = 30
SWARM = "lab"
LIMITS = WireLimits(max_frame_bytes=1 << 16, max_tensor_bytes=1 << 16)
TICKET = "0123456789abcdef0123456789abcdef"


def plain() -> WebSocketNetwork:
    return WebSocketNetwork(limits=LIMITS, connect_timeout_s=2.0)


class Relay:
    """A relay node (plain wire) and two honest stages behind NAT, a and b, registered."""

    def __init__(self, address: str, hub: RelayHub, a: NatNetwork, evil: WebSocketNetwork) -> None:
        self.address = address
        self.hub = hub
        self.a = a
        self.evil = evil

    async def honest_round_trip(self) -> None:
        """a reaches b through the relay and b echoes."""
        hello = Hello(node=NodeName("a"), role="stage", swarm=SWARM)
        conn = await dial_peer(self.a, nat_address("b"), hello, timeout_s=10.0)
        await conn.send(Probe(nonce=1, sent_at=0.0))
        assert await conn.receive() == Probe(nonce=1, sent_at=0.0)
        await conn.aclose()


async def echo(conn: Connection) -> None:
    await accept_peer(conn, Welcome(node=NodeName("b"), role="stage", swarm=SWARM))
    while True:
        await conn.send(await conn.receive())


@asynccontextmanager
async def relay_up() -> AsyncIterator[Relay]:
    """The relay and its two honest callees, checked with an honest round trip before and
    after the body; ``relay.evil`` is an open network for the hostile side."""
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    hub = RelayHub(
        NodeName("coord"), SWARM, "coordinator", pair_timeout_s=0.5, handshake_timeout_s=0.5
    )
    server = NatNetwork(
        plain(),
        node=NodeName("coord"),
        role="coordinator",
        swarm=SWARM,
        advertise=address,
        relay=address,
        hub=hub,
        owns_inner=True,
    )
    nets = {
        name: NatNetwork(
            plain(),
            node=NodeName(name),
            role="stage",
            swarm=SWARM,
            advertise=nat_address(name),
            relay=address,
            owns_inner=True,
        )
        for name in ("a", "b")
    }
    relay = Relay(address, hub, nets["a"], plain())
    async with server, nets["a"], nets["b"], relay.evil, trio.open_nursery() as nursery:
        await nursery.start(server.serve, address, echo)
        for name, net in nets.items():
            await nursery.start(net.serve, "127.0.0.1:0", echo)
            await hub.wait_registered(NodeName(name))
        await relay.honest_round_trip()
        yield relay
        await relay.honest_round_trip()
        assert set(hub.statistics().callees) >= {"a", "b"}, "an honest callee was dropped"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_ws(address: str, path: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A bare WebSocket to ``path``; a refused upgrade raises ``ConnectionRejected`` (bare,
    not in an exception group)."""
    host, _, port = address.rpartition(":")
    rejected: list[trio_websocket.ConnectionRejected] = []
    try:
        async with (
            await trio.open_tcp_stream(host, int(port)) as stream,
            trio.open_nursery() as n,
        ):
            ws = await trio_websocket.wrap_client_stream(
                n, stream, address, path, max_message_size=4 * LIMITS.max_frame_bytes
            )
            yield ws
            n.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:  # raised by its reader task
        rejected.extend(
            e for e in group.exceptions if isinstance(e, trio_websocket.ConnectionRejected)
        )
    if rejected:
        raise rejected[0]


async def welcomed_then_cut(conn: Connection, hello: Hello, address: str) -> None:
    """Shake hands (a refusal raises ``HandshakeError``), then read until cut."""
    await shake_hands(conn, hello, address, timeout_s=5.0)
    await closed_by_peer(conn)


async def drained(ws: trio_websocket.WebSocketConnection) -> None:
    """Read until the other side closes (``ConnectionClosed``)."""
    while True:
        await ws.get_message()


async def closed_by_peer(conn: Connection) -> None:
    """Read until the other side closes (``ConnectionClosed``)."""
    while True:
        await conn.receive()


@asynccontextmanager
async def paired_ends(
    relay: Relay, ticket: str
) -> AsyncIterator[list[trio_websocket.WebSocketConnection]]:
    """Two raw WebSockets on ``/relay/TICKET``, both accepted (so paired)."""
    ends: list[trio_websocket.WebSocketConnection] = []
    both = trio.Event()

    async def end() -> None:
        async with raw_ws(relay.address, f"/relay/{ticket}") as ws:
            ends.append(ws)
            if len(ends) == 2:
                both.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(end)  # held unanswered until the second comes
        nursery.start_soon(end)
        await both.wait()
        yield ends
        nursery.cancel_scope.cancel()


async def signal_link(relay: Relay, link: str, node: str = "evil") -> Connection:
    """An honest-looking signalling link, its Hello answered."""
    conn = await relay.evil.dial_path(relay.address, "/signal", dialer=True)
    hello = Hello(node=NodeName(node), role="stage", swarm=SWARM, link=link)
    return await shake_hands(conn, hello, relay.address, timeout_s=5.0)


async def call(relay: Relay, request: Message) -> Message:
    """One caller link sending ``request``; the relay's answer."""
    conn = await signal_link(relay, "caller")
    await conn.send(request)
    try:
        return await conn.receive()
    finally:
        await conn.aclose()


@pytest.mark.parametrize(
    "path", ["/nope", f"/relay/{TICKET}", "/relay/", "/relay/../../etc/passwd", "/reverse/x", "//"]
)
async def test_unknown_paths_and_tickets_are_refused_with_404(path: str) -> None:
    """No path but /, /signal and a live ticket's /relay/TICKET is ever accepted."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with raw_ws(relay.address, path):
                    pass
            assert rejected.value.status_code == 404


async def test_garbage_on_the_signalling_path_ends_only_that_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Random bytes, a text frame, a wrong swarm, an unknown link kind and a silent peer:
    each link is closed; the relay serves on."""
    caplog.set_level(logging.INFO, logger="shard.transport")
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            for garbage in (b"\x00\xff" * 50, "text frame", encode(Probe(nonce=1, sent_at=0))):
                async with raw_ws(relay.address, "/signal") as ws:
                    await ws.send_message(garbage)
                    with pytest.raises(trio_websocket.ConnectionClosed):
                        await drained(ws)
            net = relay.evil
            for hello in (
                Hello(node=NodeName("x"), role="stage", swarm="other", link="callee"),
                Hello(node=NodeName("x"), role="stage", swarm=SWARM, link="bogus"),
            ):
                conn = await net.dial_path(relay.address, "/signal", dialer=True)
                with pytest.raises((HandshakeError, ConnectionClosed)):
                    await welcomed_then_cut(conn, hello, relay.address)
            silent = await net.dial_path(relay.address, "/signal", dialer=True)
            with pytest.raises(ConnectionClosed):  # no Hello within 0.5 s: cut
                await silent.receive()
    assert "swarm 'other' is not this swarm" in caplog.text
    assert "link 'bogus' on the relay's signalling path" in caplog.text


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (CallRequest(NodeName("b"), "zz"), "a ticket is 32 lowercase hex digits"),
        (CallRequest(NodeName("b"), TICKET.upper()), "a ticket is 32 lowercase hex digits"),
        (CallRequest(NodeName("b"), TICKET, back="not an address"), "back: address"),
        (CallRequest(NodeName("nobody"), TICKET), "nobody is not registered at relay coord"),
    ],
)
async def test_a_bad_call_is_refused_with_the_reason(request_: CallRequest, why: str) -> None:
    """Malformed tickets and addresses and unknown targets are refused by a Fault of kind
    relay; no CallMe reaches anyone."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            before = relay.hub.statistics().calls
            reply = await call(relay, request_)
            assert relay.hub.statistics().calls == before
    assert isinstance(reply, Fault) and reply.kind == "relay", reply
    assert why in reply.detail


async def test_wrong_messages_on_signalling_links_end_them() -> None:
    """A caller that sends anything but CallRequest, and a callee that sends anything but
    heartbeats, are cut; a callee that goes silent is dropped from the table."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            caller = await signal_link(relay, "caller")
            await caller.send(Heartbeat(node=NodeName("evil"), sent_at=0.0))
            with pytest.raises(ConnectionClosed):
                await caller.receive()
            callee = await signal_link(relay, "callee", node="ghost")
            await relay.hub.wait_registered(NodeName("ghost"))
            await callee.send(CallRequest(NodeName("a"), TICKET))
            with pytest.raises(ConnectionClosed):
                await closed_by_peer(callee)
            assert "ghost" not in relay.hub.statistics().callees


async def test_an_end_that_never_pairs_is_refused_and_a_third_end_too() -> None:
    """A placed ticket whose other end never comes is answered 410 after pair_timeout_s; a
    ticket paired once cannot be used by a third connection (404)."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            ghost = await signal_link(relay, "callee", node="ghost")  # takes calls, never answers
            await relay.hub.wait_registered(NodeName("ghost"))
            assert await call(relay, CallRequest(NodeName("ghost"), TICKET)) == CallPlaced(TICKET)
            call_me = await ghost.receive()
            assert call_me == CallMe(NodeName("evil"), TICKET, "")
            with pytest.raises(trio_websocket.ConnectionRejected) as alone:
                async with raw_ws(relay.address, f"/relay/{TICKET}"):
                    pass
            assert alone.value.status_code == 410  # held until the ticket expired
            other = "f" * 32
            assert await call(relay, CallRequest(NodeName("ghost"), other)) == CallPlaced(other)
            async with paired_ends(relay, other) as ends:
                await ends[0].send_message(b"between the two ends")
                assert await ends[1].get_message() == b"between the two ends"
                with pytest.raises(trio_websocket.ConnectionRejected) as third:
                    async with raw_ws(relay.address, f"/relay/{other}"):
                        pass
                assert third.value.status_code == 404


async def test_an_oversized_message_ends_that_pair_only() -> None:
    """A message past the relay's cap closes that relayed edge (1009), nothing else."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            ghost = await signal_link(relay, "callee", node="ghost")
            await relay.hub.wait_registered(NodeName("ghost"))
            assert await call(relay, CallRequest(NodeName("ghost"), TICKET)) == CallPlaced(TICKET)
            await ghost.receive()
            async with paired_ends(relay, TICKET) as ends:
                await ends[0].send_message(b"x" * (2 * LIMITS.max_frame_bytes + 8192))
                for ws in ends:
                    with pytest.raises(trio_websocket.ConnectionClosed):
                        await drained(ws)


async def test_raw_tcp_garbage_and_a_stalled_upgrade_are_dropped() -> None:
    """Bytes that are not HTTP, and an upgrade that stops half way, are closed within
    connect_timeout_s."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            host, _, port = relay.address.rpartition(":")
            for data in (b"\x16\x03\x01garbage\r\n\r\n" * 10, b"GET /signal HTTP/1.1\r\nHost: x"):
                async with await trio.open_tcp_stream(host, int(port)) as stream:
                    await stream.send_all(data)
                    with contextlib.suppress(trio.BrokenResourceError):
                        while await stream.receive_some(4096):
                            pass  # the relay closes it (an error answer may come first)


async def test_the_sealed_relay_welcomes_no_peer_without_a_token() -> None:
    """On the sealed wire the signalling path runs the secure handshake first: a peer
    without credentials is refused before any Hello, so it can never register or call."""
    coord = SecureWebSocketNetwork(
        credentials("coord", ("coordinator",)),
        policy(),
        role="coordinator",
        clock=lambda: NOW,
        connect_timeout_s=2.0,
    )
    hub = RelayHub(NodeName("coord"), SWARM, "coordinator")
    server = NatNetwork(
        coord,
        node=NodeName("coord"),
        role="coordinator",
        swarm=SWARM,
        advertise="127.0.0.1:1",
        relay="127.0.0.1:1",
        hub=hub,
        owns_inner=True,
    )
    with trio.fail_after(DEADLINE_S):
        async with server, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, "127.0.0.1:0", echo)
            async with plain() as net:  # a plaintext peer
                conn = await net.dial_path(address, "/signal", dialer=True)
                hello = Hello(node=NodeName("evil"), role="stage", swarm=SWARM, link="callee")
                with pytest.raises(HandshakeError):
                    await shake_hands(conn, hello, address, timeout_s=5.0)
            stranger = credentials("evil", ("stage",), authority=OTHER_AUTHORITY)
            intruder = SecureWebSocketNetwork(
                stranger, policy(), role="stage", clock=lambda: NOW, connect_timeout_s=2.0
            )
            async with intruder:
                with pytest.raises((PeerRefused, TransportError)):
                    await intruder.dial_path(address, "/signal", dialer=True)
            assert hub.statistics().callees == ()
            nursery.cancel_scope.cancel()


async def test_a_relayed_edge_outlives_the_pairing_timeout() -> None:
    """A paired edge carries traffic long after pair_timeout_s (the timeout is for pairing,
    not for the edge)."""
    with trio.fail_after(DEADLINE_S):
        async with relay_up() as relay:
            hello = Hello(node=NodeName("a"), role="stage", swarm=SWARM)
            conn = await dial_peer(relay.a, nat_address("b"), hello, timeout_s=10.0)
            await trio.sleep(1.5)  # three pairing timeouts
            await conn.send(Probe(nonce=2, sent_at=0.0))
            assert await conn.receive() == Probe(nonce=2, sent_at=0.0)
            await conn.aclose()
