"""Fence: which coordinator a stage obeys — the highest generation it has seen.

A coordinator has a generation: the primary's (1 by default), and a standby that takes over
uses the next one (docs/failover.md, "Standby coordinator"). A stage admits a control link
(the coordinator's ``Welcome``) or a ring link from a coordinator (its ``Hello``) only if its
generation is at least the highest the stage has seen; a higher one raises the mark and ends
the ring links of lower generations at once. So once any link of a stage has met the new
coordinator, a stale one that comes back can neither order the stage nor feed its ring.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from shard.transport import Connection, abandon

log = logging.getLogger(__name__)


class Fence:
    """See the module docstring. One per stage or standby node."""

    def __init__(self) -> None:
        self.generation = 0
        self._held: list[tuple[int, trio.CancelScope]] = []

    def admit(self, generation: int) -> bool:
        """Whether a coordinator of ``generation`` may drive this node; a new highest one
        cancels what lower ones hold (``hold``)."""
        if generation < self.generation:
            return False
        if generation > self.generation:
            self.generation = generation
            for held, scope in self._held:
                if held < generation:
                    scope.cancel()
            self._held = [(g, s) for g, s in self._held if g >= generation]
        return True

    def hold(self, generation: int) -> trio.CancelScope:
        """A cancel scope for a link of ``generation``, cancelled when a higher one is admitted."""
        scope = trio.CancelScope()
        self._held.append((generation, scope))
        return scope

    def release(self, scope: trio.CancelScope) -> None:
        self._held = [(g, s) for g, s in self._held if s is not scope]

    async def serve(
        self,
        generation: int,
        serve: Callable[[], Awaitable[None]],
        conn: Connection,
        *,
        node: str,
    ) -> None:
        """Run ``serve`` (a coordinator's ring link into this node) if ``generation`` is
        admitted, until it ends or a newer coordinator is admitted; else close ``conn``."""
        if not self.admit(generation):
            log.warning(
                "%s: refused a ring link from coordinator generation %d (it follows %d)",
                node,
                generation,
                self.generation,
            )
            await abandon(conn)
            return
        with self.hold(generation) as held:
            try:
                await serve()
            finally:
                self.release(held)
        if held.cancelled_caught:
            log.info("%s: a newer coordinator took over; the old ring link closed", node)
            await abandon(conn)


__all__ = ["Fence"]
