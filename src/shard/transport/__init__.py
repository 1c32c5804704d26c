"""Transports: how actors reach each other, in this process or across the internet.

One interface, three implementations, one relay::

    base.py        Connection and Network (the interface), TransportError, ConnectionClosed;
                   NetworkBase / HostedNetwork, the `async with network:` lifecycle they share
    guard.py       serve_one: a connection's errors end that connection, never the node;
                   the idle and per-message deadlines applied to peers
    memory.py      MemoryNetwork: peers in one process over memory channels (optionally
                   passing every message through the wire codec)
    websocket.py   WebSocketNetwork: peers in other processes; sealed wire frames over
                   trio-websocket (wsconnection.py: one connection; budget.py: the bytes a
                   node buffers, all connections together; perhost.py: the connections
                   served per remote host, capped, the idle one reclaimed)
    delay.py       DelayNetwork: wraps any network, adds one-way latency and a bandwidth cap
                   per edge, in Trio time (virtual under MockClock)
    relay.py       DelayRelay: a delaying TCP relay between real processes
                   (WAN emulation without privileges; `shard relay`)
    paths.py       PathNetwork: more than one kind of connection on one address (a served
                   connection whose listener speaks first; a raw pipe of whole messages)
    nat.py         NatNetwork: reaching nodes that accept no inbound connection (nat:NAME),
                   by a callback or through the relay (callee.py: the side behind NAT;
                   relayhub.py: RelayHub, the relay role)
    links.py       the Hello/Welcome handshake on every connection, and the pump from a
                   connection to an actor
    secure.py      SecureWebSocketNetwork: every connection authenticated and sealed
    mirror.py      MirrorNetwork: wraps a node's network and copies every ring chunk it
                   sends or receives to a sink (the audits' view of a stage's traffic)

An actor gets a ``Connection`` and sends and receives typed messages; the composition root
picks the ``Network``. Open a network with ``async with network:`` before dialing.
"""

from shard.transport.base import (
    Connection,
    ConnectionClosed,
    ConnectionStatistics,
    Handler,
    ListenError,
    Network,
    TransportError,
    abandon,
)
from shard.transport.delay import DelayedConnection, DelayNetwork
from shard.transport.memory import MemoryConnection, MemoryNetwork
from shard.transport.relay import DelayRelay, RelayStatistics
from shard.transport.websocket import WebSocketConnection, WebSocketNetwork

__all__ = [
    "Connection",
    "ConnectionClosed",
    "ConnectionStatistics",
    "DelayNetwork",
    "DelayRelay",
    "DelayedConnection",
    "Handler",
    "ListenError",
    "MemoryConnection",
    "MemoryNetwork",
    "Network",
    "RelayStatistics",
    "TransportError",
    "WebSocketConnection",
    "WebSocketNetwork",
    "abandon",
]
