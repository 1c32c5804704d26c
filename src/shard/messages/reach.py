"""Messages of the relay's signalling link (``shard.transport.nat``, ``shard.transport.relayhub``):
how a node asks for a connection to a node that accepts no inbound connection.

A node behind NAT keeps one link open to the swarm's relay (``Hello(link="callee")``); a node
that wants to reach it opens a short link (``Hello(link="caller")``) and sends a
``CallRequest``; the relay passes it on as ``CallMe`` and answers ``CallPlaced`` (or a
``Fault`` of kind ``relay`` saying why not). The callee then dials: the caller's address
(``back``) when the caller accepts inbound connections, else the relay, which pairs the two
connections by ``ticket``.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName


@attrs.frozen
class CallRequest:
    """Caller -> relay: have ``target`` dial back. ``back`` is the caller's own reachable
    address (the target dials it there, path ``/reverse/TICKET``), or "" when the caller
    accepts no inbound connection either (both dial the relay, path ``/relay/TICKET``).
    ``ticket`` is 32 lowercase hex digits, fresh per call."""

    target: NodeName
    ticket: str
    back: str = ""


@attrs.frozen
class CallMe:
    """Relay -> callee: ``caller`` wants a connection: dial ``back`` (or, when "", the relay)
    at path ``/reverse/TICKET`` (``/relay/TICKET``), then serve it as any inbound connection."""

    caller: NodeName
    ticket: str
    back: str = ""


@attrs.frozen
class CallPlaced:
    """Relay -> caller: ``CallMe`` for ``ticket`` is on its way to the target."""

    ticket: str
