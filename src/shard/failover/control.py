"""ControlClient: a node's control link to the scheduler (in the coordinator's process).

A stage or standby dials the coordinator with ``Hello(link="control")``, sends ``Register``
(who it is, where it listens, which block it holds), then keeps the link alive with
heartbeats both ways. The scheduler watches the heartbeats (a silent node is dead), and sends
orders on the same link: ``Activate`` (a standby joins the ring) and ``Rewire`` (re-dial the
downstream edge, replaying the log). Each order is answered with ``Ready``, each ``Probe``
at once with a ``ProbeReply`` (the scheduler's RTT to this node, ``shard.membership.rtt``). Link
faults the node sees on its ring edges arrive on the ``faults`` channel and go up the same way,
as ``Fault`` messages (dropped, and logged, while the control link is down: the scheduler's own
heartbeats cover a node it cannot hear from).

An ``Activate`` with ``behind_nat`` first turns the node's network to NAT edges
(``shard.transport.nat``, on demand): it registers at the relay before the order runs.

Orders are carried out by the node that owns this client, asked on its ``Duties`` channels
(``shard.failover.duties``): the reply (``Ready``, ok or not) must say how the order went, so
it is a request with its answer, not a message sent and forgotten. A joining node's
``MeasureRtt`` is one too, its ``RttReport`` the answer, and a standby's ``AuditRequest``, its
``AuditVerdict``. Measurements run in a task of their own (one at a time; one more may wait,
later ones are dropped and logged), so a re-measure of the mesh never delays an ``Activate``
after a death. A registration the scheduler refuses (a
``Fault`` of kind ``register``: a malformed profile) ends the client with ``JoinRefused``.
One under a name a live member holds (kind ``name``) is tried again for ``name_wait_s``
(by default three times ``dead_after_s``: long enough for the scheduler to declare a crashed
holder dead, so a restart under the same name goes through), then ends the client with
``NameTaken``; the live member is never disturbed.

If the coordinator goes away, the client re-dials until it is back (a restarted coordinator
finds its warm ring registering again). With a standby coordinator it has two addresses and
tries them in turn; a coordinator whose ``Welcome`` carries a generation below the highest this
node has seen (``shard.failover.fence``) is refused and the next address tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import trio

from shard.errors import HandshakeError
from shard.failover.duties import Duties, Order, ask
from shard.failover.fence import Fence
from shard.messages import (
    Activate,
    Fault,
    Heartbeat,
    Hello,
    MeasureRtt,
    Message,
    NodeName,
    Probe,
    ProbeReply,
    Ready,
    Register,
    Rewire,
    RttReport,
)
from shard.messages.audit import AuditCopy, AuditRequest
from shard.transport import Connection, Network, TransportError, abandon
from shard.transport.guard import CONNECTION_ERRORS
from shard.transport.links import HANDSHAKE_TIMEOUT_S, dial_welcome
from shard.transport.nat import BehindNat

log = logging.getLogger(__name__)

#: Audit requests waiting for this standby's auditor; more are dropped (an audit not run
#: accuses nobody) rather than stop the link being read.
_AUDITS_BUFFER = 16
#: A ``MeasureRtt`` waiting while one runs; one more is dropped (the scheduler counts a miss).
_MEASURES_BUFFER = 1


class NodeReplaced(Exception):
    """The scheduler refused this node: it was declared dead and replaced (a node that froze,
    then woke). It must not serve its old sessions; restart it as a standby, under a new name."""


class JoinRefused(Exception):
    """The scheduler refused this node's registration (its profile or address is malformed);
    the message says why. Fix the node's flags and start it again."""


class NameTaken(JoinRefused):
    """The scheduler refused this node's registration because a live member holds its name
    (``shard.membership.registry.Registry.name_refusal``). Start it under another ``--node``."""


class OrderFailed(Exception):
    """An order could not be carried out; its message goes back in ``Ready.detail``."""


@attrs.frozen
class _Queues:
    """Where the reading loop hands what it read: orders (one at a time, unbuffered), audit
    requests and RTT measurements (bounded; dropped when full)."""

    orders: trio.MemorySendChannel[Order]
    audits: trio.MemorySendChannel[AuditRequest]
    measures: trio.MemorySendChannel[MeasureRtt]


@attrs.frozen
class ControlLink:
    """A node's control link, built once by its root: who it is (``hello``), the coordinators
    it dials in turn (the primary's address, then a standby coordinator's) and its timings."""

    node: NodeName
    addresses: tuple[str, ...]
    hello: Hello
    heartbeat_s: float = 0.25
    dead_after_s: float = 1.0
    connect_timeout_s: float = 10.0
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    name_wait_s: float | None = None  # None: three times dead_after_s


class ControlClient:
    """See the module docstring.

    ``register`` builds the ``Register`` sent on each (re)connection, so a standby that was
    activated re-registers as a stage (a snapshot of the node's state, read when needed).
    ``duties``: the channels its node is asked on; ``faults`` and ``copies``: what the node
    reports up.

    Cancellation: cancelling ``run`` closes the link. Errors: ``NodeReplaced`` when the
    scheduler refuses this node; ``JoinRefused`` (``NameTaken`` when a live member holds its
    name past ``name_wait_s``); the first dial's ``TransportError`` / ``HandshakeError``
    (later ones are retried).
    """

    def __init__(
        self,
        link: ControlLink,
        network: Network,
        register: Callable[[], Register],
        duties: Duties,
        *,
        faults: trio.MemoryReceiveChannel[Fault] | None = None,
        copies: trio.MemoryReceiveChannel[AuditCopy] | None = None,
        fence: Fence | None = None,
    ) -> None:
        self._node = link.node
        self._network = network
        self._addresses = link.addresses
        self._at = 0  # the address tried now
        self._fence = fence if fence is not None else Fence()
        self._hello = link.hello
        self._register = register
        self._duties = duties
        self._faults = faults
        self._copies = copies
        self._heartbeat_s = link.heartbeat_s
        self._dead_after_s = link.dead_after_s
        self._connect_timeout_s = link.connect_timeout_s
        self._handshake_timeout_s = link.handshake_timeout_s
        wait = link.name_wait_s
        self._name_wait_s = 3 * link.dead_after_s if wait is None else wait
        self._conn: Connection | None = None

    @property
    def _address(self) -> str:
        return self._addresses[self._at]

    def _next_address(self) -> None:
        self._at = (self._at + 1) % len(self._addresses)

    async def _dial(self, started: bool) -> Connection:
        """Dial the coordinator at ``_address`` (re-dials with several addresses are short:
        the next is tried soon). Errors: as ``dial_welcome``; ``HandshakeError`` for a
        coordinator of a generation this node has left behind."""
        timeout_s = self._connect_timeout_s
        if started and len(self._addresses) > 1:
            timeout_s = min(timeout_s, self._dead_after_s)
        conn, welcome = await dial_welcome(
            self._network,
            self._address,
            self._hello,
            timeout_s=timeout_s,
            handshake_timeout_s=self._handshake_timeout_s,
        )
        if not self._fence.admit(welcome.generation):
            await abandon(conn)
            raise HandshakeError(
                f"{self._node}: the coordinator at {self._address} is of generation "
                f"{welcome.generation}, this node follows {self._fence.generation} (fenced)"
            )
        return conn

    async def _report_faults(
        self, faults: trio.MemoryReceiveChannel[Fault] | trio.MemoryReceiveChannel[AuditCopy]
    ) -> None:
        """Send each fault (or audit copy) to the scheduler; dropped (logged) while the link
        is down (a dropped copy leaves a gap the scheduler sees: ``AuditCopy.n``)."""
        async with faults:
            async for fault in faults:
                what = fault.detail if isinstance(fault, Fault) else "an audit copy"
                conn = self._conn
                if conn is None:
                    log.warning("%s: control link down; not reported: %s", self._node, what)
                    continue
                try:
                    await conn.send(fault)
                except TransportError as exc:
                    log.warning("%s: could not report %s: %s", self._node, what, exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ended: NodeReplaced | JoinRefused | TransportError | HandshakeError | None = None
        async with trio.open_nursery() as nursery:
            if self._faults is not None:
                nursery.start_soon(self._report_faults, self._faults)
            if self._copies is not None:
                nursery.start_soon(self._report_faults, self._copies)
            try:
                await self._stay_linked(task_status)
            except (NodeReplaced, JoinRefused, TransportError, HandshakeError) as exc:
                ended = exc  # raised below, outside the nursery: not wrapped in a group
            nursery.cancel_scope.cancel()
        if ended is not None:
            raise ended

    async def _stay_linked(self, task_status: trio.TaskStatus[None]) -> None:
        """Dial, register and obey; re-dial whenever the link fails."""
        started = False
        failed_first = 0  # addresses that failed before the first registration
        name_refused_at: float | None = None  # first of a run of "name taken" refusals
        while True:
            try:
                conn = await self._dial(started)
            except (TransportError, HandshakeError) as exc:
                failed_first += not started
                if failed_first >= len(self._addresses):  # none answered at start
                    raise
                log.warning("%s: control link: %s; retrying", self._node, exc)
                self._next_address()
                await trio.sleep(1.0 if len(self._addresses) == 1 else self._heartbeat_s)
                continue
            pause = self._heartbeat_s
            try:
                await conn.send(self._register())
                self._conn = conn
                if not started:
                    started = True
                    task_status.started()
                refused = await self._serve(conn)
                if refused is not None and refused.kind == "name":
                    name_refused_at = self._name_taken(refused, name_refused_at)
                    refused = None  # tried again below, a few times per dead_after_s
                    pause = max(self._heartbeat_s, self._dead_after_s / 4)
                elif refused is None:
                    name_refused_at = None
                if refused is not None and refused.kind == "register":
                    raise JoinRefused(f"{self._node}: the scheduler refused it: {refused.detail}")
                if refused is not None:
                    raise NodeReplaced(
                        f"{self._node}: the scheduler refused this node: {refused.detail}; "
                        "restart it as a standby under a new name"
                    )
            except TransportError as exc:
                log.warning("%s: control link to %s lost: %s", self._node, self._address, exc)
            finally:
                self._conn = None
                await abandon(conn)
            await trio.sleep(pause)

    def _name_taken(self, refused: Fault, since: float | None) -> float:
        """A live member holds this node's name: keep trying for ``name_wait_s`` from the
        first refusal (``since``; its time is returned) — a crashed holder is declared dead
        in that time — then raise ``NameTaken``."""
        now = trio.current_time()
        since = now if since is None else since
        if now - since >= self._name_wait_s:
            raise NameTaken(
                f"{self._node}: the scheduler refused this name for {now - since:.0f} s: "
                f"{refused.detail}"
            )
        log.warning("%s: name in use, trying again: %s", self._node, refused.detail)
        return since

    async def _serve(self, conn: Connection) -> Fault | None:
        """Obey orders until the link fails (returns None; the caller re-dials) or the
        scheduler refuses this node (returns why).

        Orders run one at a time in a task of their own, so the link is still read while an
        ``Activate`` loads a block: probes are answered at once (the scheduler's RTT is not
        inflated by the load) and a silent scheduler is noticed. An order in progress when
        the link ends still runs to completion, as when orders ran in the reading loop.
        """
        orders_send, orders = trio.open_memory_channel[Order](0)
        audits_send, audits = trio.open_memory_channel[AuditRequest](_AUDITS_BUFFER)
        measures_send, measures = trio.open_memory_channel[MeasureRtt](_MEASURES_BUFFER)
        link = trio.CancelScope()
        async with trio.open_nursery() as obeying:
            obeying.start_soon(self._obey_all, conn, orders, link)
            obeying.start_soon(self._audit_all, conn, audits)
            obeying.start_soon(self._measure_all, conn, measures)
            async with orders_send, audits_send, measures_send:
                with link:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._beat, conn, nursery.cancel_scope)
                        try:
                            queues = _Queues(orders_send, audits_send, measures_send)
                            return await self._read(conn, queues)
                        finally:
                            nursery.cancel_scope.cancel()
        return None

    async def _audit_all(
        self, conn: Connection, audits: trio.MemoryReceiveChannel[AuditRequest]
    ) -> None:
        """Have the node run each audit request and send its verdict back."""
        async with audits:
            async for req in audits:
                if self._duties.audits is None:
                    continue
                verdict = await ask(self._duties.audits, req)
                try:
                    await conn.send(verdict)
                except TransportError as exc:
                    log.warning("%s: audit verdict not sent: %s", self._node, exc)

    async def _measure_all(
        self, conn: Connection, measures: trio.MemoryReceiveChannel[MeasureRtt]
    ) -> None:
        """Measure each ``MeasureRtt`` and send its ``RttReport`` back."""
        async with measures:
            async for order in measures:
                report = await self._measure(order)
                try:
                    await conn.send(report)
                except TransportError as exc:
                    log.warning("%s: RTT report not sent: %s", self._node, exc)

    async def _read(self, conn: Connection, queues: _Queues) -> Fault | None:
        orders, audits = queues.orders, queues.audits
        try:
            while True:
                with trio.move_on_after(self._dead_after_s * 4) as quiet:
                    msg = await conn.receive()
                if quiet.cancelled_caught:
                    log.warning("%s: the scheduler at %s went silent", self._node, self._address)
                    return None
                if isinstance(msg, Activate | Rewire):
                    await orders.send(msg)
                elif isinstance(msg, MeasureRtt):
                    try:
                        queues.measures.send_nowait(msg)
                    except trio.WouldBlock:
                        log.warning("%s: RTT measurement dropped (busy)", self._node)
                elif isinstance(msg, AuditRequest):
                    try:
                        audits.send_nowait(msg)
                    except trio.WouldBlock:
                        log.warning("%s: audit of %s dropped (busy)", self._node, msg.accused)
                elif isinstance(msg, Probe):
                    await conn.send(ProbeReply(nonce=msg.nonce, sent_at=msg.sent_at))
                elif isinstance(msg, Fault) and msg.kind in ("control", "register", "name"):
                    return msg
                elif not isinstance(msg, Heartbeat):
                    log.warning("%s: unexpected %s on the control link", self._node, msg)
        except CONNECTION_ERRORS as exc:  # a corrupt frame too: re-dial, never exit
            log.warning("%s: control link to %s lost: %s", self._node, self._address, exc)
        return None

    async def _obey_all(
        self,
        conn: Connection,
        orders: trio.MemoryReceiveChannel[Order],
        link: trio.CancelScope,
    ) -> None:
        async with orders:
            async for order in orders:
                ready = await self._obey(order)
                try:
                    await conn.send(ready)
                except TransportError as exc:
                    log.warning("%s: could not answer %s: %s", self._node, order, exc)
                    link.cancel()  # the reading loop ends too; the caller re-dials

    async def _measure(self, order: MeasureRtt) -> RttReport:
        if self._duties.measures is None:  # not a joining node: it measures nothing
            return RttReport(self._node, order.names, tuple(-1.0 for _ in order.names))
        return await ask(self._duties.measures, order)

    async def _obey(self, order: Activate | Rewire) -> Message:
        action = type(order).__name__.lower()
        try:
            if isinstance(order, Activate) and order.behind_nat:
                await self._behind_nat()
            await ask(self._duties.orders, order)
        except (OrderFailed, TransportError, HandshakeError, OSError) as exc:
            log.warning("%s: %s failed: %s", self._node, action, exc)
            return Ready(node=self._node, action=action, ok=False, detail=str(exc))
        return Ready(node=self._node, action=action)

    async def _behind_nat(self) -> None:
        """The scheduler found nobody reaches this node: turn its network to NAT edges."""
        network = self._network
        if not isinstance(network, BehindNat):
            raise OrderFailed(
                f"the scheduler found nobody reaches {self._node} at its listen address, and "
                "its network cannot turn to NAT edges; open its port, or give it reachable "
                "neighbours"
            )
        log.warning("%s: nobody reaches this node's listen address: using the relay", self._node)
        await network.behind_nat(timeout_s=self._connect_timeout_s)

    async def _beat(self, conn: Connection, link: trio.CancelScope) -> None:
        try:
            while True:
                await conn.send(Heartbeat(node=self._node, sent_at=time.time()))
                await trio.sleep(self._heartbeat_s)
        except TransportError:
            link.cancel()  # the receive loop ends too; the caller re-dials
