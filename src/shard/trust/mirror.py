"""MirrorNetwork: a node's network, copying every ring chunk it sends or receives to a sink.

Spot checks in a real swarm need an audited stage's inputs and outputs, taken from its
neighbours, not from the stage itself: what its predecessor *sent* it and what its successor
*received* from it (a stage that lies would lie about its own traffic too). Every node of a
swarm that audits wraps its network in this: on a link whose ``Hello`` says ``ring``, each
``Prefill``/``Verify`` sent becomes an ``AuditCopy`` with ``side`` "sent", each received one
"received", and each ``EndSession`` an "end" copy. A stage's sink queues copies for its control
link (``shard.failover.control``); the coordinator's feeds its scheduler directly.

Copies are awaited, not dropped: a chunk the scheduler never saw would make the sampler's
chains wrong. A copy the control link cannot carry is counted out (``AuditCopy.n`` leaves a
gap) and the scheduler stops auditing what it touches.

Cancellation and errors: those of the inner connection and of the sink, unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from shard.messages import EndSession, Hello, Message, Prefill, Verify
from shard.messages.audit import AuditCopy
from shard.transport import Connection, Network
from shard.transport.base import Handler, NetworkBase

__all__ = ["MirrorNetwork", "Sink", "copy_of"]

Sink = Callable[[AuditCopy], Awaitable[None]]


def copy_of(side: str, n: int, msg: Message) -> AuditCopy | None:
    """The copy of ``msg`` (None for a message that is not a chunk or a session's end)."""
    if isinstance(msg, EndSession):
        return AuditCopy(side, "end", n, msg.session)
    if not isinstance(msg, Prefill | Verify):
        return None
    replay = isinstance(msg, Prefill) and msg.replay
    return AuditCopy(
        side, "chunk", n, msg.session, msg.epoch, msg.seq, msg.start, replay, tuple(msg.ids),
        msg.hidden,
    )  # fmt: skip


class MirrorNetwork(NetworkBase):
    """``inner`` with every ring chunk copied to ``sink`` (see the module docstring)."""

    def __init__(self, inner: Network, sink: Sink) -> None:
        self._inner, self._sink = inner, sink
        self._n = 0

    async def copy(self, side: str, msg: Message) -> None:
        copy = copy_of(side, self._n, msg)
        if copy is not None:
            self._n += 1
            await self._sink(copy)

    async def dial(self, address: str) -> Connection:
        return _Mirrored(await self._inner.dial(address), self)

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
        self._ring = False

    @property
    def peer(self) -> str:
        return self._inner.peer

    async def receive(self) -> Message:
        msg = await self._inner.receive()
        if isinstance(msg, Hello):
            self._ring = msg.link == "ring"
        elif self._ring:
            await self._mirror.copy("received", msg)
        return msg

    async def send(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._ring = msg.link == "ring"
        elif self._ring:
            await self._mirror.copy("sent", msg)
        await self._inner.send(msg)

    async def aclose(self) -> None:
        await self._inner.aclose()
