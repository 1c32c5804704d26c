"""One request's failure is that request's alone: the boundary ``Coordinator.generate`` keeps.

Everything on a request's path — its driver, the messages it sends (checked against the
wire's rules before they enter the link every request shares: ``RingGate.send``), its
receipts and checkpoint — runs in the caller's task. Whatever that path raises ends that
request: a ``RingError`` or ``BadRequest`` as it is, anything else (a bug, a message the wire
refuses) as ``RequestFailed``, logged once here with its traceback. Nothing reaches the
router, the ring's links or another request. Cancellation and ``KeyboardInterrupt`` are not
``Exception``s and pass through untouched.

The caller's own code is not on that path: it reads the request's ``Committed`` tokens from
a channel in its own task, so what it raises is its own (``shard.coordinator.text`` runs both
sides for text). A caller that closes its channel ends its request with ``CallerLeft``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shard.coordinator.events import RequestFailed
from shard.messages import SessionId

log = logging.getLogger("shard.coordinator")


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


__all__ = ["request_failed"]
