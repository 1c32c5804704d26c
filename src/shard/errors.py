"""Errors shared by layers that must not import each other.

``HandshakeError`` is raised by the ring's ``Hello``/``Welcome`` exchange
(``shard.transport.links``) and
by the secure wire's key exchange (``shard.trust.channel``, ``shard.trust.admission``), which runs
inside
the transport (``shard.transport.websocket`` refuses a peer when its handshake hook raises
one). It lives here, with no imports, so the transport can name it without importing
``shard.transport.links`` (which imports the transport). ``shard.transport.links.HandshakeError``
is the same
class.
"""

from __future__ import annotations


class HandshakeError(Exception):
    """A peer could not be admitted on a connection: wrong first words, another swarm or
    protocol, or (secure wire) a missing, foreign, expired, revoked or forged credential.

    ``str(err)`` says what happened and what to do; subclasses carry a short ``reason`` code.
    """

    reason: str = "handshake"
