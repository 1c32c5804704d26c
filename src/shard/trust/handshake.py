"""The two sides of the secure handshake, as pure state machines (``shard.trust.channel`` has the
messages, the transcript and the keys; ``shard.transport.secure`` runs them over a WebSocket).

The dialer calls ``offer()``, ``on_answer(M2)`` and ``on_verdict(M4)``; the listener calls
``on_offer(M1)`` and ``on_confirm(M3)``. ``now`` (Unix seconds) is injected, so token validity
is tested without a clock. Each step either returns the next message or raises the
``HandshakeError`` that applies; the caller then sends ``refusal(exc)`` to the peer, except
for a ``PeerRefused`` (the peer already knows) or a ``PlaintextPeer`` (it cannot read one).
"""

from __future__ import annotations

from collections.abc import Collection

import attrs
import nacl.public

from shard.trust.admission import Admitted
from shard.trust.channel import (
    PEER_ROLES,
    PROTOCOL,
    Accept,
    Answer,
    Confirm,
    Credentials,
    KeyNotProven,
    MalformedHandshake,
    Offer,
    Refuse,
    TrustPolicy,
    check_common,
    check_role,
    decode_message,
    dialer_transcript,
    encode_message,
    listener_transcript,
    refused,
    session_keys,
    x25519,
)
from shard.trust.identity import short, verify_signature
from shard.trust.sealer import SessionSealer


class _Side:
    def __init__(
        self,
        credentials: Credentials,
        policy: TrustPolicy,
        *,
        role: str,
        now: float,
        peer: str,
        peer_roles: Collection[str] | None,
        ephemeral: nacl.public.PrivateKey | None,
    ) -> None:
        self._credentials = credentials
        self._policy = policy
        self._role = role
        self._now = now
        self._peer = peer
        self._accepted = PEER_ROLES.get(role, frozenset()) if peer_roles is None else peer_roles
        self._ephemeral = ephemeral or nacl.public.PrivateKey.generate()

    def _admit(self, msg: Offer | Answer) -> Admitted:
        """The checks both sides make of the other's first message."""
        check_common(msg, self._policy, self._peer)
        token = self._policy.admit(
            msg.token,
            identity=msg.identity,
            role=msg.role,
            now=self._now,
            whose=f"the token of {self._peer}",
        )
        check_role(msg.role, self._role, self._accepted, self._peer)
        return Admitted(msg.identity, msg.role, token)

    def _not_proven(self, who: Admitted) -> KeyNotProven:
        return KeyNotProven(
            f"{self._peer} presented key {short(who.identity)} and its token but could not "
            "sign the handshake with it (a stolen or copied token, or a forged handshake)"
        )


class DialerHandshake(_Side):
    """The dialing side: ``offer()``, then ``on_answer(M2) -> M3``, then ``on_verdict(M4)``.

    Errors: each step raises the ``HandshakeError`` that applies; send ``refusal(exc)`` to the
    peer unless it is a ``PeerRefused`` or ``PlaintextPeer``.
    """

    def __init__(
        self,
        credentials: Credentials,
        policy: TrustPolicy,
        *,
        role: str,
        now: float,
        peer: str = "the peer",
        peer_roles: Collection[str] | None = None,
        ephemeral: nacl.public.PrivateKey | None = None,
    ) -> None:
        super().__init__(
            credentials,
            policy,
            role=role,
            now=now,
            peer=peer,
            peer_roles=peer_roles,
            ephemeral=ephemeral,
        )
        me = credentials.identity.public
        offer = Offer(PROTOCOL, policy.swarm, role, bytes(self._ephemeral.public_key), me, b"")
        self._m1 = encode_message(attrs.evolve(offer, token=credentials.token.encode()))
        self._m2 = self._m3 = b""
        self._shared = b""
        self._admitted: Admitted | None = None

    def offer(self) -> bytes:
        """M1, the ``Offer``."""
        return self._m1

    def on_answer(self, data: bytes) -> bytes:
        """Check the listener's ``Answer``; return M3, the ``Confirm``."""
        msg = decode_message(data, Answer, self._peer)
        if isinstance(msg, Refuse):
            raise refused(msg, self._peer)
        admitted = self._admit(msg)
        unsigned = encode_message(attrs.evolve(msg, signature=b""))
        if not verify_signature(
            msg.identity, listener_transcript(self._m1, unsigned), msg.signature
        ):
            raise self._not_proven(admitted)
        self._m2 = encode_message(msg)
        signature = self._credentials.identity.sign(dialer_transcript(self._m1, self._m2))
        self._m3 = encode_message(Confirm(signature))
        self._shared = x25519(self._ephemeral, msg.ephemeral, self._peer)
        self._admitted = admitted
        return self._m3

    def on_verdict(self, data: bytes) -> SessionSealer:
        """Read the listener's ``Accept``; return this connection's sealer."""
        msg = decode_message(data, Accept, self._peer)
        if isinstance(msg, Refuse):
            raise refused(msg, self._peer)
        if self._admitted is None:
            raise MalformedHandshake(f"{self._peer}: Accept before Answer")
        to_listener, to_dialer = session_keys(self._shared, self._m1, self._m2, self._m3)
        return SessionSealer(send_key=to_listener, receive_key=to_dialer, peer=self._admitted)


class ListenerHandshake(_Side):
    """The accepting side: ``on_offer(M1) -> M2``, then ``on_confirm(M3) -> (M4, sealer)``.

    Errors: as ``DialerHandshake``.
    """

    def __init__(
        self,
        credentials: Credentials,
        policy: TrustPolicy,
        *,
        role: str,
        now: float,
        peer: str = "the peer",
        peer_roles: Collection[str] | None = None,
        ephemeral: nacl.public.PrivateKey | None = None,
    ) -> None:
        super().__init__(
            credentials,
            policy,
            role=role,
            now=now,
            peer=peer,
            peer_roles=peer_roles,
            ephemeral=ephemeral,
        )
        self._m1 = self._m2 = b""
        self._offer: Offer | None = None
        self._admitted: Admitted | None = None

    def on_offer(self, data: bytes) -> bytes:
        """Check the dialer's ``Offer``; return M2, the signed ``Answer``."""
        msg = decode_message(data, Offer, self._peer)
        if isinstance(msg, Refuse):
            raise refused(msg, self._peer)
        self._admitted = self._admit(msg)
        self._offer = msg
        self._m1 = encode_message(msg)
        me = self._credentials
        answer = Answer(
            PROTOCOL,
            self._policy.swarm,
            self._role,
            bytes(self._ephemeral.public_key),
            me.identity.public,
            me.token.encode(),
            b"",
        )
        signature = me.identity.sign(listener_transcript(self._m1, encode_message(answer)))
        self._m2 = encode_message(attrs.evolve(answer, signature=signature))
        return self._m2

    def on_confirm(self, data: bytes) -> tuple[bytes, SessionSealer]:
        """Check the dialer's ``Confirm``; return M4 (``Accept``) and this connection's sealer."""
        msg = decode_message(data, Confirm, self._peer)
        if isinstance(msg, Refuse):
            raise refused(msg, self._peer)
        if self._offer is None or self._admitted is None:
            raise MalformedHandshake(f"{self._peer}: Confirm before Offer")
        transcript = dialer_transcript(self._m1, self._m2)
        if not verify_signature(self._offer.identity, transcript, msg.signature):
            raise self._not_proven(self._admitted)
        shared = x25519(self._ephemeral, self._offer.ephemeral, self._peer)
        to_listener, to_dialer = session_keys(shared, self._m1, self._m2, encode_message(msg))
        sealer = SessionSealer(send_key=to_dialer, receive_key=to_listener, peer=self._admitted)
        return encode_message(Accept()), sealer
