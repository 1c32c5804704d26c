"""The coordinator's end of the ring's return link (``ReturnEndpoint``): the link the ring's
tail dials back on, carrying verdicts, faults and receipts to the router. The coordinator's
root (``shard.nodes.coordinator``) hands it each connection whose ``Hello`` asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from shard.messages import Fault, Hello, Message, NodeName
from shard.transport import Connection
from shard.transport.guard import serve_one
from shard.transport.links import pump_in
from shard.transport.mirror import MirrorNetwork

log = logging.getLogger(__name__)


class ReturnEndpoint:
    """The coordinator's end of the ring's return link: only the ring's current tail may open
    it (anyone else's verdicts would be taken for the ring's); what it sends goes to the
    router's ``from_ring``. ``up`` is the scheduler's snapshot read of whether one is open;
    ``note`` records a ring event (the router's ledger)."""

    def __init__(
        self,
        name: NodeName,
        from_ring: trio.MemorySendChannel[Message],
        note: Callable[[str, str], None],
        mirror: MirrorNetwork | None = None,
    ) -> None:
        self._name = name
        self._from_ring = from_ring
        self._note = note
        self._mirror = mirror  # the swarm audits: the tail's verdicts are copied (its audits)
        self._links = 0
        self.joined = trio.Event()

    def up(self) -> bool:
        return self._links > 0

    async def serve(self, conn: Connection, hello: Hello, *, tail: NodeName) -> None:
        """Pump one return link from ``tail`` (the scheduler's view of the ring now)."""
        if hello.role != "stage" or hello.node != tail:
            log.warning(
                "%s: refused %s (%s) on the return link", self._name, hello.node, hello.role
            )
            detail = f"only {tail} may open the return link"
            await conn.send(Fault(node=self._name, kind="handshake", detail=detail))
            return
        self.joined.set()
        self._note("join", f"{hello.node} ({hello.role}) connected from {conn.peer}")
        self._links += 1
        if self._mirror is not None:  # after the check: only the tail's verdicts are copied
            conn = self._mirror.attach(conn)
        try:
            pump = partial(pump_in, self._name, sink=self._from_ring.clone())
            await serve_one(conn, pump, what="return link")
        finally:
            self._links -= 1
