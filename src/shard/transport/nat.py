"""``NatNetwork``: who dials an edge is independent of which way its data flows.

A node that accepts no inbound connection (``reachable = false`` in the spec: behind a home
router's NAT) is known to everyone by the address ``nat:NAME`` instead of ``host:port``. Its
network keeps one signalling link open to the swarm's relay (``shard.transport.relayhub``;
the coordinator by default), and a node that dials ``nat:NAME`` gets its connection in one of
two ways, decided by ``route_to`` (pure):

==========================  =================================================================
the dialer accepts inbound  ``Callback``: it asks the relay to have NAME dial it back (path
                            ``/reverse/TICKET`` on its own listener); NAME connects out to it,
                            and the dialer then uses that connection exactly as if it had
                            dialled it: it runs the dialer's side of the handshake and sends
                            ``Hello``, and its ring traffic flows down it.
neither accepts inbound     ``Relayed``: both dial the relay (path ``/relay/TICKET``), which
                            pairs the two connections and carries whole messages between them
                            unopened; the handshake and the sealed frames run end to end.
==========================  =================================================================

Any other address is dialled directly (``Direct``), as by the inner network. So every actor
above (ring links, the coordinator's link to stage 0, probes, rewires after a failover)
keeps calling ``dial(address)`` and never knows which way the connection was made; a
connection lost on a called-back or relayed edge is re-dialled the same way (the callee
dials again, for a fresh ticket), by the same supervision as a direct edge.

The callee side: ``serve`` (a node with ``reachable = false``) listens as usual (its LAN may
reach it) and runs a ``Callee`` (``shard.transport.callee``): registered at the relay, it
dials out for each call and serves what it dialled with the ordinary handler — to its actors
it is one more inbound connection. It reports ``nat:NAME`` as its bound address, so that is
what it registers with the scheduler.

**On demand** (``on_demand``: a node started with ``--join``, whose reachability the scheduler
detects): the network starts out reachable, serving its listen address (and reporting it as
bound) so others' probes can try it; ``behind_nat`` — called when the scheduler's ``Activate``
says nobody reached it — turns it into a ``reachable = false`` node from then on: it opens its
signalling link to the relay (returning once it is open) and dials ``nat:`` addresses through
the relay. It never turns back (a process restart does).

Cancellation: as the inner network's; the signalling link and the connections dialled for
calls live in ``serve``'s nursery. Errors: ``dial`` raises ``TransportError`` when the relay
refuses or cannot be reached, or the callee does not dial back within ``call_timeout_s``
(``links.dial_peer`` retries those); ``HandshakeError`` as the inner network's.
"""

from __future__ import annotations

import logging
import secrets
from functools import partial
from typing import Final, Protocol, runtime_checkable

import attrs
import trio

from shard.messages import (
    HANDSHAKE_TIMEOUT_S,
    CallPlaced,
    CallRequest,
    Fault,
    Hello,
    Message,
    NodeName,
)
from shard.transport.base import (
    Connection,
    Handler,
    NetworkBase,
    TransportError,
    abandon,
)
from shard.transport.callee import Callee, open_signal
from shard.transport.guard import (
    receive_within,
    send_within,
)
from shard.transport.paths import PathNetwork, Route, Sealed
from shard.transport.relayhub import (
    REVERSE_PREFIX,
    CallRefused,
    RelayHub,
)
from shard.wire import WireError

log = logging.getLogger("shard.transport")

NAT_PREFIX: Final = "nat:"


def nat_address(node: str) -> str:
    """The address everyone dials to reach ``node``, which accepts no inbound connection."""
    return f"{NAT_PREFIX}{node}"


@attrs.frozen
class Direct:
    """Dial ``address`` itself."""

    address: str


@attrs.frozen
class Callback:
    """Ask ``target`` (through the relay) to dial this node back."""

    target: NodeName


@attrs.frozen
class Relayed:
    """Meet ``target`` at the relay."""

    target: NodeName


EdgeRoute = Direct | Callback | Relayed


@runtime_checkable
class BehindNat(Protocol):
    """A network that can be told, at run time, that its node accepts no inbound connection
    (``NatNetwork`` on demand; wrappers pass it on)."""

    async def behind_nat(self, *, timeout_s: float) -> None: ...


def route_to(address: str, *, reachable: bool) -> EdgeRoute:
    """How a node that does (``reachable``) or does not accept inbound connections reaches
    ``address``: directly, by a callback, or through the relay."""
    if not address.startswith(NAT_PREFIX):
        return Direct(address)
    target = NodeName(address[len(NAT_PREFIX) :])
    return Callback(target) if reachable else Relayed(target)


@attrs.frozen
class NatStatistics:
    """Edges dialled each way, calls this node answered, and whether it is registered at
    the relay now (a ``reachable = false`` node)."""

    direct: int
    callbacks: int
    relayed: int
    answered: int
    registered: bool


class HandedConnection:
    """A connection a callee dialled to us, handed to the ``dial`` that asked for it; the
    listener that accepted it keeps it until this one is closed."""

    def __init__(self, inner: Connection) -> None:
        self._inner = inner
        self._peer = f"{inner.peer} (dialled back)"
        self.closed = trio.Event()

    @property
    def peer(self) -> str:
        return self._peer

    async def send(self, msg: Message) -> None:
        await self._inner.send(msg)

    async def receive(self) -> Message:
        return await self._inner.receive()

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self.closed.set()


class NatNetwork(NetworkBase):
    """``inner`` plus the routes above. ``advertise`` is this node's own address as others
    dial it: its ``host:port`` (it accepts inbound connections), or ``nat:NAME``. ``relay``
    is the relay's ``host:port``; ``hub`` the relay role when this node holds it.
    ``owns_inner``: opening this network opens ``inner`` too.
    """

    def __init__(
        self,
        inner: PathNetwork,
        *,
        node: NodeName,
        role: str,
        swarm: str,
        advertise: str,
        relay: str,
        hub: RelayHub | None = None,
        owns_inner: bool = False,
        call_timeout_s: float = 10.0,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        on_demand: bool = False,
    ) -> None:
        self._inner = inner
        self._node = node
        self._role = role
        self._swarm = swarm
        self._advertise = advertise
        self._reachable = not advertise.startswith(NAT_PREFIX)
        self._relay = relay
        self._hub = hub
        self._owns_inner = owns_inner
        self._call_timeout_s = call_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._on_demand = on_demand and self._reachable
        self._told = trio.Event()  # behind_nat was called (on demand)
        self._pending: dict[str, trio.MemorySendChannel[HandedConnection]] = {}
        self._direct = self._callbacks = self._relayed = 0
        self._callee = Callee(
            inner,
            node=node,
            role=role,
            swarm=swarm,
            relay=relay,
            handshake_timeout_s=handshake_timeout_s,
        )

    def __repr__(self) -> str:
        return (
            f"NatNetwork({self._node} as {self._advertise}, relay {self._relay}, {self._inner!r})"
        )

    @property
    def hub(self) -> RelayHub | None:
        return self._hub

    def statistics(self) -> NatStatistics:
        return NatStatistics(
            self._direct,
            self._callbacks,
            self._relayed,
            self._callee.answered,
            self._callee.registered,
        )

    async def _enter(self) -> None:
        if self._owns_inner:
            await self._inner.__aenter__()

    async def _exit(self, exc: BaseException | None) -> None:
        if self._owns_inner:
            await self._inner.__aexit__(type(exc) if exc else None, exc, None)

    # --- dialling ---------------------------------------------------------------------------

    async def dial(self, address: str) -> Connection:
        route = route_to(address, reachable=self._reachable)
        if isinstance(route, Direct):
            conn = await self._inner.dial(address)
            self._direct += 1
            return conn
        if isinstance(route, Callback):
            return await self._called_back(address, route.target)
        ticket = secrets.token_hex(16)
        await self._call(CallRequest(route.target, ticket))
        conn = await self._inner.dial_path(self._relay, f"/relay/{ticket}", dialer=True)
        self._relayed += 1
        return conn

    async def _called_back(self, address: str, target: NodeName) -> Connection:
        ticket = secrets.token_hex(16)
        handed_send, handed_recv = trio.open_memory_channel[HandedConnection](0)
        self._pending[ticket] = handed_send
        try:
            await self._call(CallRequest(target, ticket, back=self._advertise))
            with trio.move_on_after(self._call_timeout_s):
                conn = await handed_recv.receive()
                self._callbacks += 1
                return conn
            raise TransportError(
                f"{address}: {target} did not dial back within {self._call_timeout_s:g} s "
                f"(is {self._advertise} reachable from it?)"
            )
        finally:
            self._pending.pop(ticket, None)
            handed_recv.close()  # a late callback finds it closed and hangs up

    async def _call(self, request: CallRequest) -> None:
        """Have the relay pass ``request`` on. Errors: ``TransportError`` saying why not."""
        if self._hub is not None:  # this node is the relay
            try:
                self._hub.place(self._node, request)
            except CallRefused as exc:
                raise TransportError(f"nat:{request.target}: {exc}") from None
            return
        conn = await self._signal("caller")
        try:
            await send_within(conn, request, self._handshake_timeout_s, what="relay")
            reply = await receive_within(conn, self._handshake_timeout_s, what="relay")
        except WireError as exc:
            raise TransportError(f"relay {self._relay}: {exc}") from None
        finally:
            await abandon(conn)
        if isinstance(reply, Fault):
            raise TransportError(f"nat:{request.target}: relay {self._relay}: {reply.detail}")
        if not isinstance(reply, CallPlaced) or reply.ticket != request.ticket:
            raise TransportError(f"relay {self._relay} answered {type(reply).__name__}")

    async def _signal(self, link: str) -> Connection:
        hello = Hello(node=self._node, role=self._role, swarm=self._swarm, link=link)
        return await open_signal(self._inner, self._relay, hello, self._handshake_timeout_s)

    # --- serving ----------------------------------------------------------------------------

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``address`` like the inner network, plus the paths this node answers: dial
        backs it asked for, and the relay's when it holds that role. A ``reachable = false``
        node also keeps its signalling link to the relay and answers calls; it reports
        ``nat:NAME`` as bound."""
        router = partial(self._route, handler)
        if self._reachable and not self._on_demand:
            await self._inner.serve_paths(address, handler, router, task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(partial(self._inner.serve_paths, address, handler, router))
            if self._on_demand:  # reachable until told otherwise: others probe its address
                nursery.start_soon(self._callee_when_told, handler, nursery)
                task_status.started(bound)
                return
            nursery.start_soon(self._callee.run, handler, nursery)
            task_status.started(self._advertise)

    async def _callee_when_told(self, handler: Handler, nursery: trio.Nursery) -> None:
        await self._told.wait()
        await self._callee.run(handler, nursery)

    async def behind_nat(self, *, timeout_s: float) -> None:
        """From now on this node accepts no inbound connection (on demand only; a node that
        was ``reachable = false`` from the start already is): register at the relay and dial
        ``nat:`` addresses through it. Returns once registered.

        Errors: ``TransportError`` when not on demand, or the relay is not reached within
        ``timeout_s`` (the callee keeps trying)."""
        if not self._on_demand:
            if self._reachable:
                raise TransportError(f"{self._node}: this network cannot turn to NAT edges")
            return
        self._reachable = False
        self._advertise = nat_address(self._node)
        self._told.set()
        with trio.move_on_after(timeout_s):
            await self._callee.wait_registered()
            return
        raise TransportError(
            f"{self._node}: relay {self._relay} not reached within {timeout_s:g} s; nodes behind "
            "NAT are reached through it"
        )

    def _route(self, handler: Handler, path: str) -> Route | None:
        if path.startswith(REVERSE_PREFIX):
            waiting = self._pending.pop(path[len(REVERSE_PREFIX) :], None)
            return None if waiting is None else Sealed(partial(self._deliver, waiting), dialer=True)
        return self._hub.route(path) if self._hub is not None else None

    async def _deliver(
        self, waiting: trio.MemorySendChannel[HandedConnection], conn: Connection
    ) -> None:
        """Hand a dialled-back connection to the ``dial`` waiting for it; hold it until that
        side closes it (returning would close it)."""
        handed = HandedConnection(conn)
        try:
            await waiting.send(handed)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # that dial gave up
        await handed.closed.wait()


__all__ = [
    "NAT_PREFIX",
    "BehindNat",
    "Callback",
    "Direct",
    "EdgeRoute",
    "HandedConnection",
    "NatNetwork",
    "NatStatistics",
    "Relayed",
    "nat_address",
    "route_to",
]
