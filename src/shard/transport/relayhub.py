"""``RelayHub``: the relay role — signalling for nodes behind NAT, and the pipe between two of
them when neither accepts an inbound connection.

It serves two paths on its node's listening address (``shard.transport.paths``):

- ``/signal`` — an ordinary connection (the network's own handshake: on the sealed wire only
  admitted swarm members get past it), whose ``Hello`` says ``link="callee"`` or
  ``"caller"``. A callee (a node with ``reachable = false``) keeps its link open; the hub
  sends it ``CallMe`` for each ``CallRequest`` a caller sends naming it, and heartbeats both
  ways keep the link (and its NAT mapping) alive. A caller gets ``CallPlaced`` or a ``Fault``
  of kind ``relay`` saying why not (the target is not registered, the hub is full, a
  malformed request).
- ``/relay/TICKET`` — accepted only for a ticket a ``CallRequest`` without ``back`` placed
  within ``pair_timeout_s``, at most twice: the first end waits (unanswered) for the second,
  then both are accepted and every message is carried from one to the other unchanged,
  never opened or decoded. On the sealed wire the two ends' handshake and every sealed
  record cross the hub end to end, so it sees only ciphertext, and a byte it changed fails
  the receiver's authentication (the connection is reset; the ring relinks).

Who may use it: on the sealed wire, only swarm members (the handshake on ``/signal``; a
ticket is random, 128 bits, single use, and only ever travels over sealed signalling links).
On the plain wire (``insecure = true``) anyone who can reach it, as for every other link.
Names are not bound to tokens (docs/security.md): an admitted member could register under
another node's name.

Hostile input never ends the node: a malformed or out-of-turn message, a silent link, an
unknown, expired or spent ticket, or an end that never pairs ends only that connection
(logged), and every table the hub keeps is bounded (``max_tickets``; one link per callee).

Cancellation: every link and pipe lives in the serving network's nursery. Errors: connection
errors only, caught by the network's guard (``serve_one`` / ``serve_pipe``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from functools import partial
from typing import Final

import attrs
import trio

from shard.messages import (
    HANDSHAKE_TIMEOUT_S,
    CallMe,
    CallPlaced,
    CallRequest,
    Fault,
    Heartbeat,
    Message,
    NodeName,
    Welcome,
)
from shard.transport.base import Connection, TransportError, split_address
from shard.transport.guard import PeerTooSlow, ProtocolViolation, receive_within, send_within
from shard.transport.links import accept_peer
from shard.transport.paths import Item, Pipe, Piped, Route, Sealed

log = logging.getLogger("shard.transport")

TICKET: Final = re.compile(r"[0-9a-f]{32}")
SIGNAL_PATH: Final = "/signal"
RELAY_PREFIX: Final = "/relay/"
REVERSE_PREFIX: Final = "/reverse/"
#: A signalling link's heartbeat, and the silence after which it is cut (both ends).
SIGNAL_HEARTBEAT_S: Final = 2.0
SIGNAL_DEAD_AFTER_S: Final = 10.0
#: ``CallMe`` waiting for one callee's link before the hub answers "busy".
_CALLS_BUFFER: Final = 16


class CallRefused(Exception):
    """The hub cannot place a call; the message says why (sent to the caller as a Fault)."""


@attrs.frozen
class HubStatistics:
    callees: tuple[NodeName, ...]  # registered now
    calls: int  # placed
    refused: int  # calls refused
    pairs: int  # relayed edges paired
    open_pairs: int
    forwarded: int  # messages carried, both directions, all pairs


@attrs.define
class _Callee:
    calls: trio.MemorySendChannel[CallMe]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


@attrs.define(eq=False)
class _Pair:
    """One relayed edge being formed: its two ends meet here."""

    expires: float
    arrived: int = 0
    pipes: list[Pipe] = attrs.field(factory=list)
    both: trio.Event = attrs.field(factory=trio.Event)  # both ends arrived
    spliced: trio.Event = attrs.field(factory=trio.Event)  # both accepted: being carried
    done: trio.Event = attrs.field(factory=trio.Event)


def valid_ticket(ticket: str) -> bool:
    return TICKET.fullmatch(ticket) is not None


class RelayHub:
    """The relay role of node ``node`` (see the module docstring). ``route`` is its part of
    the node's ``Router``; ``place`` places a call for a caller in this same process.

    ``role`` is the role this node's token admits (its ``Welcome`` on ``/signal`` says it).
    """

    def __init__(
        self,
        node: NodeName,
        swarm: str,
        role: str,
        *,
        pair_timeout_s: float = 8.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_tickets: int = 256,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._node = node
        self._welcome = Welcome(node=node, role=role, swarm=swarm)
        self._pair_timeout_s = pair_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._max_tickets = max_tickets
        self._clock = clock
        self._callees: dict[NodeName, _Callee] = {}
        self._registered = trio.Event()  # set (and replaced) whenever a callee registers
        self._tickets: dict[str, _Pair] = {}
        self._calls = self._refused = self._pairs = self._open_pairs = self._forwarded = 0

    def statistics(self) -> HubStatistics:
        return HubStatistics(
            tuple(sorted(self._callees)),
            self._calls,
            self._refused,
            self._pairs,
            self._open_pairs,
            self._forwarded,
        )

    async def wait_registered(self, node: NodeName) -> None:
        """Return once ``node`` has a signalling link registered here."""
        while node not in self._callees:
            await self._registered.wait()

    def route(self, path: str) -> Route | None:
        """How this hub serves ``path`` (None: not one of its paths, or a spent ticket)."""
        if path == SIGNAL_PATH:
            return Sealed(self.serve_signal, dialer=False)
        if not path.startswith(RELAY_PREFIX):
            return None
        ticket = path[len(RELAY_PREFIX) :]
        pair = self._tickets.get(ticket)
        if pair is None or pair.arrived >= 2 or pair.expires <= self._clock():
            log.info(
                "relay %s: refused %s: unknown, expired or spent ticket", self._node, path[:60]
            )
            return None
        pair.arrived += 1
        if pair.arrived == 2:
            del self._tickets[ticket]  # single use
        return Piped(partial(self._pipe, pair), ready=partial(self._meet, pair))

    def place(self, caller: NodeName, request: CallRequest) -> None:
        """Pass ``request`` (from ``caller``) on to its target's link as ``CallMe``.

        Errors: ``CallRefused`` saying why (malformed, target not registered, full)."""
        try:
            self._place(caller, request)
        except CallRefused:
            self._refused += 1
            raise
        self._calls += 1

    def _place(self, caller: NodeName, request: CallRequest) -> None:
        if not valid_ticket(request.ticket):
            raise CallRefused("a ticket is 32 lowercase hex digits")
        if request.back:
            try:
                split_address(request.back)
            except ValueError as exc:
                raise CallRefused(f"back: {exc}") from None
        callee = self._callees.get(request.target)
        if callee is None:
            raise CallRefused(
                f"{request.target} is not registered at relay {self._node} (not started yet, "
                "or not a reachable = false node of this swarm)"
            )
        if not request.back:
            self._purge()
            if request.ticket in self._tickets:
                raise CallRefused("ticket already in use")
            if len(self._tickets) >= self._max_tickets:
                raise CallRefused(f"relay {self._node} is pairing {self._max_tickets} edges; retry")
            self._tickets[request.ticket] = _Pair(self._clock() + self._pair_timeout_s)
        try:
            callee.calls.send_nowait(CallMe(caller, request.ticket, request.back))
        except trio.WouldBlock:
            self._tickets.pop(request.ticket, None)
            raise CallRefused(
                f"{request.target} has {_CALLS_BUFFER} calls waiting; retry"
            ) from None

    def _purge(self) -> None:
        now = self._clock()
        for ticket in [t for t, pair in self._tickets.items() if pair.expires <= now]:
            del self._tickets[ticket]

    # --- /signal ------------------------------------------------------------------------------

    async def serve_signal(self, conn: Connection) -> None:
        """One signalling link: a callee's (held open) or a caller's (one request).

        Errors: connection errors only (``PeerTooSlow``, ``ProtocolViolation``, ...)."""
        try:
            hello = await accept_peer(conn, self._welcome, timeout_s=self._handshake_timeout_s)
        except trio.TooSlowError:
            raise PeerTooSlow(f"relay: no Hello from {conn.peer} in time") from None
        if hello.link == "callee":
            await self._serve_callee(conn, hello.node)
        elif hello.link == "caller":
            await self._serve_caller(conn, hello.node)
        else:
            raise ProtocolViolation(f"link {hello.link[:40]!r} on the relay's signalling path")

    async def _serve_caller(self, conn: Connection, caller: NodeName) -> None:
        msg = await receive_within(conn, self._handshake_timeout_s, what="relay caller")
        if not isinstance(msg, CallRequest):
            raise ProtocolViolation(f"expected CallRequest, got {type(msg).__name__}")
        reply: Message
        try:
            self.place(caller, msg)
            reply = CallPlaced(msg.ticket)
        except CallRefused as exc:
            log.info("relay %s: refused a call from %s: %s", self._node, caller, exc)
            reply = Fault(node=self._node, kind="relay", detail=str(exc))
        await send_within(conn, reply, self._handshake_timeout_s, what="relay caller")

    async def _serve_callee(self, conn: Connection, node: NodeName) -> None:
        calls_send, calls_recv = trio.open_memory_channel[CallMe](_CALLS_BUFFER)
        old = self._callees.get(node)
        if old is not None:  # it reconnected (its old link may be dead and not yet noticed)
            old.scope.cancel()
        callee = _Callee(calls_send)
        self._callees[node] = callee
        self._registered.set()
        self._registered = trio.Event()
        log.info("relay %s: %s registered from %s", self._node, node, conn.peer)
        try:
            with callee.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._feed, conn, calls_recv)
                    await self._watch(conn)
        finally:
            if self._callees.get(node) is callee:
                del self._callees[node]
            calls_send.close()
        if callee.scope.cancelled_caught:
            log.info("relay %s: %s's older link replaced", self._node, node)

    async def _feed(self, conn: Connection, calls: trio.MemoryReceiveChannel[CallMe]) -> None:
        """Send each call, and a heartbeat whenever the link has been quiet a while."""
        async with calls:
            while True:
                msg: Message = Heartbeat(node=self._node, sent_at=0.0)
                with trio.move_on_after(SIGNAL_HEARTBEAT_S):
                    msg = await calls.receive()
                await send_within(conn, msg, SIGNAL_DEAD_AFTER_S, what="relay callee")

    async def _watch(self, conn: Connection) -> None:
        """Read the callee's heartbeats until it goes silent, closes, or misbehaves."""
        while True:
            msg = await receive_within(conn, SIGNAL_DEAD_AFTER_S, what="relay callee")
            if not isinstance(msg, Heartbeat):
                raise ProtocolViolation(f"a callee sends only heartbeats, not {type(msg).__name__}")

    # --- /relay/TICKET --------------------------------------------------------------------------

    async def _meet(self, pair: _Pair) -> bool:
        """Hold an end until both have arrived (or the ticket expires): True when paired."""
        if pair.arrived >= 2:
            pair.both.set()
        with trio.move_on_at(pair.expires):
            await pair.both.wait()
        return pair.both.is_set()

    async def _pipe(self, pair: _Pair, pipe: Pipe) -> None:
        """Both ends were accepted: the second to get here carries messages both ways."""
        pair.pipes.append(pipe)
        if len(pair.pipes) == 1:
            with trio.move_on_after(self._pair_timeout_s):  # the other's accept may fail
                await pair.spliced.wait()
            if pair.spliced.is_set():
                await pair.done.wait()  # held open as long as the other end carries it
            return
        pair.spliced.set()
        first, second = pair.pipes
        self._pairs += 1
        self._open_pairs += 1
        log.info("relay %s: relaying %s <-> %s", self._node, first.peer, second.peer)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._forward, first, second, nursery.cancel_scope, 0)
                nursery.start_soon(self._forward, second, first, nursery.cancel_scope, 1)
        finally:
            self._open_pairs -= 1
            pair.done.set()

    async def _forward(self, src: Pipe, dst: Pipe, scope: trio.CancelScope, way: int) -> None:
        """Carry every message from ``src`` to ``dst`` until either end goes; then both go."""
        n = 0
        try:
            while True:
                item = await src.receive()
                try:
                    await dst.send(self.carry(item, way, n))
                finally:
                    src.release()
                n += 1
                self._forwarded += 1
        except TransportError as exc:
            log.info("relay %s: %s -> %s ended: %s", self._node, src.peer, dst.peer, exc)
        finally:
            scope.cancel()

    def carry(self, item: Item, way: int, n: int) -> Item:
        """What goes on for message ``n`` of direction ``way`` (0: first end to second): the
        message itself. The one seam of the relay: a test's tampering relay
        (``shard.testing.nat.TamperingHub``) changes bytes here."""
        return item


__all__ = [
    "RELAY_PREFIX",
    "REVERSE_PREFIX",
    "SIGNAL_PATH",
    "CallRefused",
    "HubStatistics",
    "RelayHub",
    "valid_ticket",
]
