"""The side behind NAT: a node that accepts no inbound connection stays registered at the
relay and dials out whenever someone wants a connection to it (``shard.transport.nat``).

``Callee.run`` keeps one signalling link open to the relay (path ``/signal``,
``Hello(link="callee")``), re-dialling it with backoff (up to 2 s) whenever it drops, with
heartbeats both ways every ``SIGNAL_HEARTBEAT_S`` and a cut after ``SIGNAL_DEAD_AFTER_S`` of
silence (which also keeps the NAT mapping alive). For each ``CallMe`` it dials what the call
asks — the caller's ``back`` address at ``/reverse/TICKET``, or the relay at
``/relay/TICKET`` — as the *listening* side of the handshake (``dialer=False``), and serves
the connection with the node's ordinary handler: to the node's actors it is one more inbound
connection. A malformed call (ticket, address) is ignored, and at most ``MAX_ANSWERING``
calls are dialled at once, so a hostile relay cannot make a callee dial garbage or pile up
tasks.

Cancellation: ``run`` until cancelled; the connections it dialled for calls live in the
nursery it is given (the serving network's). Errors: connection errors end only the link or
the call they happen on (logged); bugs propagate.
"""

from __future__ import annotations

import logging
from typing import Final

import trio

from shard.errors import HandshakeError
from shard.messages import CallMe, Heartbeat, Hello, NodeName
from shard.transport.base import Connection, Handler, TransportError, abandon, split_address
from shard.transport.guard import (
    ProtocolViolation,
    connection_failure,
    receive_within,
    send_within,
    serve_one,
)
from shard.transport.links import shake_hands
from shard.transport.paths import PathNetwork
from shard.transport.relayhub import (
    RELAY_PREFIX,
    REVERSE_PREFIX,
    SIGNAL_DEAD_AFTER_S,
    SIGNAL_HEARTBEAT_S,
    SIGNAL_PATH,
    valid_ticket,
)
from shard.wire import WireError

log = logging.getLogger("shard.transport")

#: Calls a callee dials at once; more are dropped (their callers time out and retry).
MAX_ANSWERING: Final = 16


async def open_signal(inner: PathNetwork, relay: str, hello: Hello, timeout_s: float) -> Connection:
    """A signalling link to ``relay``, its Hello/Welcome done.

    Errors: ``TransportError`` (a garbled answer too), ``HandshakeError``."""
    conn = await inner.dial_path(relay, SIGNAL_PATH, dialer=True)
    try:
        return await shake_hands(conn, hello, relay, timeout_s=timeout_s)
    except WireError as exc:
        raise TransportError(f"relay {relay}: {exc}") from None


class Callee:
    """Node ``node``'s registration at ``relay`` and its answers to calls (see the module
    docstring). ``registered`` and ``answered`` are snapshot reads."""

    def __init__(
        self,
        inner: PathNetwork,
        *,
        node: NodeName,
        role: str,
        swarm: str,
        relay: str,
        handshake_timeout_s: float,
    ) -> None:
        self._inner = inner
        self._hello = Hello(node=node, role=role, swarm=swarm, link="callee")
        self._node = node
        self._relay = relay
        self._handshake_timeout_s = handshake_timeout_s
        self._answering = 0
        self.answered = 0
        self.registered = False
        self._first = trio.Event()  # registered at least once

    async def wait_registered(self) -> None:
        """Until the signalling link to the relay was opened once."""
        await self._first.wait()

    async def run(self, handler: Handler, nursery: trio.Nursery) -> None:
        """Stay registered and answer calls, serving each call's connection with ``handler``
        in ``nursery``."""
        delay = 0.05
        while True:
            try:
                conn = await open_signal(
                    self._inner, self._relay, self._hello, self._handshake_timeout_s
                )
            except (TransportError, HandshakeError) as exc:
                log.info("%s: relay %s not reachable yet: %s", self._node, self._relay, exc)
                await trio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.05
            self.registered = True
            self._first.set()
            try:
                await self._take_calls(conn, handler, nursery)
            except BaseException as exc:
                failure = connection_failure(exc)
                if failure is None:
                    raise
                log.warning("%s: link to relay %s lost: %s", self._node, self._relay, failure)
            finally:
                self.registered = False
                await abandon(conn)

    async def _take_calls(self, conn: Connection, handler: Handler, nursery: trio.Nursery) -> None:
        async with trio.open_nursery() as beats:
            beats.start_soon(self._heartbeats, conn)
            while True:
                msg = await receive_within(conn, SIGNAL_DEAD_AFTER_S, what="relay")
                if isinstance(msg, CallMe):
                    self._answer_soon(msg, handler, nursery)
                elif not isinstance(msg, Heartbeat):
                    raise ProtocolViolation(f"the relay sent {type(msg).__name__} on a callee link")

    async def _heartbeats(self, conn: Connection) -> None:
        while True:
            await trio.sleep(SIGNAL_HEARTBEAT_S)
            beat = Heartbeat(node=self._node, sent_at=0.0)
            await send_within(conn, beat, SIGNAL_DEAD_AFTER_S, what="relay")

    def _answer_soon(self, call: CallMe, handler: Handler, nursery: trio.Nursery) -> None:
        if not valid_ticket(call.ticket):
            log.warning("%s: ignored a call with a malformed ticket", self._node)
            return
        if call.back:
            try:
                split_address(call.back)
            except ValueError as exc:
                log.warning("%s: ignored a call from %s: %s", self._node, call.caller, exc)
                return
        if self._answering >= MAX_ANSWERING:
            log.warning(
                "%s: %d calls in progress; dropped %s's", self._node, MAX_ANSWERING, call.caller
            )
            return
        self._answering += 1  # counted now: a burst of calls cannot start more than the cap
        nursery.start_soon(self._answer, call, handler)

    async def _answer(self, call: CallMe, handler: Handler) -> None:
        """Dial what ``call`` asks for and serve it as an inbound connection."""
        address = call.back or self._relay
        prefix = REVERSE_PREFIX if call.back else RELAY_PREFIX
        try:
            conn = await self._inner.dial_path(address, f"{prefix}{call.ticket}", dialer=False)
        except (TransportError, HandshakeError) as exc:
            log.warning(
                "%s: could not answer %s's call at %s: %s", self._node, call.caller, address, exc
            )
            return
        finally:
            self._answering -= 1
        self.answered += 1
        how = f"dialled it back at {address}" if call.back else f"met it at relay {address}"
        log.info("%s: answered %s's call: %s", self._node, call.caller, how)
        await serve_one(conn, handler, what=f"connection for {call.caller}")
