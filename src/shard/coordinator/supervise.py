"""One request's failure is that request's alone: the boundary ``Coordinator.generate`` keeps.

Everything on a request's path — its driver, the messages it sends (checked against the
wire's rules before they enter the link every request shares: ``RingGate.send``), its
receipts and checkpoint — runs in the caller's task. Whatever that path raises ends that
request: a ``RingError`` or ``BadRequest`` as it is, anything else (a bug, a message the wire
refuses) as ``RequestFailed``, logged once here with its traceback. Nothing reaches the
router, the ring's links or another request. Cancellation and ``KeyboardInterrupt`` are not
``Exception``s and pass through untouched.

The caller's own ``on_tokens`` is not the coordinator's path: what it raises goes back to the
caller as it was (``caller_errors`` marks it on the way through).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shard.coordinator.events import OnTokens, RequestFailed
from shard.messages import SessionId

log = logging.getLogger("shard.coordinator")


class CallerError(Exception):
    """What the caller's ``on_tokens`` raised (``error``), carried through the request's
    boundary so it reaches the caller unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def caller_errors(on_tokens: OnTokens | None) -> OnTokens | None:
    """``on_tokens`` with its exceptions wrapped in ``CallerError``."""
    if on_tokens is None:
        return None
    callback = on_tokens

    async def guarded(ids: list[int]) -> None:
        try:
            await callback(ids)
        except Exception as exc:
            raise CallerError(exc) from exc

    return guarded


def request_failed(sid: SessionId, exc: Exception, committed: Sequence[int]) -> RequestFailed:
    """Log ``exc`` once (with its traceback) and return the request's typed error."""
    log.error(
        "request (session %d) failed at the coordinator after %d tokens: %s: %s; "
        "it ends here, the ring serves on",
        sid,
        len(committed),
        type(exc).__name__,
        exc,
        exc_info=exc,
    )
    return RequestFailed(
        f"the coordinator failed this request ({type(exc).__name__}: {exc}); it is logged "
        "at the coordinator, other requests and the ring are unaffected",
        committed=committed,
    )


__all__ = ["CallerError", "caller_errors", "request_failed"]
