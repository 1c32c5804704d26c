"""``SessionSealer``: the secure wire's per-connection frame protection (a ``shard.wire.Sealer``).

Each direction of a connection has its own 32-byte key (derived by the handshake,
``shard.trust.channel``) and its own 64-bit counter starting at 0. A sealed record is::

    0x81 | counter (u64 BE) | length (u32 BE) | ChaCha20-Poly1305(frame) | tag (16)

with the IETF nonce ``0x00000000 || counter`` and the 13-byte record header as associated
data, so the counter and the length cannot be altered without failing authentication.
``open`` accepts exactly the next counter: a replayed, reordered, dropped, reflected (sealed
with this side's own sending key), truncated or tampered record raises its own ``SealError``
(a ``WireError``), after which the sealer refuses everything: the connection is reset.

Pure and synchronous; a connection seals and writes under one lock so counters go out in order.
"""

from __future__ import annotations

import struct
from typing import Final

import nacl.bindings
import nacl.exceptions

from shard.trust.admission import Admitted
from shard.wire import WIRE_VERSION, WireError

RECORD_VERSION: Final = 0x81
HEADER: Final = struct.Struct(">BQI")
TAG_BYTES: Final = nacl.bindings.crypto_aead_chacha20poly1305_ietf_ABYTES
#: Bytes a sealed record adds to a frame.
OVERHEAD: Final = HEADER.size + TAG_BYTES
KEY_BYTES: Final = 32
_MAX_COUNTER: Final = (1 << 64) - 1


class SealError(WireError):
    """A sealed record was refused; ``reason`` says why. The connection must be reset."""

    reason = "sealed"


class TruncatedFrame(SealError):
    """The record is shorter than its header says: cut off in transit or by an attacker."""

    reason = "truncated"


class TamperedFrame(SealError):
    """Authentication failed: the record was altered, forged, or is not a sealed record."""

    reason = "tampered"


class ReplayedFrame(SealError):
    """An authentic record whose counter was already received."""

    reason = "replayed"


class ReorderedFrame(SealError):
    """An authentic record from further ahead: earlier ones were dropped or reordered."""

    reason = "reordered"


class ReflectedFrame(SealError):
    """A record this side sealed itself, sent back to it."""

    reason = "reflected"


class PlaintextFrame(SealError):
    """A plaintext wire frame where a sealed record was expected (a downgraded peer)."""

    reason = "plaintext"


def _nonce(counter: int) -> bytes:
    return b"\x00\x00\x00\x00" + counter.to_bytes(8, "big")


class SessionSealer:
    """Seals outgoing and opens incoming frames of one connection.

    ``peer`` is who the handshake authenticated on the other end (``None`` in unit tests).
    """

    def __init__(self, *, send_key: bytes, receive_key: bytes, peer: Admitted | None = None):
        if len(send_key) != KEY_BYTES or len(receive_key) != KEY_BYTES:
            raise ValueError(f"sealer keys are {KEY_BYTES} bytes")
        if send_key == receive_key:
            raise ValueError("the two directions must have different keys")
        self._send_key = send_key
        self._receive_key = receive_key
        self._sent = 0
        self._expected = 0
        self._failed: SealError | None = None
        self.peer = peer

    def __repr__(self) -> str:
        return f"SessionSealer(sent={self._sent}, received={self._expected}, peer={self.peer!r})"

    def seal(self, frame: bytes) -> bytes:
        """Encrypt and authenticate ``frame`` under the next sending counter.

        Errors: ``WireError`` if the 2**64 counters of this connection are used up.
        """
        if self._sent == _MAX_COUNTER:
            raise WireError("sealed frame: counter exhausted; reconnect to get fresh keys")
        header = HEADER.pack(RECORD_VERSION, self._sent, len(frame))
        sealed = nacl.bindings.crypto_aead_chacha20poly1305_ietf_encrypt(
            frame, header, _nonce(self._sent), self._send_key
        )
        self._sent += 1
        return header + sealed

    def open(self, data: bytes) -> bytes:
        """Authenticate and decrypt the next record; return the frame.

        Errors: a ``SealError`` subclass naming the reason; every later call raises too.
        """
        if self._failed is not None:
            raise SealError(f"sealed frame: connection already failed ({self._failed.reason})")
        try:
            return self._open(data)
        except SealError as exc:
            self._failed = exc
            raise

    def _open(self, data: bytes) -> bytes:
        if len(data) < HEADER.size:
            if data[:1] == bytes([WIRE_VERSION]):
                raise PlaintextFrame(_plaintext(len(data)))
            raise TruncatedFrame(
                f"sealed frame: truncated: {len(data)} bytes, a record has at least {OVERHEAD}"
            )
        version, counter, length = HEADER.unpack_from(data)
        if version != RECORD_VERSION:
            if version == WIRE_VERSION:
                raise PlaintextFrame(_plaintext(len(data)))
            raise TamperedFrame(f"sealed frame: tampered: unknown record version {version:#x}")
        if len(data) < OVERHEAD + length:
            raise TruncatedFrame(
                f"sealed frame: truncated: header says {OVERHEAD + length} bytes, got {len(data)}"
            )
        if len(data) > OVERHEAD + length:
            raise TamperedFrame(
                f"sealed frame: tampered: {len(data) - OVERHEAD - length} bytes past its end"
            )
        header, body = data[: HEADER.size], data[HEADER.size :]
        frame = _decrypt(body, header, counter, self._receive_key)
        if frame is None:
            if _decrypt(body, header, counter, self._send_key) is not None:
                raise ReflectedFrame(
                    f"sealed frame: reflected: counter {counter} was sealed by this side and "
                    "sent back to it"
                )
            raise TamperedFrame(
                f"sealed frame: tampered: counter {counter} fails authentication "
                "(altered in transit, forged, or sealed under other keys)"
            )
        self._check_counter(counter)
        return frame

    def _check_counter(self, counter: int) -> None:
        expected = self._expected
        if counter < expected:
            raise ReplayedFrame(
                f"sealed frame: replayed: counter {counter} was already received "
                f"(expected {expected})"
            )
        if counter > expected:
            raise ReorderedFrame(
                f"sealed frame: reordered: counter {counter} arrived while {expected} was "
                f"expected ({counter - expected} earlier frame(s) missing or out of order)"
            )
        self._expected += 1


def _decrypt(body: bytes, header: bytes, counter: int, key: bytes) -> bytes | None:
    try:
        frame: bytes = nacl.bindings.crypto_aead_chacha20poly1305_ietf_decrypt(
            body, header, _nonce(counter), key
        )
    except nacl.exceptions.CryptoError:
        return None
    return frame


def _plaintext(size: int) -> str:
    return (
        f"sealed frame: plaintext: a {size}-byte plaintext wire frame on a secure connection "
        "(the peer dropped to insecure mode); refused"
    )
