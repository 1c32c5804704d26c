"""RingGate: the coordinator's end of the ring link, shared by every request's driver.

Drivers send towards stage 0 through it; it logs every message in the session's
``ReplayLog`` (full re-sends come from there, and the ring link replays it to a standby that
replaces stage 0) and knows the ring's condition: up, under repair, or lost. The router sets
the condition from the scheduler's ``Pause`` / ``Resume`` / ``RingLost``.

Not an actor, and a call, not a message, on purpose: a driver's send blocks its own task on
the ring link exactly as a send on the channel would (the gate only records it first, and
turns a lost ring into ``RingDown``), and ``repairing`` is a snapshot the driver reads at the
moment its wait times out. A ``Pause`` posted on each route instead would either block the
router behind a request's backlog or be dropped when that backlog is full.
"""

from __future__ import annotations

import trio

from shard.failover.replay import LoggedChunk, ReplayLog
from shard.messages import EndSession, Fault, Message, SessionId
from shard.wire import WireLimits
from shard.wire.checks import check_message

#: How long ending a session may take during cancellation (the link may be stuck).
END_SESSION_TIMEOUT_S = 1.0
#: The limits ``send`` checks values against (sizes are the link's: a request's messages
#: are a prefill chunk or a verify chunk, far inside any frame cap).
_VALUE_LIMITS = WireLimits()


class RingDown(Exception):
    """Raised inside a request when the ring was declared lost; the driver turns it into
    ``RingError`` with the request's committed tokens."""


class RingGate:
    """See the module docstring. Errors: ``send`` raises ``RingDown`` once the ring is lost
    (also while that send waits on a link that will never be rewired, or when the link's
    edge has ended: a dead edge fails its requests as the ring, never as a bug)."""

    def __init__(self, to_ring: trio.MemorySendChannel[Message], sent_log: ReplayLog) -> None:
        self._to_ring = to_ring
        self._log = sent_log
        self._repairing: str | None = None
        self._lost: Fault | None = None
        self._sending: set[trio.CancelScope] = set()
        self._changed = trio.Event()  # set (and replaced) on each change of condition

    @property
    def log(self) -> ReplayLog:
        """What each session sent towards stage 0."""
        return self._log

    @property
    def repairing(self) -> bool:
        """The scheduler is repairing the ring: requests wait instead of timing out."""
        return self._repairing is not None

    @property
    def repair(self) -> str | None:
        """What the scheduler is repairing (its ``Pause``), or None."""
        return self._repairing

    @property
    def lost(self) -> Fault | None:
        """Why the ring was declared lost (None while it is not)."""
        return self._lost

    def chunks(self, sid: SessionId) -> tuple[LoggedChunk, ...]:
        return self._log.chunks(sid)

    # --- what the router sets -------------------------------------------------------------

    async def wait_up(self) -> None:
        """Wait until the ring is neither under repair nor lost."""
        while self._repairing is not None or self._lost is not None:
            await self._changed.wait()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def pause(self, detail: str) -> None:
        self._repairing = detail
        self._change()

    def resume(self) -> None:
        """The ring is whole again; one that was given up is usable again too (a node
        declared dead came back into its slot: ``shard.failover.splice``'s rejoin)."""
        self._repairing = None
        self._lost = None
        self._change()

    def lose(self, fault: Fault, *, cancel_sends: bool) -> None:
        """The ring is lost; ``cancel_sends`` also ends every send waiting on the link (one
        that will never be rewired)."""
        self._lost = fault
        self._change()
        if cancel_sends:
            for scope in self._sending:
                scope.cancel()

    # --- what a driver does ---------------------------------------------------------------

    async def send(self, msg: Message) -> None:
        """Record ``msg`` and send it towards stage 0.

        The wire's value rules are checked here, in the request's own task, before ``msg``
        enters the link every request shares: a message the link could not encode fails its
        request (``WireError``), never the link."""
        check_message(msg, _VALUE_LIMITS)
        if self._lost is None:
            with trio.CancelScope() as scope:
                self._sending.add(scope)
                try:
                    self._log.record(msg)
                    await self._to_ring.send(msg)
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    raise RingDown("the ring link is gone (its edge ended)") from None
                finally:
                    self._sending.discard(scope)
        assert self._lost is not None
        raise RingDown(f"the ring is down: {self._lost.detail}")

    async def end_session(self, sid: SessionId) -> None:
        """Free the session on every stage; shielded and bounded (runs during cancellation).
        Not logged: the router records the end once the session is closed."""
        with trio.CancelScope(shield=True), trio.move_on_after(END_SESSION_TIMEOUT_S):
            try:
                await self._to_ring.send(EndSession(session=sid))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the ring link is gone: there is no session left to end

    def ended(self, sid: SessionId) -> None:
        """Log the session's end (its log entries can go)."""
        self._log.record(EndSession(session=sid))


__all__ = ["RingDown", "RingGate"]
