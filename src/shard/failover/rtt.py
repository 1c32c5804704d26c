"""RttTracker: the round-trip time of one control link, measured with ``Probe``/``ProbeReply``.

The scheduler runs one per registered node: every ``interval_s`` it sends a ``Probe`` on the
node's control link, the node echoes a ``ProbeReply`` with the same nonce
(``shard.failover.control``), and the time between the two is one sample. ``rtt_s`` is the
median of the last ``keep`` samples, so one reply delayed by a busy node (or a scheduler
task that ran late) does not move it; placement reads it from ``Scheduler.statistics()``.

The send time is remembered here, by nonce, not read back from the reply: a node cannot make
itself look closer than it is. A probe never answered is forgotten once ``keep * 4`` newer
ones are waiting, so a silent peer costs bounded memory.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable

import trio

from shard.messages import Probe, ProbeReply
from shard.transport import Connection, TransportError


class RttTracker:
    """Probes ``conn`` every ``interval_s`` (``run``) and keeps the replies' round-trip times.

    ``clock`` is the scheduler's (``trio.current_time`` by default, so virtual under
    ``MockClock``). Cancellation: cancelling ``run`` stops probing; samples stay readable.
    Errors: ``run`` returns when the connection fails (the link's reader sees the close).
    """

    def __init__(
        self,
        conn: Connection,
        *,
        interval_s: float = 1.0,
        keep: int = 5,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if keep < 1 or not interval_s > 0:
            raise ValueError(f"keep {keep} must be >= 1 and interval {interval_s!r} s > 0")
        self._conn = conn
        self._interval_s = interval_s
        self._clock = clock
        self._samples: deque[float] = deque(maxlen=keep)
        self._pending: dict[int, float] = {}
        self._max_pending = keep * 4
        self._nonces = itertools.count(1)

    @property
    def rtt_s(self) -> float | None:
        """The median of the last ``keep`` round trips, in seconds; None before the first."""
        return statistics.median(self._samples) if self._samples else None

    @property
    def samples(self) -> tuple[float, ...]:
        """The round trips that ``rtt_s`` is the median of, oldest first."""
        return tuple(self._samples)

    def probe(self) -> Probe:
        """A new probe to send now (its send time is remembered)."""
        nonce, now = next(self._nonces), self._clock()
        self._pending[nonce] = now
        while len(self._pending) > self._max_pending:
            del self._pending[next(iter(self._pending))]  # the oldest: never answered
        return Probe(nonce=nonce, sent_at=now)

    def on_reply(self, reply: ProbeReply) -> float | None:
        """Take one reply: its round trip in seconds, or None for a nonce not (or no longer)
        waiting (a duplicate, a forgotten probe, or one this tracker never sent)."""
        sent_at = self._pending.pop(reply.nonce, None)
        if sent_at is None:
            return None
        sample = self._clock() - sent_at
        self._samples.append(sample)
        return sample

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._conn.send(self.probe())
                await trio.sleep(self._interval_s)
        except TransportError:
            return
