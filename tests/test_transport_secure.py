"""SecureWebSocketNetwork over real WebSockets: each refusal is its own clear error on the
accepting and the dialing side, sealed-frame attacks reset only their connection, a
plaintext peer is refused both ways, and an honest connection keeps working throughout.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio_websocket

from shard.errors import HandshakeError
from shard.messages import Hello, NodeName, Probe
from shard.transport import Connection, ConnectionClosed, WebSocketNetwork
from shard.transport.base import split_address
from shard.transport.secure import RoleMismatch, SecureConnection, SecureWebSocketNetwork
from shard.trust.admission import (
    BadTokenSignature,
    ForeignAuthority,
    ForeignSwarm,
    RoleNotAllowed,
    TokenExpired,
    TokenMissing,
    TokenRevoked,
    WrongIdentity,
)
from shard.trust.channel import (
    Confirm,
    Credentials,
    KeyNotProven,
    Offer,
    PeerNotSecure,
    PeerRefused,
    PlaintextPeer,
    RoleNotWelcome,
    TrustPolicy,
    decode_message,
    dialer_transcript,
    encode_message,
)
from shard.trust.handshake import DialerHandshake
from shard.trust.sealer import (
    OVERHEAD,
    ReflectedFrame,
    ReorderedFrame,
    ReplayedFrame,
    SealError,
    SessionSealer,
    TamperedFrame,
    TruncatedFrame,
)
from shard.wire import WireError, encode
from trust_fixtures import NOW, OTHER_AUTHORITY, credentials, forged, identity, policy

DEADLINE_S = 20
COORD = credentials("coord", ("coordinator",))
STAGE = credentials("s0", ("stage",))


def secure(
    creds: Credentials, role: str, trust: TrustPolicy | None = None, **kw: Any
) -> SecureWebSocketNetwork:
    """A network for one node, on the tests' fixed clock."""
    return SecureWebSocketNetwork(
        creds, trust or policy(), role=role, clock=lambda: NOW, connect_timeout_s=5.0, **kw
    )


def ping(n: int) -> Probe:
    return Probe(nonce=n, sent_at=0.0)


class Echo:
    """A server handler that echoes, remembering who connected and how each connection ended."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.peers: list[str] = []
        self.failed = trio.Event()

    async def __call__(self, conn: Connection) -> None:
        if isinstance(conn, SecureConnection):
            self.peers.append(conn.authenticated.role)
        try:
            while True:
                await conn.send(await conn.receive())
        except (WireError, HandshakeError) as exc:
            self.errors.append(exc)
            self.failed.set()


@asynccontextmanager
async def stage_server(
    network: SecureWebSocketNetwork | WebSocketNetwork | None = None,
) -> AsyncIterator[tuple[Echo, str]]:
    """Stage s0 of swarm ``lab`` serving an echo on a free port."""
    echo = Echo()
    async with trio.open_nursery() as nursery:
        serve = (network or secure(STAGE, "stage")).serve
        address = await nursery.start(serve, "127.0.0.1:0", echo)
        yield echo, address
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def honest(address: str) -> AsyncIterator[Connection]:
    """The coordinator's connection to s0, proven to work before and checked after."""
    async with secure(COORD, "coordinator") as net:
        conn = await net.dial(address)
        await conn.send(ping(1))
        assert await conn.receive() == ping(1)
        yield conn
        await conn.send(ping(2))
        assert await conn.receive() == ping(2), "the honest connection stopped working"
        await conn.aclose()


def refusals(caplog: pytest.LogCaptureFixture) -> list[BaseException]:
    """The errors the server logged for refused handshakes."""
    return [
        r.args[1]
        for r in caplog.records
        if r.name == "shard.transport" and r.msg.startswith("handshake with") and r.args
    ]


async def test_honest_connection_is_sealed_and_knows_its_peer() -> None:
    """Messages round-trip; each side learns the other's proven role; frames carry the seal."""
    with trio.fail_after(DEADLINE_S):
        async with stage_server() as (echo, address), secure(COORD, "coordinator") as net:
            conn = await net.dial(address)
            assert conn.authenticated.role == "stage"
            assert conn.authenticated.identity == STAGE.identity.public
            for i in range(3):
                await conn.send(ping(i))
                assert await conn.receive() == ping(i)
            stats = conn.statistics()
            assert stats.bytes_sent == 3 * (len(encode(ping(0))) + OVERHEAD)
            await conn.aclose()
    assert echo.peers == ["coordinator"]


DIALERS: list[tuple[str, Callable[[], SecureWebSocketNetwork], type[HandshakeError]]] = [
    ("foreign-swarm", lambda: secure(
        credentials("coord", ("coordinator",), swarm="other"), "coordinator",
        TrustPolicy(policy().authority, "other")), ForeignSwarm),
    ("foreign-authority", lambda: secure(
        credentials("coord", ("coordinator",), authority=OTHER_AUTHORITY), "coordinator"),
        ForeignAuthority),
    ("expired", lambda: secure(
        credentials("coord", ("coordinator",), expires=NOW - 1), "coordinator"), TokenExpired),
    ("revoked", lambda: secure(
        credentials("coord", ("coordinator",), serial=13), "coordinator"), TokenRevoked),
    ("wrong-role", lambda: secure(credentials("coord", ("client",)), "coordinator"),
        RoleNotAllowed),
    ("role-not-welcome", lambda: secure(credentials("cli", ("client",)), "client"),
        RoleNotWelcome),
    ("bad-signature", lambda: secure(
        Credentials(COORD.identity, forged(COORD.token, expires=int(NOW) + 10**9)),
        "coordinator"), BadTokenSignature),
    ("wrong-identity", lambda: secure(Credentials(identity("mallory"), COORD.token),
        "coordinator"), WrongIdentity),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "make", "error"), DIALERS, ids=[d[0] for d in DIALERS])
async def test_listener_refuses_dialer_with_its_own_error(
    caplog: pytest.LogCaptureFixture,
    _name: str,
    make: Callable[[], SecureWebSocketNetwork],
    error: type[HandshakeError],
) -> None:
    """The server logs the specific error; the dialer gets PeerRefused with the same reason;
    an honest connection opened before keeps working after."""
    server = secure(STAGE, "stage", policy(revoked={13}))
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with stage_server(server) as (echo, address), honest(address), make() as bad:
            with pytest.raises(PeerRefused) as refused:
                await bad.dial(address)
    (logged,) = refusals(caplog)
    assert type(logged) is error
    assert refused.value.reason == error.reason
    assert address in str(refused.value)
    assert echo.errors == []


async def test_dialer_refuses_a_listener_with_an_expired_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dialer checks the listener too: TokenExpired on dial, PeerRefused logged there."""
    stale = secure(credentials("s0", ("stage",), expires=NOW - 1), "stage")
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with stage_server(stale) as (_, address), secure(COORD, "coordinator") as net:
            with pytest.raises(TokenExpired, match=f"the token of {address}"):
                await net.dial(address)
    (logged,) = refusals(caplog)
    assert isinstance(logged, PeerRefused) and logged.reason == "expired"


@asynccontextmanager
async def raw(address: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A bare WebSocket client whose socket we close ourselves."""
    host, port = split_address(address)
    async with await trio.open_tcp_stream(host, port) as stream, trio.open_nursery() as nursery:
        yield await trio_websocket.wrap_client_stream(nursery, stream, address, "/")
        nursery.cancel_scope.cancel()


def _offer(**changes: Any) -> bytes:
    """Coord's honest Offer, with ``changes``."""
    side = DialerHandshake(COORD, policy(), role="coordinator", now=NOW)
    offer = decode_message(side.offer(), Offer, "t")
    assert isinstance(offer, Offer)
    return encode_message(attrs.evolve(offer, **changes))


async def test_no_token_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """An Offer without a token: TokenMissing at the server, a Refuse saying so to the client."""
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with stage_server() as (_, address), honest(address), raw(address) as ws:
            await ws.send_message(_offer(token=b""))
            reply = decode_message(await ws.get_message(), Offer, "t")
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert getattr(reply, "reason", None) == "no-token"
    assert closed.value.reason is not None and closed.value.reason.code == 1008
    (logged,) = refusals(caplog)
    assert type(logged) is TokenMissing


async def test_key_not_proven_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Coord's public key and token with a Confirm signed by another key: KeyNotProven."""
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with stage_server() as (_, address), honest(address), raw(address) as ws:
            m1 = _offer()
            await ws.send_message(m1)
            m2 = await ws.get_message()
            assert isinstance(m2, bytes)
            forged_sig = identity("mallory").sign(dialer_transcript(m1, m2))
            await ws.send_message(encode_message(Confirm(forged_sig)))
            reply = decode_message(await ws.get_message(), Offer, "t")
    assert getattr(reply, "reason", None) == "bad-handshake-signature"
    (logged,) = refusals(caplog)
    assert type(logged) is KeyNotProven


async def test_plaintext_dialer_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A downgraded (insecure) dialer: PlaintextPeer at the server, 1008 'secure wire
    required' at the dialer; the honest connection is untouched."""
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING, "shard.transport"):
        async with stage_server() as (_, address), honest(address), WebSocketNetwork() as plain:
            conn = await plain.dial(address)
            await conn.send(Hello(node=NodeName("coord"), role="coordinator", swarm="lab"))
            with pytest.raises(ConnectionClosed, match="secure wire required"):
                await conn.receive()
            await conn.aclose()
    (logged,) = refusals(caplog)
    assert type(logged) is PlaintextPeer


async def test_secure_dialer_refuses_a_plaintext_listener() -> None:
    """A secure node dialing a plaintext one gets PeerNotSecure, saying to check the spec."""
    with trio.fail_after(DEADLINE_S):
        async with (
            stage_server(WebSocketNetwork()) as (_, address),
            secure(COORD, "coordinator") as net,
        ):
            with pytest.raises(PeerNotSecure, match="insecure = false"):
                await net.dial(address)


@asynccontextmanager
async def raw_secure(
    address: str,
) -> AsyncIterator[tuple[trio_websocket.WebSocketConnection, SessionSealer]]:
    """A client that does the handshake by hand, so a test can misbehave after it."""
    async with raw(address) as ws:
        side = DialerHandshake(COORD, policy(), role="coordinator", now=NOW)
        await ws.send_message(side.offer())
        m2 = await ws.get_message()
        assert isinstance(m2, bytes)
        await ws.send_message(side.on_answer(m2))
        m4 = await ws.get_message()
        assert isinstance(m4, bytes)
        yield ws, side.on_verdict(m4)


async def _drain(ws: trio_websocket.WebSocketConnection) -> None:
    """Read until the server closes (it may have echoed frames before the bad one)."""
    while True:
        await ws.get_message()


def _replay(s: SessionSealer, echoed: bytes) -> list[bytes]:
    first = s.seal(encode(ping(5)))
    return [first, first]


def _reorder(s: SessionSealer, echoed: bytes) -> list[bytes]:
    a, b = s.seal(encode(ping(5))), s.seal(encode(ping(6)))
    return [b, a]


def _reflect(s: SessionSealer, echoed: bytes) -> list[bytes]:
    return [echoed]  # the server's own sealed frame, sent back to it


def _tamper(s: SessionSealer, echoed: bytes) -> list[bytes]:
    sealed = bytearray(s.seal(encode(ping(5))))
    sealed[-20] ^= 0x01
    return [bytes(sealed)]


def _truncate(s: SessionSealer, echoed: bytes) -> list[bytes]:
    return [s.seal(encode(ping(5)))[:-3]]


FRAME_ATTACKS = [
    ("replayed", _replay, ReplayedFrame),
    ("reordered", _reorder, ReorderedFrame),
    ("reflected", _reflect, ReflectedFrame),
    ("tampered", _tamper, TamperedFrame),
    ("truncated", _truncate, TruncatedFrame),
]


@pytest.mark.parametrize(
    ("_name", "attack", "error"), FRAME_ATTACKS, ids=[a[0] for a in FRAME_ATTACKS]
)
async def test_sealed_frame_attacks_reset_only_their_connection(
    _name: str, attack: Callable[[SessionSealer, bytes], list[bytes]], error: type[SealError]
) -> None:
    """After an honest exchange, a replayed, reordered, reflected, tampered or truncated frame
    makes the server close that connection with 1008 and its own error; others go on."""
    with trio.fail_after(DEADLINE_S):
        async with (
            stage_server() as (echo, address),
            honest(address),
            raw_secure(address) as (ws, sealer),
        ):
            await ws.send_message(sealer.seal(encode(ping(4))))
            echoed = await ws.get_message()
            assert isinstance(echoed, bytes)
            for data in attack(sealer, echoed):
                await ws.send_message(data)
            await echo.failed.wait()
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await _drain(ws)
    assert closed.value.reason is not None and closed.value.reason.code == 1008
    (failure,) = echo.errors
    assert type(failure) is error


async def test_hello_must_match_the_proven_role() -> None:
    """A client-token holder saying Hello as a stage (posing as the tail) is refused."""
    cli = secure(credentials("cli", ("client",)), "client")
    coord_net = secure(COORD, "coordinator")
    echo = Echo()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery, cli as net:
            address = await nursery.start(coord_net.serve, "127.0.0.1:0", echo)
            conn = await net.dial(address)
            await conn.send(Hello(node=NodeName("s9"), role="stage", swarm="lab"))
            with pytest.raises(ConnectionClosed):
                await conn.receive()
            await echo.failed.wait()
            nursery.cancel_scope.cancel()
    (failure,) = echo.errors
    assert isinstance(failure, RoleMismatch)
    assert "says it is a stage but its handshake admitted it as a client" in str(failure)
