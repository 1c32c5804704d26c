"""Coordinator: sessions, and what the requests driving the ring share.

The coordinator holds no transformer layers. Each request gets a session on every stage and a
``RequestDriver`` (``shard.coordinator.driver``) that streams the prompt through the ring and runs
the
(speculative) decoding loop until end-of-sequence or ``max_tokens``. Verdicts come straight
back from the tail (direct return) on ``from_ring``; a router task hands each one to the
request that owns its session, so many sessions interleave through one ring. The coordinator
owns the shared parts: the routes, the send side of the ring link (and the log of what each
session sent), the K/D model, statistics and events, receipts, checkpoints, and the hooks the
scheduler (``shard.failover.scheduler``) uses to pause, resume or fail the requests during a repair.

Chunking is identical to the single-process reference (``shard.decode.reference``): the same prefill
chunk size, then one position per step, so greedy output is token-identical to one machine.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import trio

from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.driver import (
    Completion,
    OnTokens,
    RequestDriver,
    Resync,
    RingDown,
    RingError,
)
from shard.decode.control import RunLengths, SpecConfig, SpecController
from shard.decode.draft import Drafter
from shard.decode.speculation import Outcome
from shard.decode.state import BadRequest, DecodeState, check_sampling
from shard.failover.replay import LoggedChunk, ReplayLog
from shard.messages import (
    SESSION_BITS,
    EndSession,
    Fault,
    Message,
    NodeName,
    RunStats,
    Sampling,
    SessionId,
    StageReceiptOut,
    Verdict,
)
from shard.observe.ringstats import LapRecorder, RingEvent, RingMonitor, RingStatistics
from shard.spec.limits import Limits
from shard.trust.receipts import EdgeRecord, RunJob, RunSigner

# Verdicts a session's route can hold before the router waits: the chunks in flight
# (depth_max) plus stale ones still arriving after a rejection, and a late Fault.
_SESSION_BUFFER = 16
_EVENTS_KEPT = 64


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
        limits: Limits = Limits(),
        drafter: Drafter | None = None,
        speculation: SpecConfig = SpecConfig(),
        signer: RunSigner | None = None,
        wall_clock: Callable[[], float] = time.time,
        checkpoints: CheckpointStore | None = None,
        incarnation: int = 0,
        sent_log: ReplayLog | None = None,
    ) -> None:
        """``checkpoints`` keeps each running request's committed tokens on disk (so a
        restarted coordinator can ``resume_request`` it); ``incarnation`` goes into the high bits of
        session ids, so a restarted coordinator's sessions never collide with the ones its
        predecessor left on the stages (which drop those: ``shard.stage.executor``). ``sent_log`` is
        the log of what each session sent (default: a fresh one)."""
        self._node = node
        self._eos_ids = tuple(eos_ids)
        self._to_ring = to_ring
        self._from_ring = from_ring
        self._limits = limits
        self._wall_clock = wall_clock
        self._drafter = drafter
        self._spec = speculation
        self._signer = signer
        self._jobs: dict[SessionId, RunJob] = {}
        self._k, self._depth = 0, 1
        self._routes: dict[SessionId, trio.MemorySendChannel[Message | Resync]] = {}
        # What each session sent, in order: full re-sends come from here, and the ring link
        # replays it to a standby that replaces stage 0 (one log, kept here: ``sent_log``).
        self._sent = sent_log if sent_log is not None else ReplayLog()
        # K/D policy state shared by requests: timings and acceptance by run length
        self._control = SpecController(speculation, runs=RunLengths())
        self._recovering: str | None = None
        self._sending: set[trio.CancelScope] = set()
        self._session_ids = itertools.count((incarnation << SESSION_BITS) + 1)
        self._checkpoints = checkpoints
        self._slots = trio.Semaphore(limits.max_sessions)
        self._ring_fault: Fault | None = None
        self._done = 0
        self._failed = 0
        self._tokens = 0
        self._stale = 0
        self._monitor = RingMonitor(node)
        self._events: deque[RingEvent] = deque(maxlen=_EVENTS_KEPT)

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def speculation(self) -> SpecConfig:
        """The swarm's K/D policy (requests may override it)."""
        return self._spec

    def statistics(self) -> CoordinatorStatistics:
        return CoordinatorStatistics(
            node=self._node,
            sessions_open=len(self._routes),
            requests_done=self._done,
            requests_failed=self._failed,
            tokens=self._tokens,
            k=self._k,
            depth=self._depth,
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

    # --- what a request's driver uses (shard.coordinator.driver.RingPort) -------------------------

    @property
    def sent_log(self) -> ReplayLog:
        """What each session sent towards stage 0 (its ring link replays it after a splice)."""
        return self._sent

    @property
    def node(self) -> NodeName:
        return self._node

    @property
    def recovering(self) -> bool:
        """The scheduler is repairing the ring: requests wait instead of timing out."""
        return self._recovering is not None

    def wall_clock(self) -> float:
        return self._wall_clock()

    def job(self, sid: SessionId) -> RunJob | None:
        return self._jobs.get(sid)

    def sent_chunks(self, sid: SessionId) -> tuple[LoggedChunk, ...]:
        return self._sent.chunks(sid)

    def control_for(self, spec: SpecConfig) -> SpecController:
        """A K/D controller for a new request, starting from the last one's measurements."""
        self._control = self._control.carry(spec)
        return self._control

    def note_stale(self) -> None:
        self._stale += 1

    def sessions(self) -> int:
        return len(self._routes)

    def note_kd(self, k: int, depth: int) -> None:
        self._k, self._depth = k, depth

    # --- what the scheduler asks (shard.failover.scheduler.RingHooks) -----------------------------

    def pause(self, detail: str) -> None:
        """The ring is being repaired: requests wait instead of timing out."""
        self._recovering = detail
        self.event("fault", detail)

    async def resume(self, detail: str) -> None:
        """The ring is whole again: every request re-sends from its committed tokens (a ring
        that was given up is usable again: a lost node came back into its slot)."""
        self._recovering = None
        self._ring_fault = None
        self.event("splice", detail)
        self._notify(Resync(full=False, reason=detail))

    async def fail(self, detail: str) -> None:
        """The ring cannot be repaired: every request ends with ``RingError``."""
        self._recovering = None
        self._ring_fault = Fault(node=self._node, kind="ring", detail=detail)
        self.event("fault", detail)
        self._notify(self._ring_fault)
        for scope in self._sending:
            scope.cancel()  # a send waiting on a ring link that will never be rewired

    def _notify(self, msg: Message | Resync) -> None:
        for route in list(self._routes.values()):
            try:
                route.send_nowait(msg)
            except trio.WouldBlock:
                pass  # that request has a backlog to read first; its retry timer covers it

    async def send(self, msg: Message) -> None:
        """Send towards stage 0. Errors: ``RingDown`` once the ring is declared lost (also
        while this send waits on a link being repaired)."""
        if self._ring_fault is None:
            with trio.CancelScope() as scope:
                self._sending.add(scope)
                try:
                    self._sent.record(msg)
                    await self._to_ring.send(msg)
                    return
                finally:
                    self._sending.discard(scope)
        assert self._ring_fault is not None
        raise RingDown(f"the ring is down: {self._ring_fault.detail}")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._from_ring:
            task_status.started()
            async for msg in self._from_ring:
                await self._route(msg)

    async def _route(self, msg: Message) -> None:
        if isinstance(msg, Verdict | Fault | StageReceiptOut) and msg.session is not None:
            route = self._routes.get(msg.session)
            if route is not None:
                await route.send(msg)
            return
        if isinstance(msg, Fault) and msg.node == self._node:
            # A fault with no session raised by this node's own links is the ring itself
            # failing: every request is affected. (Stages never relay session-less faults.)
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
        speculation: SpecConfig | None = None,
        receipt: bool = False,
        request_id: str | None = None,
        ignore_eos: bool = False,
    ) -> Completion:
        """Run one request through the ring; ``on_tokens`` sees ids as they are committed.

        ``ignore_eos`` generates exactly ``max_tokens`` ids: an end-of-sequence id is output
        like any other (benchmarks of a fixed length).

        ``receipt`` asks every stage for a signed receipt of the job and returns the signed
        run receipt in ``Completion.receipt`` (needs a coordinator key: ``signer``).

        ``speculation`` overrides the coordinator's K/D policy for this request (benchmarks
        and tests compare modes on one ring); ``SpecConfig(k=0)`` is plain decoding.

        ``request_id`` names the request's checkpoint (with a checkpoint store): its committed
        tokens are saved as they come, and the file is removed when the request ends.

        Errors: ``BadRequest`` (before touching the ring) for settings that cannot be served;
        ``RingError`` when the ring fails the request.
        """
        check_sampling(sampling)
        eos_ids = () if ignore_eos else self._eos_ids
        state = DecodeState.start(
            len(prompt_ids), max_tokens, eos_ids, max_len=self._limits.max_len
        )
        async with self._slots:
            if self._ring_fault is not None:
                raise RingError(f"the ring is down: {self._ring_fault.detail}")
            sid = SessionId(next(self._session_ids))
            send, recv = trio.open_memory_channel[Message | Resync](_SESSION_BUFFER)
            self._routes[sid] = send
            if receipt:
                if self._signer is None:
                    raise BadRequest("this coordinator has no key to sign receipts with")
                self._jobs[sid] = RunJob.start(prompt_ids, os.urandom(16))
            ended = False
            try:
                driver = RequestDriver(
                    self,
                    sid=sid,
                    verdicts=recv,
                    prompt_ids=prompt_ids,
                    state=state,
                    sampling=sampling,
                    on_tokens=self._checkpointing(
                        request_id, prompt_ids, max_tokens, sampling, on_tokens
                    ),
                    spec=speculation or self._spec,
                    limits=self._limits,
                    drafter=self._drafter,
                )
                completion = await driver.drive()
                if request_id is not None and self._checkpoints is not None:
                    self._checkpoints.done(request_id)
                if receipt:
                    ended = True
                    completion = await self._collect_receipts(sid, recv, completion)
            except RingDown as exc:
                self._failed += 1
                raise RingError(str(exc), committed=state.output) from None
            except RingError:
                self._failed += 1
                raise
            finally:
                del self._routes[sid]
                self._jobs.pop(sid, None)
                if not ended:
                    await self._end_session(sid)
                self._sent.record(EndSession(session=sid))
        self._done += 1
        return completion

    def _checkpointing(
        self,
        request_id: str | None,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: Sampling,
        on_tokens: OnTokens | None,
    ) -> OnTokens | None:
        store = self._checkpoints
        if request_id is None or store is None:
            return on_tokens
        output: list[int] = []
        prompt = tuple(int(t) for t in prompt_ids)

        async def emit(ids: list[int]) -> None:
            output.extend(ids)
            store.save(RequestCheckpoint(request_id, prompt, tuple(output), max_tokens, sampling))
            if on_tokens is not None:
                await on_tokens(ids)

        return emit

    async def resume_request(
        self,
        checkpoint: RequestCheckpoint,
        *,
        on_tokens: OnTokens | None = None,
        speculation: SpecConfig | None = None,
    ) -> Completion:
        """Continue a request a previous coordinator checkpointed: the committed tokens are
        kept, the rest is generated on the ring (``on_tokens`` sees only the new ones). The
        returned completion holds every output token, old and new.

        Errors: as ``generate``; the checkpoint stays until the request ends.
        """
        done = checkpoint.output_ids
        left = checkpoint.max_tokens - len(done)
        if left <= 0 or (done and done[-1] in self._eos_ids):
            if self._checkpoints is not None:
                self._checkpoints.done(checkpoint.request)
            reason = "stop" if done and done[-1] in self._eos_ids else "length"
            return Completion(done, reason, RunStats(0, 0.0, 0.0, 0.0, 0, 0.0))
        store = self._checkpoints

        async def emit(ids: list[int]) -> None:
            nonlocal done
            done = (*done, *ids)
            if store is not None:
                store.save(attrs.evolve(checkpoint, output_ids=done))
            if on_tokens is not None:
                await on_tokens(ids)

        rest = await self.generate(
            (*checkpoint.prompt_ids, *checkpoint.output_ids),
            max_tokens=left,
            sampling=checkpoint.sampling,
            on_tokens=emit,
            speculation=speculation,
        )
        if store is not None:
            store.done(checkpoint.request)
        return attrs.evolve(rest, token_ids=(*checkpoint.output_ids, *rest.token_ids))

    async def _end_session(self, sid: SessionId) -> None:
        """Free the session on every stage; shielded and bounded (runs during cancellation)."""
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                await self._to_ring.send(EndSession(session=sid))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the ring link is gone: there is no session left to end

    async def _collect_receipts(
        self,
        sid: SessionId,
        route: trio.MemoryReceiveChannel[Message | Resync],
        completion: Completion,
    ) -> Completion:
        """End the session, gather every stage's receipt (recording the verdicts still in
        flight, which the tail's chain includes), and sign the run receipt."""
        job, signer = self._jobs[sid], self._signer
        assert signer is not None
        await self._end_session(sid)
        with trio.move_on_after(self._limits.receipt_timeout_s) as waited:
            while len(job.stages) < signer.n_stages:
                msg = await route.receive()
                if isinstance(msg, Verdict):
                    job.received_verdict(
                        msg.epoch, msg.seq, msg.start, msg.target_ids, msg.accepted
                    )
                elif isinstance(msg, StageReceiptOut):
                    job.stage_receipt(msg.receipt)
                elif isinstance(msg, Fault) and msg.kind != "gap":
                    raise RingError(f"{msg.node}: {msg.detail}", committed=completion.token_ids)
                elif isinstance(msg, Resync):
                    raise RingError(
                        f"the ring was repaired before every receipt arrived ({msg.reason}); "
                        "receipts do not span a splice",
                        committed=completion.token_ids,
                    )
        if waited.cancelled_caught:
            raise RingError(
                f"only {len(job.stages)} of {signer.n_stages} stage receipts arrived",
                committed=completion.token_ids,
            )
        stats = completion.stats
        run = job.finish(
            signer,
            output_ids=completion.token_ids,
            edges=[EdgeRecord(e.src, e.dst, round(e.mean_s, 6)) for e in stats.edges],
            tok_s=stats.tok_s,
            alpha=stats.accepted / stats.drafted if stats.drafted else None,
        )
        return attrs.evolve(completion, receipt=run)

    def lap(
        self, laps: LapRecorder, verdict: Verdict, *, committed: int, outcome: Outcome | None = None
    ) -> None:
        lap_s, sent_wall = laps.received(verdict.seq, verdict.hops, outcome)
        self._monitor.lap(
            lap_s=lap_s,
            sent_wall=sent_wall,
            arrived_wall=self._wall_clock(),
            hops=verdict.hops,
            committed=committed,
            drafted=outcome.drafted if outcome else 0,
            accepted=outcome.accepted if outcome else 0,
        )

    async def emit(self, ids: Sequence[int], on_tokens: OnTokens | None) -> None:
        self._tokens += len(ids)
        self._monitor.committed(trio.current_time(), len(ids))
        if ids and on_tokens is not None:
            await on_tokens(list(ids))


__all__ = ["Completion", "Coordinator", "Resync", "RingError"]
