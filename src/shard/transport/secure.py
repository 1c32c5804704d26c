"""``SecureWebSocketNetwork``: WebSockets whose every connection is authenticated and sealed.

It is a ``WebSocketNetwork`` with a handshake hook: right after a WebSocket opens, and before
any wire frame, the two sides run the secure handshake (``shard.trust.handshake``) on the raw
WebSocket, each proving its identity key and showing its admission token; the connection's
``SessionSealer`` then encrypts every frame under per-direction keys. A peer that is refused
is told why (a ``Refuse`` message, then close 1008) and the refusal surfaces as a
``HandshakeError`` subclass: raised by ``dial``, logged by ``serve``, which keeps serving
everyone else. ``docs/security.md`` has the protocol; ``shard.nodes.compose`` builds this network
from a spec.

Connections also bind the ring's own first words to the handshake: a ``Hello``/``Welcome``
whose role differs from the role the peer's token proved is refused (``RoleMismatch``), so a
client's token cannot pose as the tail stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TypeVar

import trio
import trio_websocket

from shard.errors import HandshakeError
from shard.messages import Hello, Message, Welcome
from shard.transport.base import Connection, ConnectionStatistics, Handler, NetworkBase
from shard.transport.guard import Activity, PeerDeadlines
from shard.transport.paths import Route, Router, Sealed
from shard.transport.websocket import (
    MAX_CONNECTIONS,
    POLICY_VIOLATION,
    WebSocketConnection,
    WebSocketNetwork,
)
from shard.trust.admission import Admitted
from shard.trust.channel import (
    ChannelError,
    Credentials,
    MalformedHandshake,
    PeerNotSecure,
    PeerRefused,
    PlaintextPeer,
    TrustPolicy,
    refusal,
)
from shard.trust.handshake import DialerHandshake, ListenerHandshake
from shard.trust.identity import short
from shard.trust.sealer import SessionSealer
from shard.wire import WireLimits

T = TypeVar("T")
_PLAINTEXT_REFUSED = "secure wire required: this node refuses plaintext peers (insecure = true)"


class RoleMismatch(ChannelError):
    """A peer's Hello/Welcome names another role than the one its handshake proved."""

    reason = "role-mismatch"


def token_roles(conn: object) -> tuple[str, ...]:
    """The roles the verified admission token of ``conn``'s peer grants; ``()`` on a
    connection that is not a ``SecureConnection`` (a plaintext wire proves nothing)."""
    who = getattr(conn, "authenticated", None)
    return tuple(who.token.roles) if isinstance(who, Admitted) else ()


class SecureConnection:
    """A sealed ``WebSocketConnection`` that knows who is at the other end (``authenticated``)."""

    def __init__(self, inner: WebSocketConnection) -> None:
        sealer = inner.sealer
        assert isinstance(sealer, SessionSealer) and sealer.peer is not None
        self._inner = inner
        self.authenticated: Admitted = sealer.peer

    @property
    def peer(self) -> str:
        return self._inner.peer

    @property
    def activity(self) -> Activity:
        """The inner connection's ``Activity`` (``shard.transport.guard``)."""
        return self._inner.activity

    def statistics(self) -> ConnectionStatistics:
        return self._inner.statistics()

    async def send(self, msg: Message) -> None:
        await self._inner.send(msg)

    async def receive(self) -> Message:
        """As ``WebSocketConnection.receive``; also ``RoleMismatch`` (after closing)."""
        msg = await self._inner.receive()
        if isinstance(msg, Hello | Welcome) and msg.role != self.authenticated.role:
            await self._inner.aclose()
            raise RoleMismatch(
                f"{self.peer} ({short(self.authenticated.identity)}) says it is a {msg.role} "
                f"but its handshake admitted it as a {self.authenticated.role}; refused"
            )
        return msg

    async def aclose(self) -> None:
        await self._inner.aclose()


class SecureWebSocketNetwork(NetworkBase):
    """A ``Network`` of authenticated, encrypted WebSocket connections.

    ``role`` is what this node claims on every connection (its token must grant it);
    ``peer_roles`` the roles it talks to (default ``shard.trust.channel.PEER_ROLES[role]``).
    ``clock`` gives Unix seconds for token validity (injected; default ``time.time``).
    ``max_peer_connections``, ``deadlines``: as ``WebSocketNetwork``'s (counted and applied
    from before the secure handshake).

    Cancellation and errors: as ``WebSocketNetwork``; a refused handshake raises a
    ``HandshakeError`` subclass from ``dial`` (never retried: the answer would not change).
    """

    def __init__(
        self,
        credentials: Credentials,
        policy: TrustPolicy,
        *,
        role: str,
        peer_roles: Collection[str] | None = None,
        limits: WireLimits | None = None,
        connect_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        max_peer_connections: int | None = None,
        max_buffer_bytes: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        deadlines: PeerDeadlines | None = None,
    ) -> None:
        self._credentials = credentials
        self._policy = policy
        self._role = role
        self._peer_roles = peer_roles
        self._clock = clock
        self._close_s = connect_timeout_s
        self._inner = WebSocketNetwork(
            limits=limits,
            connect_timeout_s=connect_timeout_s,
            handshake=self._handshake,
            max_peer_connections=max_peer_connections,
            max_buffer_bytes=max_buffer_bytes,
            max_connections=max_connections,
            deadlines=deadlines,
        )

    def __repr__(self) -> str:
        me = short(self._credentials.identity.public)
        return f"SecureWebSocketNetwork({self._role}, {me}, swarm={self._policy.swarm!r})"

    async def _enter(self) -> None:
        await self._inner.__aenter__()

    async def _exit(self, exc: BaseException | None) -> None:
        if exc is None:
            await self._inner.__aexit__(None, None, None)
        else:
            await self._inner.__aexit__(type(exc), exc, exc.__traceback__)

    async def dial(self, address: str) -> SecureConnection:
        return SecureConnection(await self._inner.dial(address))

    async def dial_path(self, address: str, path: str, *, dialer: bool) -> SecureConnection:
        """As ``WebSocketNetwork.dial_path``: the secure handshake runs as ``dialer`` says."""
        return SecureConnection(await self._inner.dial_path(address, path, dialer=dialer))

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As ``WebSocketNetwork.serve``; ``handler`` gets ``SecureConnection``s."""
        await self._inner.serve(address, _secured(handler), task_status=task_status)

    async def serve_paths(
        self,
        address: str,
        handler: Handler,
        router: Router,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As ``WebSocketNetwork.serve_paths``: a ``Sealed`` path's connection is secured
        (the handshake run as its route says) and handed over as a ``SecureConnection``; a
        ``Piped`` one is passed through untouched (a relay never opens what it carries)."""

        def route(path: str) -> Route | None:
            found = router(path)
            if isinstance(found, Sealed):
                return Sealed(_secured(found.handler), dialer=found.dialer)
            return found

        await self._inner.serve_paths(address, _secured(handler), route, task_status=task_status)

    async def _handshake(
        self, ws: trio_websocket.WebSocketConnection, *, peer: str, dialer: bool
    ) -> SessionSealer:
        try:
            if dialer:
                return await self._dial_side(ws, peer)
            return await self._listen_side(ws, peer)
        except trio_websocket.ConnectionClosed as exc:
            reason = exc.reason
            if not dialer or reason is None or reason.code != POLICY_VIOLATION:
                raise
            raise PeerNotSecure(
                f"{peer} closed the connection during the secure handshake ({reason.code}: "
                f"{reason.reason}); it does not speak the secure wire: check that its spec "
                "also says insecure = false"
            ) from None

    async def _dial_side(self, ws: trio_websocket.WebSocketConnection, peer: str) -> SessionSealer:
        side = DialerHandshake(
            self._credentials,
            self._policy,
            role=self._role,
            now=self._clock(),
            peer=peer,
            peer_roles=self._peer_roles,
        )
        await ws.send_message(side.offer())
        await ws.send_message(await self._step(ws, peer, side.on_answer))
        return await self._step(ws, peer, side.on_verdict)

    async def _listen_side(
        self, ws: trio_websocket.WebSocketConnection, peer: str
    ) -> SessionSealer:
        side = ListenerHandshake(
            self._credentials,
            self._policy,
            role=self._role,
            now=self._clock(),
            peer=peer,
            peer_roles=self._peer_roles,
        )
        await ws.send_message(await self._step(ws, peer, side.on_offer))
        accept, sealer = await self._step(ws, peer, side.on_confirm)
        await ws.send_message(accept)
        return sealer

    async def _step(
        self, ws: trio_websocket.WebSocketConnection, peer: str, step: Callable[[bytes], T]
    ) -> T:
        """Receive the peer's next message and run one step on it; on failure tell the peer
        why, close, re-raise."""
        try:
            return step(await _receive(ws, peer))
        except HandshakeError as exc:
            await self._refuse(ws, exc)
            raise

    async def _refuse(self, ws: trio_websocket.WebSocketConnection, exc: HandshakeError) -> None:
        # Bounded: a peer that stops reading must not hold this side's handshake open.
        with trio.move_on_after(self._close_s):
            try:
                if isinstance(exc, PlaintextPeer):
                    await ws.aclose(POLICY_VIOLATION, _PLAINTEXT_REFUSED)
                    return
                if not isinstance(exc, PeerRefused):
                    await ws.send_message(refusal(exc))
                await ws.aclose(POLICY_VIOLATION, f"handshake refused: {exc.reason}")
            except trio_websocket.ConnectionClosed:
                pass


def _secured(handler: Handler) -> Handler:
    async def secured(conn: Connection) -> None:
        assert isinstance(conn, WebSocketConnection)
        await handler(SecureConnection(conn))

    return secured


async def _receive(ws: trio_websocket.WebSocketConnection, peer: str) -> bytes:
    data = await ws.get_message()
    if isinstance(data, str):
        raise MalformedHandshake(f"{peer} sent a text WebSocket message during the handshake")
    return data
