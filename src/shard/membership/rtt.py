"""RttTracker: the round-trip time of one control link, measured with ``Probe``/``ProbeReply``.

The scheduler runs one per registered node: every ``interval_s`` it sends a ``Probe`` on the
node's control link, the node echoes a ``ProbeReply`` with the same nonce
(``shard.failover.control``), and the time between the two is one sample. ``rtt_s`` is the
median of the last ``keep`` samples, so one reply delayed by a busy node (or a scheduler
task that ran late) does not move it; placement reads it from ``Scheduler.statistics()``.

The send time is remembered here, by nonce, not read back from the reply: a node cannot make
itself look closer than it is. A probe never answered is forgotten once ``keep * 4`` newer
ones are waiting, so a silent peer costs bounded memory.

For the mesh between joining nodes (``shard.formation``), ``measure_rtt`` dials a
peer's listen address with ``Hello(link="probe")`` and times a few probes there, and
``serve_probes`` is what the peer (a stage node, or the coordinator) answers them with.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable

import trio

from shard.messages import Hello, MeasureRtt, Probe, ProbeReply, RttReport
from shard.transport import Connection, Network, TransportError
from shard.transport.guard import CONNECTION_ERRORS
from shard.transport.links import dial_peer

#: A probe link answers at most this many probes, then closes (a peer cannot keep it forever).
MAX_PROBES = 128
#: A joining node measures at most this many peers (a bigger swarm plans from a subset).
MAX_PEERS = 256


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


async def serve_probes(conn: Connection, *, idle_s: float = 5.0) -> None:
    """Answer each ``Probe`` on a probe link with its ``ProbeReply``, up to ``MAX_PROBES`` or
    until the peer closes, goes quiet for ``idle_s`` or sends anything else (then it ends: a
    probe link carries nothing but probes). Errors: ``TransportError`` from the link."""
    for _ in range(MAX_PROBES):
        with trio.move_on_after(idle_s):
            msg = await conn.receive()
            if not isinstance(msg, Probe):
                return
            await conn.send(ProbeReply(nonce=msg.nonce, sent_at=msg.sent_at))
            continue
        return


async def measure_rtt(
    network: Network,
    address: str,
    hello: Hello,
    *,
    probes: int,
    timeout_s: float,
    clock: Callable[[], float] = trio.current_time,
) -> float | None:
    """The median round trip (seconds) of ``probes`` probes to the node listening at
    ``address``, one after another on one probe link; None when it cannot be reached, or does
    not answer within ``timeout_s`` in all (the handshake included)."""
    tracker_samples: list[float] = []
    with trio.move_on_after(timeout_s):
        try:
            conn = await dial_peer(
                network, address, hello, timeout_s=timeout_s, handshake_timeout_s=timeout_s
            )
        except CONNECTION_ERRORS:
            return None
        try:
            for nonce in range(1, probes + 1):
                sent = clock()
                await conn.send(Probe(nonce=nonce, sent_at=sent))
                reply = await conn.receive()
                if not isinstance(reply, ProbeReply) or reply.nonce != nonce:
                    return None
                tracker_samples.append(clock() - sent)
        except CONNECTION_ERRORS:
            return None
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()
    if len(tracker_samples) < probes:
        return None
    return statistics.median(tracker_samples)


async def measure_row(
    network: Network, hello: Hello, order: MeasureRtt, *, timeout_s: float = 10.0
) -> RttReport:
    """A joining node's row of the mesh: the median round trip (ms) to each address of
    ``order``, all measured at once, each within ``timeout_s`` (-1.0: not reached)."""
    found = [-1.0] * len(order.names)
    probes = max(1, min(order.probes, MAX_PROBES))

    async def one(i: int, address: str) -> None:
        rtt = await measure_rtt(network, address, hello, probes=probes, timeout_s=timeout_s)
        if rtt is not None:
            found[i] = rtt * 1000.0

    async with trio.open_nursery() as nursery:
        for i, address in enumerate(order.addresses[: min(len(order.names), MAX_PEERS)]):
            nursery.start_soon(one, i, address)
    return RttReport(hello.node, order.names, tuple(found))
