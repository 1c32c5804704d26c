"""SessionSealer: sealed frames round-trip; replay, reorder, reflection, tampering, truncation
and plaintext are each detected with their own error, and the sealer stays failed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard.messages import ChunkSeq, Epoch, SessionId, Tensor, Verify
from shard.trust.sealer import (
    HEADER,
    OVERHEAD,
    PlaintextFrame,
    ReflectedFrame,
    ReorderedFrame,
    ReplayedFrame,
    SealError,
    SessionSealer,
    TamperedFrame,
    TruncatedFrame,
)
from shard.wire import WireError, decode, encode

K1, K2 = b"\x01" * 32, b"\x02" * 32


def pair() -> tuple[SessionSealer, SessionSealer]:
    """Two ends of one connection: a's sending key is b's receiving key and vice versa."""
    return SessionSealer(send_key=K1, receive_key=K2), SessionSealer(send_key=K2, receive_key=K1)


def verify_msg(i: int) -> Verify:
    return Verify(session=SessionId(1), epoch=Epoch(0), seq=ChunkSeq(i), start=i, ids=(i,))


def test_frames_round_trip_in_both_directions() -> None:
    """Wire frames sealed on one side open, in order, on the other, both ways."""
    a, b = pair()
    hidden = Tensor("float32", (1, 16, 576), bytes(range(256)) * 144)
    for i in range(5):
        msg = Verify(SessionId(1), Epoch(0), ChunkSeq(i), start=i, hidden=hidden)
        sealed = a.seal(encode(msg))
        assert len(sealed) == len(encode(msg)) + OVERHEAD
        assert bytes(hidden.data[:64]) not in sealed  # encrypted, not just signed
        assert decode(b.open(sealed)) == msg
        assert decode(a.open(b.seal(encode(verify_msg(i))))) == verify_msg(i)


@given(st.lists(st.binary(max_size=300), max_size=8))
def test_any_bytes_round_trip(frames: list[bytes]) -> None:
    """Any sequence of byte strings (empty included) comes out as it went in."""
    a, b = pair()
    assert [b.open(a.seal(f)) for f in frames] == frames


def _failed_with(b: SessionSealer, data: bytes, error: type[SealError], words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        b.open(data)
    assert type(caught.value) is error and isinstance(caught.value, WireError)
    with pytest.raises(SealError, match=f"already failed \\({error.reason}\\)"):
        b.open(data)


def test_replayed_frame() -> None:
    """A frame delivered twice is refused as replayed, naming the counters."""
    a, b = pair()
    first = a.seal(b"one")
    assert b.open(first) == b"one"
    _failed_with(b, first, ReplayedFrame, "replayed: counter 0 was already received")


def test_reordered_frame() -> None:
    """A frame from further ahead (the one before it held back) is refused as reordered."""
    a, b = pair()
    a.seal(b"zero")
    one = a.seal(b"one")
    _failed_with(b, one, ReorderedFrame, "reordered: counter 1 arrived while 0 was expected")


def test_reflected_frame() -> None:
    """A frame sent back to the side that sealed it is refused as reflected."""
    a, _ = pair()
    _failed_with(a, a.seal(b"mine"), ReflectedFrame, "reflected: counter 0 was sealed by this")


@pytest.mark.parametrize("where", [0, 3, 8, 12, 13, 20, -1])
def test_tampered_byte_anywhere(where: int) -> None:
    """Flipping any byte (header, counter, length, ciphertext, tag) fails the frame."""
    a, b = pair()
    sealed = bytearray(a.seal(b"x" * 40))
    sealed[where] ^= 0x20
    with pytest.raises((TamperedFrame, TruncatedFrame, PlaintextFrame)) as caught:
        b.open(bytes(sealed))
    if where % len(sealed) >= 13:
        assert type(caught.value) is TamperedFrame


def test_tampered_ciphertext() -> None:
    """A ciphertext bit flip fails authentication: tampered, not replay or reorder."""
    a, b = pair()
    sealed = bytearray(a.seal(b"payload" * 10))
    sealed[HEADER.size + 5] ^= 1
    _failed_with(b, bytes(sealed), TamperedFrame, "tampered: counter 0 fails authentication")


def test_forged_counter_in_header_is_tampering() -> None:
    """Rewriting the (authenticated) counter is tampering, not a replay."""
    a, b = pair()
    sealed = bytearray(a.seal(b"abc"))
    sealed[8] ^= 1  # counter 0 -> 1
    _failed_with(b, bytes(sealed), TamperedFrame, "fails authentication")


@pytest.mark.parametrize("keep", [0, 5, HEADER.size, OVERHEAD, -1, -16])
def test_truncated_frame(keep: int) -> None:
    """A record cut short anywhere is refused as truncated."""
    a, b = pair()
    sealed = a.seal(b"\x99" * 64)
    _failed_with(b, sealed[:keep], TruncatedFrame, "truncated")


def test_trailing_bytes_are_tampering() -> None:
    """Bytes past the record's declared end are refused."""
    a, b = pair()
    _failed_with(b, a.seal(b"abc") + b"!", TamperedFrame, "1 bytes past its end")


def test_plaintext_frame_on_a_sealed_connection() -> None:
    """A plaintext wire frame where a sealed one belongs (a downgrade) is named as such."""
    _, b = pair()
    _failed_with(b, encode(verify_msg(0)), PlaintextFrame, "plaintext wire frame")


def test_frame_from_another_connection_is_tampering() -> None:
    """A frame sealed under another connection's keys does not open here."""
    a, _ = pair()
    other = SessionSealer(send_key=b"\x03" * 32, receive_key=b"\x04" * 32)
    _failed_with(other, a.seal(b"hi"), TamperedFrame, "fails authentication")


def test_keys_must_differ_per_direction() -> None:
    """One key for both directions would make reflection undetectable: refused."""
    with pytest.raises(ValueError, match="different keys"):
        SessionSealer(send_key=K1, receive_key=K1)
