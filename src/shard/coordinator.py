"""Coordinator: sessions and the decoding loop that drives the ring.

The coordinator holds no transformer layers. For each request it opens a session on every
stage, streams the prompt through the ring in prefill chunks, then feeds one position per lap
(plain decoding) until the tail's verdicts reach end-of-sequence or ``max_tokens``. Verdicts
come straight back from the tail (direct return) on ``from_ring``; a router task hands each one
to the request that owns its session, so many sessions interleave through one ring.

Chunking is identical to the single-process reference (``shard.reference``): the same prefill
chunk size, then one position per step, so greedy output is token-identical to one machine.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.decoding import DecodeState, check_sampling
from shard.messages import (
    ChunkSeq,
    EndSession,
    Epoch,
    Fault,
    GenerateDone,
    Hop,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    RunStats,
    Sampling,
    SessionId,
    Verdict,
    Verify,
)
from shard.ringstats import LapRecorder, RingEvent, RingMonitor, RingStatistics

# A session never has more than one verdict outstanding with plain decoding; the buffer of 4
# only absorbs a late Fault arriving next to a Verdict without blocking the router.
_SESSION_BUFFER = 4
_EVENTS_KEPT = 64


class RingError(Exception):
    """The ring could not finish a request (a stage fault or a broken link).

    ``committed`` holds the token ids committed before the failure: nothing is lost silently.
    """

    def __init__(self, message: str, committed: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.committed = tuple(committed)


@attrs.frozen
class CoordinatorLimits:
    max_len: int = 2048
    prefill_chunk: int = 128
    max_sessions: int = 16


@attrs.frozen
class Completion:
    """A finished request: the committed ids, why it stopped, and what it cost."""

    token_ids: tuple[int, ...]
    finish_reason: str
    stats: RunStats


@attrs.frozen
class CoordinatorStatistics:
    """The coordinator's counters plus the rolling view of the ring (``ring``).

    ``k`` is the current draft length (0: plain decoding) and ``depth`` the verify chunks kept
    in flight per session; ``events`` are the most recent ring events, oldest first.
    """

    node: NodeName
    sessions_open: int
    requests_done: int
    requests_failed: int
    tokens: int
    k: int
    depth: int
    stale_dropped: int
    ring: RingStatistics
    events: tuple[RingEvent, ...]


OnTokens = Callable[[list[int]], Awaitable[None]]


class Coordinator:
    """Drives requests through the ring.

    ``run`` routes verdicts and faults from the ring to the request that owns the session;
    ``generate`` serves one request and may be called from many tasks at once.

    Cancellation: cancelling ``generate`` ends its session on the ring (a shielded
    ``EndSession``, bounded by one second); cancelling ``run`` stops routing, and requests
    still waiting see ``RingError``.

    Errors: a ``Fault`` for a session, or one for the whole ring (a dead link), ends the
    affected requests with ``RingError`` carrying the committed ids. Bugs propagate.
    """

    def __init__(
        self,
        *,
        node: NodeName,
        eos_ids: Sequence[int],
        to_ring: trio.MemorySendChannel[Message],
        from_ring: trio.MemoryReceiveChannel[Message],
        limits: CoordinatorLimits = CoordinatorLimits(),
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._node = node
        self._eos_ids = tuple(eos_ids)
        self._to_ring = to_ring
        self._from_ring = from_ring
        self._limits = limits
        self._wall_clock = wall_clock
        self._routes: dict[SessionId, trio.MemorySendChannel[Message]] = {}
        self._session_ids = itertools.count(1)
        self._slots = trio.Semaphore(limits.max_sessions)
        self._ring_fault: Fault | None = None
        self._done = 0
        self._failed = 0
        self._tokens = 0
        self._stale = 0
        self._monitor = RingMonitor(node)
        self._events: deque[RingEvent] = deque(maxlen=_EVENTS_KEPT)

    @property
    def limits(self) -> CoordinatorLimits:
        return self._limits

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(
            node=self._node,
            sessions_open=len(self._routes),
            requests_done=self._done,
            requests_failed=self._failed,
            tokens=self._tokens,
            k=0,
            depth=1,
            stale_dropped=self._stale,
            ring=self._monitor.snapshot(trio.current_time()),
            events=tuple(self._events),
        )

    def reset_statistics(self) -> None:
        """Clear the rolling ring statistics (counters since start are kept)."""
        self._monitor.reset()

    def event(self, kind: str, detail: str) -> None:
        """Record a ring event (join, fault, splice, epoch bump) for the status feed."""
        self._events.append(RingEvent(at=self._wall_clock(), kind=kind, detail=detail))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._from_ring:
            task_status.started()
            async for msg in self._from_ring:
                await self._route(msg)

    async def _route(self, msg: Message) -> None:
        if isinstance(msg, Verdict | Fault) and msg.session is not None:
            route = self._routes.get(msg.session)
            if route is not None:
                await route.send(msg)
            return
        if isinstance(msg, Fault):
            # A fault with no session is the ring itself failing: every request is affected.
            self._ring_fault = msg
            self.event("fault", f"{msg.node}: {msg.kind}: {msg.detail}")
            for route in list(self._routes.values()):
                await route.send(msg)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling = Sampling(),
        on_tokens: OnTokens | None = None,
    ) -> Completion:
        """Run one request through the ring; ``on_tokens`` sees ids as they are committed.

        Errors: ``BadRequest`` (before touching the ring) for settings that cannot be served;
        ``RingError`` when the ring fails the request.
        """
        check_sampling(sampling)
        state = DecodeState.start(
            len(prompt_ids), max_tokens, self._eos_ids, max_len=self._limits.max_len
        )
        async with self._slots:
            if self._ring_fault is not None:
                raise RingError(f"the ring is down: {self._ring_fault.detail}")
            sid = SessionId(next(self._session_ids))
            send, recv = trio.open_memory_channel[Message](_SESSION_BUFFER)
            self._routes[sid] = send
            try:
                completion = await self._drive(sid, recv, prompt_ids, state, sampling, on_tokens)
            except RingError:
                self._failed += 1
                raise
            finally:
                del self._routes[sid]
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await self._to_ring.send(EndSession(session=sid))
        self._done += 1
        return completion

    async def _drive(
        self,
        sid: SessionId,
        verdicts: trio.MemoryReceiveChannel[Message],
        prompt_ids: Sequence[int],
        state: DecodeState,
        sampling: Sampling,
        on_tokens: OnTokens | None,
    ) -> Completion:
        epoch = Epoch(0)
        seq = itertools.count()
        laps = LapRecorder(self._node, self._wall_clock)
        await self._to_ring.send(
            OpenSession(session=sid, max_len=self._limits.max_len, sampling=sampling)
        )
        chunk = self._limits.prefill_chunk
        starts = range(0, len(prompt_ids), chunk)
        laps.sent()
        for start in starts:
            ids = tuple(int(t) for t in prompt_ids[start : start + chunk])
            final = start == starts[-1]
            await self._to_ring.send(
                Prefill(sid, epoch, ChunkSeq(next(seq)), start=start, final=final, ids=ids)
            )
        while True:
            verdict = await self._next_verdict(verdicts, state)
            lap_s, sent_wall = laps.received(verdict.hops)
            emitted = state.commit(verdict.target_ids)
            self._tokens += len(emitted)
            now = trio.current_time()
            self._monitor.lap(
                lap_s=lap_s,
                sent_wall=sent_wall,
                arrived_wall=self._wall_clock(),
                hops=verdict.hops,
                committed=len(verdict.target_ids),
                drafted=0,
                accepted=0,
            )
            self._monitor.committed(now, len(emitted))
            if emitted and on_tokens is not None:
                await on_tokens(emitted)
            if state.done:
                break
            last = state.output[-1]
            laps.sent()
            await self._to_ring.send(
                Verify(sid, epoch, ChunkSeq(next(seq)), start=state.position - 1, ids=(last,))
            )
        assert state.finish_reason is not None
        return Completion(
            token_ids=tuple(state.output),
            finish_reason=state.finish_reason,
            stats=laps.stats(len(state.output)),
        )

    async def _next_verdict(
        self, verdicts: trio.MemoryReceiveChannel[Message], state: DecodeState
    ) -> Verdict:
        msg = await verdicts.receive()
        if isinstance(msg, Fault):
            self.event("fault", f"{msg.node}: {msg.kind}: {msg.detail} (session {msg.session})")
            raise RingError(f"{msg.node}: {msg.kind}: {msg.detail}", committed=state.output)
        assert isinstance(msg, Verdict)
        return msg


def done_message(request: int, completion: Completion, text: str) -> GenerateDone:
    """The client-facing end of a request."""
    return GenerateDone(
        request=request,
        token_ids=completion.token_ids,
        text=text,
        finish_reason=completion.finish_reason,
        stats=completion.stats,
    )


def error_message(
    request: int, exc: Exception, committed: Sequence[int], text: str
) -> GenerateDone:
    """A request that could not finish: ``finish_reason="error"`` and the committed text."""
    return GenerateDone(
        request=request,
        token_ids=tuple(committed),
        text=text,
        finish_reason="error",
        stats=RunStats(
            tokens=len(committed),
            seconds=0.0,
            tok_s=0.0,
            prefill_s=0.0,
            laps=0,
            mean_lap_s=math.nan,
        ),
        error=str(exc),
    )


__all__ = ["Completion", "Coordinator", "CoordinatorLimits", "Hop", "RingError"]
