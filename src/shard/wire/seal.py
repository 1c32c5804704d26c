"""The sealing seam: what a connection does to a frame after ``encode`` and before ``decode``.

A ``Sealer`` belongs to one connection. The secure implementation (ChaCha20-Poly1305 under
per-connection, per-direction keys with counter nonces, so replay, reorder and reflection are
detected) plugs in here without touching the frame format; ``PlainSealer`` is the identity,
for specs that say ``insecure`` and for tests.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Sealer(Protocol):
    """Protects frames on one connection; ``seal`` outgoing, ``open`` incoming, in order.

    ``open`` raises ``WireError`` when a sealed frame fails authentication (forged, replayed,
    reordered or reflected), which resets that one connection.
    """

    def seal(self, frame: bytes) -> bytes: ...

    def open(self, data: bytes) -> bytes: ...


class PlainSealer:
    """The identity sealer: frames go out and come in as they are (no secrecy, no integrity)."""

    def seal(self, frame: bytes) -> bytes:
        """Return ``frame`` unchanged."""
        return frame

    def open(self, data: bytes) -> bytes:
        """Return ``data`` unchanged; never fails."""
        return data

    def __repr__(self) -> str:
        return "PlainSealer()"
