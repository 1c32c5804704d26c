"""The wire's one error type.

Every malformed, forged or oversize frame raises ``WireError`` (never a msgpack, cattrs, zstd or
struct exception), so a connection can catch exactly one type, reset itself and carry on.
"""

from __future__ import annotations


class WireError(Exception):
    """A frame could not be encoded or decoded; ``str(err)`` is a short reason.

    The reason names the section that failed (``frame``, ``header``, ``tensor N``, ``payload``,
    ``message``) so an operator can tell a version mismatch from a corrupt link or a hostile
    peer. The usual response is to drop the one connection it arrived on.
    """
