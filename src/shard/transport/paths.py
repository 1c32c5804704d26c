"""Paths: more than one kind of connection on one listening address.

An ordinary connection is dialled to path ``/``: the dialer speaks first (it runs the dialer
side of the network's handshake, if any, then sends ``Hello``). Reaching nodes that accept no
inbound connection (``shard.transport.nat``) needs two more kinds, told apart by the path the
dialer asks for (the WebSocket resource; a string beside the connection on a memory network):

- a connection whose *listener* plays the dialer: a node behind NAT dials back a node that
  wants to reach it (``/reverse/TICKET``), and the listener then speaks first, as if it had
  dialled (``Sealed(handler, dialer=True)``);
- a raw pipe: the relay (``shard.transport.relayhub``) takes the bytes of whole messages on a
  connection (``/relay/TICKET``) and hands them to another, never opening or decoding them
  (``Piped``), so two nodes behind NAT run their handshake and sealed frames end to end
  through it.

A ``Router`` maps a path to one of those; a path it does not know is refused (HTTP 404 on a
WebSocket; the connection closed at once on a memory network). ``PathNetwork`` is a network
that can dial a path and serve a router: ``WebSocketNetwork``, ``SecureWebSocketNetwork`` and
``MemoryNetwork``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import attrs
import trio

from shard.transport.base import Connection, Handler, Network

#: What a pipe carries: one whole message as it crossed the transport (a WebSocket message's
#: bytes; a memory network's frame object).
Item = object


class Pipe(Protocol):
    """One connection seen as whole messages, undecoded (a relay's end of a relayed edge).

    ``receive`` returns the next message as it arrived; ``release`` says the relay is done with
    it (it goes back to the node's byte budget); ``send`` writes one message unchanged.
    Errors: ``TransportError`` (``ConnectionClosed`` when the peer went away)."""

    @property
    def peer(self) -> str: ...

    async def receive(self) -> Item: ...

    def release(self) -> None: ...

    async def send(self, item: Item) -> None: ...

    async def aclose(self) -> None: ...


@attrs.frozen
class Sealed:
    """Serve this path as a connection: run the network's handshake on it as ``dialer`` (True:
    this listener speaks first, as the dialer of the edge), then hand it to ``handler``."""

    handler: Handler
    dialer: bool


@attrs.frozen
class Piped:
    """Serve this path as a raw ``Pipe``: no handshake, nothing opened or decoded.

    ``ready``, when given, is awaited before the connection is accepted (on a WebSocket:
    before the upgrade is answered, within ``connect_timeout_s``): a relay holds the first
    end of an edge there until the second arrives, so a dialer's ``dial_path`` returns only
    once its peer is really at the other end. False: refused (HTTP 410)."""

    handler: Callable[[Pipe], Awaitable[None]]
    ready: Callable[[], Awaitable[bool]] | None = None


Route = Sealed | Piped
#: Path (``/reverse/ab12...``) -> how to serve it; None: refused.
Router = Callable[[str], Route | None]


@runtime_checkable
class PathNetwork(Network, Protocol):
    """A ``Network`` that can dial a path and serve a ``Router`` beside path ``/``."""

    async def dial_path(self, address: str, path: str, *, dialer: bool) -> Connection:
        """Dial ``path`` at ``address``; ``dialer`` says which side of the handshake this end
        runs (False: the listener speaks first). Errors: as ``dial``."""
        ...

    async def serve_paths(
        self,
        address: str,
        handler: Handler,
        router: Router,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As ``serve`` (``handler`` serves path ``/``), and ``router`` every other path."""
        ...


__all__ = ["Item", "PathNetwork", "Pipe", "Piped", "Route", "Router", "Sealed"]
