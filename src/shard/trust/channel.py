"""The secure wire's handshake: two admitted identities agree on per-direction session keys.

Pure and synchronous (the transport runs it over a WebSocket: ``shard.transport.secure``).
Four messages, each one binary WebSocket message, before any wire frame::

    dialer   -> listener   Offer    protocol, swarm, role, ephemeral X25519, identity, token
    listener -> dialer     Answer   the same for the listener + signature over the transcript
    dialer   -> listener   Confirm  signature over the transcript (Offer, signed Answer)
    listener -> dialer     Accept   (or Refuse: reason + detail, at any step, from either side)

Each side checks the other's admission token (authority, signature, swarm, key, validity,
revocation, role) and that the role is one that may connect to it; the signatures prove each
side holds the key its token names and bind both ephemeral keys, identities, tokens, the swarm,
the roles and the protocol. Keys: BLAKE2b over the X25519 secret and the whole transcript, one
per direction (``shard.trust.sealer``). Byte-level description: ``docs/security.md``.

Errors: ``ChannelError`` subclasses (and ``shard.trust.admission`` errors), all ``HandshakeError``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final, TypeVar

import attrs
import msgpack
import nacl.bindings
import nacl.encoding
import nacl.exceptions
import nacl.hash
import nacl.public

from shard.errors import HandshakeError
from shard.trust.admission import (
    AdmissionToken,
    ForeignSwarm,
    TokenMalformed,
    TokenMissing,
    unpack_small,
    verify,
)
from shard.trust.identity import KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, short
from shard.wire import WIRE_VERSION

PROTOCOL: Final = 1
MAGIC: Final = "shard-hs"
#: Roles that may be at the other end of a connection, by this node's role.
PEER_ROLES: Final[Mapping[str, frozenset[str]]] = {
    "stage": frozenset({"stage", "coordinator"}),
    "coordinator": frozenset({"stage", "client", "monitor"}),
    "client": frozenset({"coordinator"}),
    "monitor": frozenset({"coordinator"}),
}
_MAX_TEXT: Final = 512


class ChannelError(HandshakeError):
    """The secure handshake failed; ``reason`` is a short code, ``str()`` says what to do."""

    reason = "channel"


class PlaintextPeer(ChannelError):
    """The peer's first frame is a plaintext wire frame: it runs with ``insecure = true``."""

    reason = "plaintext-peer"


class PeerNotSecure(ChannelError):
    """The peer closed the connection on our handshake: it does not speak the secure wire."""

    reason = "peer-not-secure"


class MalformedHandshake(ChannelError):
    """A handshake message is not well formed (or arrived out of turn)."""

    reason = "malformed"


class ProtocolMismatch(ChannelError):
    """The peer speaks another handshake protocol version."""

    reason = "protocol"


class RoleNotWelcome(ChannelError):
    """The peer's role, though its token grants it, does not connect to this node's role."""

    reason = "role-not-welcome"


class KeyNotProven(ChannelError):
    """The peer's transcript signature is invalid: it does not hold the key its token names."""

    reason = "bad-handshake-signature"


class PeerRefused(ChannelError):
    """The peer refused this node; ``reason`` is the peer's code for why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.frozen
class TrustPolicy:
    """What this node requires of a peer's token: this swarm's authority, name, revocations."""

    authority: bytes = attrs.field(repr=short)
    swarm: str
    revoked: frozenset[int] = frozenset()

    def admit(
        self, token: bytes, *, identity: bytes, role: str, now: float, whose: str
    ) -> AdmissionToken:
        """Decode and verify a presented token. Errors: the ``AdmissionError`` that applies."""
        if not token:
            raise TokenMissing(f"{whose} presented no admission token; every node needs one")
        try:
            decoded = AdmissionToken.decode(token)
        except TokenMalformed as exc:
            raise TokenMalformed(f"{whose}: {exc}") from None
        verify(
            decoded,
            authority_pub=self.authority,
            swarm=self.swarm,
            role=role,
            now=now,
            revoked=self.revoked,
            node_pub=identity,
            whose=whose,
        )
        return decoded


@attrs.frozen
class Credentials:
    """This node's identity key and the token that admits it."""

    identity: NodeIdentity
    token: AdmissionToken


# --- messages --------------------------------------------------------------------------------


@attrs.frozen
class Offer:
    protocol: int
    swarm: str
    role: str
    ephemeral: bytes
    identity: bytes
    token: bytes


@attrs.frozen
class Answer:
    protocol: int
    swarm: str
    role: str
    ephemeral: bytes
    identity: bytes
    token: bytes
    signature: bytes


@attrs.frozen
class Confirm:
    signature: bytes


@attrs.frozen
class Accept:
    pass


@attrs.frozen
class Refuse:
    reason: str
    detail: str


HandshakeMessage = Offer | Answer | Confirm | Accept | Refuse
M = TypeVar("M", Offer, Answer, Confirm, Accept)
_KINDS: Final[dict[str, type[HandshakeMessage]]] = {
    "offer": Offer,
    "answer": Answer,
    "confirm": Confirm,
    "accept": Accept,
    "refuse": Refuse,
}
_NAMES: Final = {cls: name for name, cls in _KINDS.items()}
_SIZES: Final = {"ephemeral": KEY_BYTES, "identity": KEY_BYTES, "signature": SIGNATURE_BYTES}
_TYPES: Final[dict[str, type]] = {"int": int, "str": str, "bytes": bytes}


def encode_message(msg: HandshakeMessage) -> bytes:
    """``msgpack([MAGIC, kind, *fields])``: canonical, so both sides hash the same bytes."""
    packed: bytes = msgpack.packb(
        [MAGIC, _NAMES[type(msg)], *attrs.astuple(msg, recurse=False)], use_bin_type=True
    )
    return packed


def decode_message(data: bytes, expected: type[M], peer: str) -> M | Refuse:
    """Parse a handshake message of type ``expected`` (or a ``Refuse``).

    Errors: ``PlaintextPeer`` for a plaintext wire frame; ``MalformedHandshake`` otherwise.
    """
    if data[:1] == bytes([WIRE_VERSION]):
        raise PlaintextPeer(
            f"{peer} sent a plaintext wire frame instead of a secure handshake: it runs with "
            "insecure = true (or an old build); this node only accepts the secure wire"
        )
    try:
        body = unpack_small(data)
    except ValueError as exc:
        raise MalformedHandshake(f"{peer}: handshake message is not msgpack ({exc})") from None
    if not isinstance(body, list) or len(body) < 2 or body[0] != MAGIC:
        raise MalformedHandshake(f"{peer}: not a shard handshake message")
    cls = _KINDS.get(body[1]) if isinstance(body[1], str) else None
    if cls is not expected and cls is not Refuse:
        raise MalformedHandshake(
            f"{peer}: expected a handshake {_NAMES[expected]!r}, got {str(body[1])[:32]!r}"
        )
    fields = attrs.fields(cls)
    values = body[2:]
    if len(values) != len(fields) or not all(map(_valid, fields, values)):
        raise MalformedHandshake(f"{peer}: handshake {body[1]!r} has malformed fields")
    msg = cls(*values)
    assert isinstance(msg, (expected, Refuse))
    return msg


def _valid(field: attrs.Attribute[object], value: object) -> bool:
    kind = _TYPES[str(field.type)]
    if type(value) is not kind:
        return False
    if isinstance(value, str):
        return len(value) <= _MAX_TEXT
    size = _SIZES.get(field.name)
    return not (isinstance(value, bytes) and size is not None and len(value) != size)


def refusal(exc: HandshakeError) -> bytes:
    """The ``Refuse`` message telling the peer why it was refused."""
    return encode_message(Refuse(exc.reason[:64], str(exc)[:_MAX_TEXT]))


# --- transcript and keys ---------------------------------------------------------------------


def _lp(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def _blake2b(person: bytes, data: bytes, key: bytes = b"") -> bytes:
    digest: bytes = nacl.hash.blake2b(
        data, digest_size=32, key=key, person=person, encoder=nacl.encoding.RawEncoder
    )
    return digest


def listener_transcript(m1: bytes, m2_unsigned: bytes) -> bytes:
    """What the listener signs: BLAKE2b-256, person ``shard-hs1-listen``, of lp(M1) lp(M2')."""
    return _blake2b(b"shard-hs1-listen", _lp(m1, m2_unsigned))


def dialer_transcript(m1: bytes, m2: bytes) -> bytes:
    """What the dialer signs: BLAKE2b-256, person ``shard-hs1-dialer``, of lp(M1) lp(M2)."""
    return _blake2b(b"shard-hs1-dialer", _lp(m1, m2))


def session_keys(shared: bytes, m1: bytes, m2: bytes, m3: bytes) -> tuple[bytes, bytes]:
    """``(dialer->listener, listener->dialer)`` keys from the X25519 secret and transcript."""
    th = _blake2b(b"shard-hs1-keys", _lp(m1, m2, m3))
    return _blake2b(b"shard-hs1-d2l", th, key=shared), _blake2b(b"shard-hs1-l2d", th, key=shared)


def x25519(secret: nacl.public.PrivateKey, public: bytes, peer: str) -> bytes:
    try:
        shared: bytes = nacl.bindings.crypto_scalarmult(bytes(secret), public)
    except nacl.exceptions.RuntimeError:  # libsodium refuses an all-zero result
        raise MalformedHandshake(f"{peer}: ephemeral key is a low-order point") from None
    return shared


def check_common(msg: Offer | Answer, policy: TrustPolicy, peer: str) -> None:
    if msg.protocol != PROTOCOL:
        raise ProtocolMismatch(
            f"{peer} speaks handshake protocol {msg.protocol}, this node {PROTOCOL}; run the "
            "same shard version on every node"
        )
    if msg.swarm != policy.swarm:
        raise ForeignSwarm(f"{peer} belongs to swarm {msg.swarm!r}, not {policy.swarm!r}")


def check_role(role: str, mine: str, accepted: Collection[str], peer: str) -> None:
    if role not in accepted:
        raise RoleNotWelcome(
            f"{peer} connects as a {role}, which a {mine} does not talk to "
            f"(it takes {', '.join(sorted(accepted)) or 'no one'})"
        )


def refused(msg: Refuse, peer: str) -> PeerRefused:
    return PeerRefused(f"{peer} refused this node ({msg.reason}): {msg.detail}", msg.reason)
