"""MirrorNetwork: a node's network, copying every ring chunk it sends or receives to a sink.

Spot checks in a real swarm need an audited stage's inputs and outputs, taken from its
neighbours, not from the stage itself: what its predecessor *sent* it and what its successor
*received* from it (a stage that lies would lie about its own traffic too). Every node of a
swarm that audits wraps its network in this: on a link whose ``Hello`` says ``ring``, each
``Prefill``/``Verify`` sent becomes an ``AuditCopy`` with ``side`` "sent", each received one
"received", each ``EndSession`` an "end" copy, each ``OpenSession`` sent an "open" copy and
each ``Verdict`` received (only the coordinator receives one: ``attach`` wraps its return
link) a "verdict" copy. A stage's sink queues copies for its control
link (``shard.failover.control``); the coordinator's is a channel its scheduler reads.

Copies are awaited, not dropped: a chunk the scheduler never saw would make the sampler's
chains wrong. A copy the control link cannot carry is counted out (``AuditCopy.n`` leaves a
gap) and the scheduler stops auditing what it touches.

Cancellation and errors: those of the inner connection and of the sink, unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from shard.messages import EndSession, Hello, Message, OpenSession, Prefill, Verdict, Verify
from shard.messages.audit import AuditCopy
from shard.transport import Connection, Network, TransportError
from shard.transport.base import Handler, NetworkBase
from shard.transport.nat import BehindNat

__all__ = ["MirrorNetwork", "Sink", "copy_of"]

Sink = Callable[[AuditCopy], Awaitable[None]]


def copy_of(side: str, n: int, msg: Message) -> AuditCopy | None:
    """The copy of ``msg``: a chunk, a session's end, a sent ``OpenSession`` (its sampling)
    or a received ``Verdict`` (None for anything else: the scheduler reads only the tail's
    successor's word on a verdict, and only the predecessor's on a session's sampling)."""
    if isinstance(msg, EndSession):
        return AuditCopy(side, "end", n, msg.session)
    if isinstance(msg, OpenSession):
        return (
            AuditCopy(side, "open", n, msg.session, sampling=msg.sampling)
            if side == "sent"
            else None
        )
    if isinstance(msg, Verdict):
        if side != "received":
            return None
        return AuditCopy(
            side, "verdict", n, msg.session, msg.epoch, msg.seq, msg.start,
            ids=tuple(msg.target_ids), accepted=msg.accepted,
        )  # fmt: skip
    if not isinstance(msg, Prefill | Verify):
        return None
    replay = isinstance(msg, Prefill) and msg.replay
    return AuditCopy(
        side, "chunk", n, msg.session, msg.epoch, msg.seq, msg.start, replay, tuple(msg.ids),
        msg.hidden, verify=isinstance(msg, Verify), final=isinstance(msg, Prefill) and msg.final,
        draft=tuple(msg.draft) if isinstance(msg, Verify) else (),
        q=tuple(msg.q) if isinstance(msg, Verify) else (),
    )  # fmt: skip


class MirrorNetwork(NetworkBase):
    """``inner`` with every ring chunk copied to ``sink`` (see the module docstring)."""

    def __init__(self, inner: Network, sink: Sink) -> None:
        self._inner, self._sink = inner, sink
        self._n = 0

    def attach(self, conn: Connection) -> Connection:
        """``conn``, a ring link whose ``Hello`` was already read, with its traffic copied."""
        mirrored = _Mirrored(conn, self)
        mirrored.ring = True
        return mirrored

    async def copy(self, side: str, msg: Message) -> None:
        copy = copy_of(side, self._n, msg)
        if copy is not None:
            self._n += 1
            await self._sink(copy)

    async def dial(self, address: str) -> Connection:
        return _Mirrored(await self._inner.dial(address), self)

    async def behind_nat(self, *, timeout_s: float) -> None:
        """Pass on to ``inner`` (``shard.transport.nat.BehindNat``)."""
        if not isinstance(self._inner, BehindNat):
            raise TransportError(f"{self._inner!r} cannot turn to NAT edges")
        await self._inner.behind_nat(timeout_s=timeout_s)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def mirrored(conn: Connection) -> None:
            await handler(_Mirrored(conn, self))

        await self._inner.serve(address, mirrored, task_status=task_status)


class _Mirrored:
    def __init__(self, inner: Connection, mirror: MirrorNetwork) -> None:
        self._inner, self._mirror = inner, mirror
        self.ring = False

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def receive(self) -> Message:
        msg = await self._inner.receive()
        if isinstance(msg, Hello):
            self.ring = msg.link == "ring"
        elif self.ring:
            await self._mirror.copy("received", msg)
        return msg

    async def send(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self.ring = msg.link == "ring"
        elif self.ring:
            await self._mirror.copy("sent", msg)
        await self._inner.send(msg)

    async def aclose(self) -> None:
        await self._inner.aclose()
