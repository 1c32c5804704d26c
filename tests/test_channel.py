"""The secure handshake as pure state machines: an honest exchange yields matching sealers;
every way a peer can fail admission or proof of key is its own error, on the side that checks."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from shard.errors import HandshakeError
from shard.messages import Hello, NodeName
from shard.trust.admission import (
    BadTokenSignature,
    ForeignAuthority,
    ForeignSwarm,
    RoleNotAllowed,
    TokenExpired,
    TokenMalformed,
    TokenMissing,
    TokenNotYetValid,
    TokenRevoked,
    WrongIdentity,
)
from shard.trust.channel import (
    PROTOCOL,
    Answer,
    Confirm,
    Credentials,
    KeyNotProven,
    MalformedHandshake,
    Offer,
    PeerRefused,
    PlaintextPeer,
    ProtocolMismatch,
    Refuse,
    RoleNotWelcome,
    decode_message,
    dialer_transcript,
    encode_message,
    refusal,
)
from shard.trust.handshake import DialerHandshake, ListenerHandshake
from shard.trust.sealer import ReflectedFrame, SessionSealer, TamperedFrame
from shard.wire import encode
from trust_fixtures import NOW, OTHER_AUTHORITY, credentials, forged, identity, policy, token

COORD = credentials("coord", ("coordinator",))
S0 = credentials("s0", ("stage",))


def dialer(creds: Credentials = COORD, role: str = "coordinator", **kw: object) -> DialerHandshake:
    kw.setdefault("now", NOW)
    return DialerHandshake(creds, kw.pop("policy", policy()), role=role, **kw)  # type: ignore[arg-type]


def listener(creds: Credentials = S0, role: str = "stage", **kw: object) -> ListenerHandshake:
    kw.setdefault("now", NOW)
    return ListenerHandshake(creds, kw.pop("policy", policy()), role=role, **kw)  # type: ignore[arg-type]


def run(d: DialerHandshake, s: ListenerHandshake) -> tuple[SessionSealer, SessionSealer]:
    """One honest exchange of the four messages."""
    m2 = s.on_offer(d.offer())
    m3 = d.on_answer(m2)
    m4, listener_sealer = s.on_confirm(m3)
    return d.on_verdict(m4), listener_sealer


def test_honest_handshake_gives_matching_sealers_and_peers() -> None:
    """Both sides agree on keys (frames open both ways) and learn who the other is."""
    d, s = run(dialer(), listener())
    assert s.open(d.seal(b"to stage 0")) == b"to stage 0"
    assert d.open(s.seal(b"to coord")) == b"to coord"
    assert d.peer is not None and d.peer.identity == S0.identity.public
    assert d.peer.role == "stage" and d.peer.token == S0.token
    assert s.peer is not None and s.peer.role == "coordinator"
    with pytest.raises(ReflectedFrame):
        d.open(d.seal(b"bounced"))


def test_two_handshakes_never_share_keys() -> None:
    """Fresh ephemeral keys: a frame from one session does not open in another."""
    d1, _ = run(dialer(), listener())
    _, s2 = run(dialer(), listener())
    with pytest.raises(TamperedFrame, match="fails authentication"):
        s2.open(d1.seal(b"x"))


def coord_token(**kw: object) -> bytes:
    """An encoded coordinator token for coord's key, with ``kw`` as ``token``."""
    return token(identity("coord"), ("coordinator",), **kw).encode()  # type: ignore[arg-type]


def _offer_with(**changes: object) -> bytes:
    offer = decode_message(dialer().offer(), Offer, "test")
    assert isinstance(offer, Offer)
    return encode_message(attrs.evolve(offer, **changes))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: _offer_with(token=b""), TokenMissing),
        (lambda: _offer_with(token=b"\x93junk"), TokenMalformed),
        (
            lambda: _offer_with(
                token=coord_token(swarm="other"),
                swarm="other",
            ),
            ForeignSwarm,
        ),
        (
            lambda: _offer_with(token=coord_token(swarm="other")),
            ForeignSwarm,
        ),
        (lambda: _offer_with(swarm="other"), ForeignSwarm),
        (
            lambda: _offer_with(token=coord_token(authority=OTHER_AUTHORITY)),
            ForeignAuthority,
        ),
        (
            lambda: _offer_with(token=coord_token(expires=NOW - 1)),
            TokenExpired,
        ),
        (
            lambda: _offer_with(token=coord_token(not_before=NOW + 99)),
            TokenNotYetValid,
        ),
        (
            lambda: _offer_with(token=forged(COORD.token, roles=("coordinator", "stage")).encode()),
            BadTokenSignature,
        ),
        (lambda: _offer_with(token=S0.token.encode()), WrongIdentity),
        (lambda: _offer_with(role="stage"), RoleNotAllowed),
        (lambda: _offer_with(protocol=PROTOCOL + 1), ProtocolMismatch),
        (lambda: encode(Hello(node=NodeName("c"), role="coordinator", swarm="lab")), PlaintextPeer),
        (lambda: b"\xc1", MalformedHandshake),
        (
            lambda: encode_message(Answer(1, "lab", "stage", b"e" * 32, b"i" * 32, b"", b"s" * 64)),
            MalformedHandshake,
        ),
        (lambda: _offer_with(ephemeral=b"short"), MalformedHandshake),
    ],
)
def test_listener_refuses_a_bad_offer(
    make: Callable[[], bytes], error: type[HandshakeError]
) -> None:
    """No token, malformed, foreign swarm, foreign authority, expired, not yet valid, forged,
    another key's token, wrong role, wrong protocol, plaintext, garbage: each its own error."""
    with pytest.raises(error) as caught:
        listener().on_offer(make())
    assert type(caught.value) is error


def test_listener_refuses_a_revoked_dialer() -> None:
    """A dialer whose serial is revoked is refused as revoked."""
    coord = credentials("coord", ("coordinator",), serial=42)
    with pytest.raises(TokenRevoked):
        listener(policy=policy(revoked={42})).on_offer(dialer(coord).offer())


def test_a_role_the_link_does_not_take_is_refused() -> None:
    """A client (its token grants client) may not dial a stage: RoleNotWelcome."""
    client = credentials("cli", ("client",))
    with pytest.raises(RoleNotWelcome, match="connects as a client, which a stage does not"):
        listener().on_offer(dialer(client, "client").offer())


def test_dialer_refuses_a_listener_it_cannot_admit() -> None:
    """The dialer checks the listener's token too: an expired stage token is refused."""
    stale = credentials("s0", ("stage",), expires=NOW - 5)
    d = dialer()
    with pytest.raises(TokenExpired, match="the token of the peer"):
        d.on_answer(listener(stale).on_offer(d.offer()))


def test_dialer_refuses_a_listener_of_the_wrong_role() -> None:
    """A coordinator dialing another coordinator (not its successor's role) refuses it."""
    d = dialer()
    with pytest.raises(RoleNotWelcome):
        d.on_answer(listener(COORD, "coordinator").on_offer(d.offer()))


def test_listener_without_the_key_cannot_answer() -> None:
    """An impostor with s0's token and public key, but its own secret, fails the dialer's check."""
    impostor = identity("mallory")
    s = listener(Credentials(impostor, S0.token))
    d = dialer()
    m2 = decode_message(s.on_offer(d.offer()), Answer, "t")
    assert isinstance(m2, Answer)
    m2 = attrs.evolve(m2, identity=S0.identity.public)
    with pytest.raises(KeyNotProven, match="could not sign the handshake"):
        d.on_answer(encode_message(m2))


def test_dialer_without_the_key_cannot_confirm() -> None:
    """A dialer showing coord's public key and token but holding another secret is refused."""
    m1 = _offer_with(identity=COORD.identity.public)  # as sent by an impostor
    s = listener()
    m2 = s.on_offer(m1)
    forged_confirm = Confirm(identity("mallory").sign(dialer_transcript(m1, m2)))
    with pytest.raises(KeyNotProven, match="could not sign the handshake"):
        s.on_confirm(encode_message(forged_confirm))


def test_tampered_answer_fails_the_signature() -> None:
    """A man in the middle swapping the listener's ephemeral key breaks its signature."""
    d = dialer()
    m2 = decode_message(listener().on_offer(d.offer()), Answer, "t")
    assert isinstance(m2, Answer)
    swapped = attrs.evolve(m2, ephemeral=bytes(32 * [9]))
    with pytest.raises(KeyNotProven):
        d.on_answer(encode_message(swapped))


def test_reflected_offer_is_not_a_valid_answer() -> None:
    """A dialer's own Offer sent back is refused (wrong message, no signature)."""
    d = dialer()
    with pytest.raises(MalformedHandshake, match="expected a handshake 'answer'"):
        d.on_answer(d.offer())


def test_refusal_reaches_the_other_side_with_its_reason() -> None:
    """A Refuse message becomes PeerRefused carrying the refusing side's reason code."""
    d = dialer(peer="127.0.0.1:7701")
    refused = refusal(TokenExpired("the token of 127.0.0.1:5 expired"))
    with pytest.raises(
        PeerRefused, match=r"127.0.0.1:7701 refused this node \(expired\)"
    ) as caught:
        d.on_answer(refused)
    assert caught.value.reason == "expired"
    assert decode_message(refused, Offer, "t") == Refuse(
        "expired", "the token of 127.0.0.1:5 expired"
    )


def test_messages_are_canonical() -> None:
    """Encoding is deterministic, so both sides hash identical transcripts."""
    offer = Offer(PROTOCOL, "lab", "stage", b"e" * 32, b"i" * 32, b"tok")
    assert encode_message(offer) == encode_message(Offer(*attrs.astuple(offer)))
    assert decode_message(encode_message(offer), Offer, "t") == offer
