"""DownstreamLink: the sending side of one ring edge, supervised and re-dialable.

It pumps an actor's outbox to the next node and, on top of a plain pump:

- logs what it sent (``shard.failover.replay.ReplayLog``) so a spliced-in standby can rebuild its KV
  (``records=False``: the actor behind it keeps that log itself — the coordinator does);
- sends a ``Heartbeat`` when the edge has been idle for ``heartbeat_s``, so a dead peer shows
  up as a failed send within about that long even when no request is running;
- bounds every send by ``send_timeout_s`` (a peer that stops reading is as good as dead);
- on failure sends a ``Fault`` (kind ``link``) on its ``faults`` channel and waits, holding
  the message it could not send, until ``rewire`` names the next node; then it dials, replays its
  log if asked, sends the held message and carries on. Nothing queued behind it is lost.

The link never decides anything itself: the scheduler learns of the fault (from this node's
control link, or from its own heartbeats) and answers with ``rewire``. ``rewire`` is a call,
not a message: it is a request with a reply (the caller must know when the new edge carries
traffic, or why it cannot), made by the one actor that repairs the ring.
"""

from __future__ import annotations

import logging
import math
import time

import attrs
import trio

from shard.errors import HandshakeError
from shard.failover.replay import ReplayLog
from shard.messages import Fault, Heartbeat, Hello, Message, NodeName
from shard.transport import Connection, Network, TransportError, abandon
from shard.transport.links import HANDSHAKE_TIMEOUT_S, dial_peer

log = logging.getLogger(__name__)


@attrs.frozen
class LinkStatistics:
    node: NodeName
    peer: str | None
    sent: int
    heartbeats: int
    failures: int
    rewires: int
    replayed: int


@attrs.define
class _Rewire:
    address: str
    replay: bool
    done: trio.Event = attrs.field(factory=trio.Event)
    error: str | None = None


@attrs.frozen
class EdgeTimings:
    """A ring edge's timings, built once by its node's root from the spec (``[failover]``'s
    heartbeat and send timeout, ``limits.handshake_timeout_s``, the node's startup timeout
    for dialling)."""

    heartbeat_s: float = 0.25
    send_timeout_s: float = 2.0
    connect_timeout_s: float = 10.0
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S


class DownstreamLink:
    """See the module docstring.

    Cancellation: cancelling ``run`` closes the connection. Errors: ``run`` never raises for a
    failed peer (it reports and waits); it ends when the outbox closes.
    """

    def __init__(
        self,
        node: NodeName,
        outbox: trio.MemoryReceiveChannel[Message],
        network: Network,
        hello: Hello,
        timings: EdgeTimings = EdgeTimings(),
        *,
        replay_log: ReplayLog | None = None,
        records: bool = True,
        faults: trio.MemorySendChannel[Fault] | None = None,
    ) -> None:
        """``faults`` receives a ``Fault`` each time the edge fails (the control client of a
        stage, the scheduler for the coordinator's own link); None: nobody is told."""
        self._node = node
        self._outbox = outbox
        self._network = network
        self._hello = hello
        self._log = replay_log if replay_log is not None else ReplayLog()
        self._records = records
        self._heartbeat_s = timings.heartbeat_s
        self._send_timeout_s = timings.send_timeout_s
        self._connect_timeout_s = timings.connect_timeout_s
        self._handshake_timeout_s = timings.handshake_timeout_s
        self._faults = faults
        self._conn: Connection | None = None
        self._address: str | None = None
        self._request: _Rewire | None = None
        self._wake = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._sent = self._heartbeats = self._failures = self._rewires = self._replayed = 0

    @property
    def replay_log(self) -> ReplayLog:
        return self._log

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def statistics(self) -> LinkStatistics:
        return LinkStatistics(
            self._node,
            self._address,
            self._sent,
            self._heartbeats,
            self._failures,
            self._rewires,
            self._replayed,
        )

    async def connect(self, address: str) -> None:
        """First dial (before ``run``): retries until the peer answers or the timeout."""
        self._conn = await dial_peer(
            self._network,
            address,
            self._hello,
            timeout_s=self._connect_timeout_s,
            handshake_timeout_s=self._handshake_timeout_s,
        )
        self._address = address

    async def rewire(self, address: str, *, replay: bool) -> None:
        """Switch this edge to ``address`` (replaying the log first when ``replay``); returns
        once the new link carries traffic. Errors: ``TransportError`` when it cannot dial."""
        request = _Rewire(address, replay)
        self._request = request
        self._wake.set()
        if self._scope is not None:
            self._scope.cancel()
        await request.done.wait()
        if request.error is not None:
            raise TransportError(request.error)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        held: Message | None = None
        task_status.started()
        try:
            async with self._outbox:
                while True:
                    if self._request is not None:
                        await self._apply(self._request)
                        continue
                    if self._conn is None:
                        self._wake = trio.Event()
                        if self._request is None:
                            await self._wake.wait()
                        continue
                    failure: Exception | None = None
                    with trio.CancelScope() as scope:  # a rewire cancels it
                        self._scope = scope
                        try:
                            if held is None:
                                held = await self._next_or_heartbeat()
                            if held is not None:
                                await self._send(held)
                                if self._records:
                                    self._log.record(held)
                                self._log.sent(held)  # receipts: what really went out
                                self._sent += 1
                                held = None
                        except trio.EndOfChannel:
                            return
                        except (TransportError, trio.TooSlowError) as exc:
                            failure = exc
                    self._scope = None
                    if failure is not None:  # reported outside the scope: a rewire arriving
                        await self._failed(failure)  # meanwhile must not cut the report
        finally:
            await self._close()

    async def _next_or_heartbeat(self) -> Message | None:
        with trio.move_on_after(self._heartbeat_s if self._heartbeat_s > 0 else math.inf):
            return await self._outbox.receive()
        await self._send(Heartbeat(node=self._node, sent_at=time.time()))
        self._heartbeats += 1
        return None

    async def _send(self, msg: Message) -> None:
        assert self._conn is not None
        with trio.fail_after(self._send_timeout_s):
            await self._conn.send(msg)

    async def _failed(self, exc: BaseException) -> None:
        self._failures += 1
        peer = self._address
        await self._close(abandon_peer=True)
        detail = f"link to {peer} lost: {exc!r}"
        log.warning("%s: %s; waiting for the scheduler to rewire", self._node, detail)
        if self._faults is not None:
            await self._faults.send(Fault(node=self._node, kind="link", detail=detail))

    async def _apply(self, request: _Rewire) -> None:
        self._request = None
        await self._close(abandon_peer=True)  # the old peer may be frozen: do not wait on it
        try:
            await self.connect(request.address)
            if request.replay:
                for msg in self._log.replay():
                    await self._send(msg)
                    self._replayed += 1
            self._rewires += 1
        except (TransportError, HandshakeError, trio.TooSlowError) as exc:
            await self._close(abandon_peer=True)
            request.error = f"{self._node}: could not rewire to {request.address}: {exc}"
        finally:
            request.done.set()

    async def _close(self, *, abandon_peer: bool = False) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if abandon_peer:
            await abandon(conn)
        else:
            with trio.CancelScope(shield=True):
                await conn.aclose()
