"""The coordinator's in-process messages between the router, a request's driver and its caller.

None of these go on the wire (``shard.messages`` is the wire's union). A route (router ->
driver) carries the ring's ``Verdict``, ``Fault`` and ``StageReceiptOut`` for the session, and
``Resync`` when the request must re-send; the driver sends its caller each batch of committed
ids as one ``Committed``; its end is what its ``run`` returns or raises, and the task that ran
it (``shard.coordinator.text``) sends it on as the channel's last message, ``Ended``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from shard.messages import Message, RunStats
from shard.trust.receipts import RunReceipt


class RingError(Exception):
    """The ring could not finish a request (a stage fault or a broken link).

    ``committed`` holds the token ids committed before the failure: nothing is lost silently.
    """

    def __init__(self, message: str, committed: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.committed = tuple(committed)


class RequestFailed(RingError):
    """The coordinator failed one request on its own path (a bug, or a message the wire
    refuses), not the ring: the request ends here, logged once with its traceback, and the
    coordinator and the ring serve on. A ``RingError`` so every caller ends it the same way
    (``committed`` holds what was committed first)."""


@attrs.frozen
class Resync:
    """Router -> request: re-send from the committed tokens in a new epoch.

    After a splice or a re-dialled edge (``full`` False: every stage holds the committed KV)
    or after a stage reported a gap (``full``: re-send the session from position 0, so every
    stage rebuilds what it misses)."""

    full: bool
    reason: str


class CallerLeft(Exception):
    """The caller closed the receive side of its ``Committed`` channel mid-request: nobody
    reads the tokens any more, so the request ends there (its session ends on the ring). Not
    a failure of the ring or of the coordinator: raised to the caller as it is."""


@attrs.frozen
class Committed:
    """Driver -> the request's caller: token ids the target committed, in order (each id
    exactly once; a request's batches joined are its output)."""

    token_ids: tuple[int, ...]


#: What a session's route delivers to its driver.
RouteEvent = Message | Resync


@attrs.frozen
class Completion:
    """A finished request: the committed ids, why it stopped, and what it cost."""

    token_ids: tuple[int, ...]
    finish_reason: str
    stats: RunStats
    receipt: RunReceipt | None = None


@attrs.frozen(eq=False)
class Ended:
    """The last message on a request's channel, after its ``Committed`` batches: its
    completion, or the error that ended it (a ``RingError`` carries the committed tokens)."""

    outcome: Completion | Exception


#: What a request's channel carries: its committed batches, then one ``Ended``.
Piece = Committed | Ended


__all__ = [
    "CallerLeft",
    "Committed",
    "Completion",
    "Ended",
    "Piece",
    "RequestFailed",
    "Resync",
    "RingError",
    "RouteEvent",
]
