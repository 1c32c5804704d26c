"""Coordinator: the router of sessions, and what the requests driving the ring share.

The coordinator holds no transformer layers. Each request gets a session on every stage and a
``RequestDriver`` (``shard.coordinator.driver``) that streams the prompt through the ring and
runs the (speculative) decoding loop until end-of-sequence or ``max_tokens``. Verdicts come
straight back from the tail (direct return) on ``from_ring``; the router hands each one to
the route of the session that owns it, so many sessions interleave through one ring.

The router owns the routes and the shared parts: the ring gate (``shard.coordinator.gate``),
the ledger (statistics, events, the K/D model: ``shard.coordinator.ledger``), receipts and
checkpoints. The scheduler tells it about repairs on ``control`` (``shard.failover.events``).

Chunking is identical to the single-process reference (``shard.decode.reference``), so
greedy output is token-identical to one machine.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence

import attrs
import trio

from shard.coordinator.checkpoint import Checkpointer, RequestCheckpoint
from shard.coordinator.config import (
    CoordinatorAides,
    CoordinatorChannels,
    CoordinatorConfig,
    DriverShared,
    RequestPlan,
)
from shard.coordinator.driver import RequestDriver
from shard.coordinator.events import (
    CallerLeft,
    Committed,
    Completion,
    Resync,
    RingError,
    RouteEvent,
)
from shard.coordinator.gate import RingGate
from shard.coordinator.ledger import CoordinatorStatistics, Ledger
from shard.coordinator.receipts import collect_receipts, kept
from shard.coordinator.supervise import request_failed
from shard.decode.control import SpeculationConfig
from shard.decode.state import BadRequest, DecodeState, check_sampling
from shard.failover.events import Pause, Resume, RingControl, RingLost
from shard.failover.replay import ReplayLog
from shard.messages import (
    SESSION_BITS,
    Fault,
    Message,
    NodeName,
    RunStats,
    Sampling,
    SessionId,
    SpliceRecord,
    StageReceiptOut,
    Verdict,
)
from shard.spec.limits import Limits
from shard.trust.receipts import RunJob

# Verdicts a session's route holds before the router waits: chunks in flight, stale ones.
_SESSION_BUFFER = 16


_NO_AIDES = CoordinatorAides()


class Coordinator:
    """The router: drives requests through the ring.

    ``run`` routes verdicts and faults from the ring to the session's request and applies
    ``control``; ``generate`` serves one request (from many tasks at once). ``statistics``,
    ``reset_statistics`` and ``event``: the ledger's (the status feed's calls).

    Cancellation: cancelling ``generate`` ends its session on the ring (a shielded
    ``EndSession``, bounded by one second); cancelling ``run`` stops routing, and requests
    still waiting see ``RingError``.

    Errors: a ``Fault`` for a session, or for the ring (a dead link), ends the requests it
    touches with ``RingError`` (their committed ids). Anything else on a request's path ends
    it alone (``RequestFailed``); bugs in the router itself propagate.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        channels: CoordinatorChannels,
        aides: CoordinatorAides = _NO_AIDES,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Its records are ``shard.coordinator.config``'s; ``wall_clock`` stamps its
        statistics and receipts."""
        node, speculation = config.node, config.speculation
        self._receipts = aides.receipts
        self._hold = aides.hold
        self._nonces = aides.nonces
        self._feature_dim = config.feature_dim
        self._node = node
        self._eos_ids = config.eos_ids
        self._from_ring = channels.from_ring
        self._control = channels.control
        self._limits = config.limits
        self._drafter = aides.drafter
        self._speculation = speculation
        self._signer = aides.signer
        self._routes: dict[SessionId, trio.MemorySendChannel[RouteEvent]] = {}
        # requests that sign a receipt, with their decode state: a splice is listed in each
        self._jobs: dict[SessionId, tuple[RunJob, DecodeState]] = {}
        sent_log = aides.sent_log if aides.sent_log is not None else ReplayLog()
        self._gate = RingGate(channels.to_ring, sent_log)
        self._ledger = Ledger(node, speculation, wall_clock)
        self._session_ids = itertools.count((config.incarnation << SESSION_BITS) + 1)
        self._checkpoints = aides.checkpoints
        self._slots = trio.Semaphore(config.limits.max_sessions)
        self._shared = DriverShared(
            self._gate, self._ledger, config.limits, aides.drafter, config.feature_dim, aides.hold
        )

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def speculation(self) -> SpeculationConfig:
        """The swarm's K/D policy (requests may override it)."""
        return self._speculation

    @property
    def sent_log(self) -> ReplayLog:
        """What each session sent towards stage 0 (its ring link replays it after a splice)."""
        return self._gate.log

    def statistics(self) -> CoordinatorStatistics:
        stats = self._ledger.statistics()
        return attrs.evolve(stats, ring_down=self.ring_down, repairing=self._gate.repair)

    def reset_statistics(self) -> None:
        """Clear the rolling ring statistics (counters since start are kept)."""
        self._ledger.reset()

    def formed(self, n_stages: int) -> None:
        """A formed swarm's ring has ``n_stages`` stages (run receipts wait for that many)."""
        if self._signer is not None:
            self._signer = attrs.evolve(self._signer, n_stages=n_stages)

    def event(self, kind: str, detail: str) -> None:
        """Record a ring event (join, fault, splice, epoch bump) for the status feed."""
        self._ledger.event(kind, detail)

    @property
    def recovering(self) -> bool:
        """A snapshot: the scheduler is repairing the ring (requests wait, new ones too)."""
        return self._gate.repairing

    def sessions(self) -> int:
        """A snapshot: sessions open on the ring now (the API's admission control)."""
        return self._ledger.sessions

    @property
    def ring_down(self) -> str | None:
        """Why the ring was declared lost (no request can run any more), or None."""
        lost = self._gate.lost
        return None if lost is None else lost.detail

    async def wait_ring_up(self) -> None:
        """Wait until the ring can take requests (not lost, not under repair)."""
        await self._gate.wait_up()

    # --- the router -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._from_ring, trio.open_nursery() as nursery:
            if self._control is not None:
                nursery.start_soon(self._obey, self._control)
            task_status.started()
            async for msg in self._from_ring:
                await self._route(msg)
            nursery.cancel_scope.cancel()

    async def _obey(self, control: trio.MemoryReceiveChannel[RingControl]) -> None:
        """Apply the scheduler's messages; never waits on a request (routes get
        ``send_nowait``), so the scheduler never waits on the router."""
        async with control:
            async for msg in control:
                self._apply(msg)

    def _apply(self, msg: RingControl) -> None:
        if isinstance(msg, Pause):  # requests wait instead of timing out
            self._gate.pause(msg.detail)
            self._ledger.event("fault", msg.detail)
        elif isinstance(msg, Resume):  # every request re-sends from its committed tokens
            self._gate.resume()
            self._ledger.event("splice", msg.detail)
            if (sp := msg.spliced) is not None:
                for job, state in self._jobs.values():
                    replaced, by = NodeName(sp.replaced), NodeName(sp.by)
                    job.spliced(SpliceRecord(sp.first, sp.last, replaced, by, len(state.output)))
            self._notify(Resync(full=False, reason=msg.detail))
        elif isinstance(msg, RingLost):  # every request ends with RingError
            fault = Fault(node=self._node, kind="ring", detail=msg.detail)
            self._gate.resume()
            self._gate.lose(fault, cancel_sends=True)
            self._ledger.event("fault", msg.detail)
            self._notify(fault)
        else:
            self._ledger.event(msg.kind, msg.detail)

    def _notify(self, msg: RouteEvent) -> None:
        for route in list(self._routes.values()):
            try:
                route.send_nowait(msg)
            except trio.WouldBlock:
                pass  # that request has a backlog to read first; its retry timer covers it

    async def _route(self, msg: Message) -> None:
        if isinstance(msg, Verdict | Fault | StageReceiptOut) and msg.session is not None:
            route = self._routes.get(msg.session)
            if route is not None:
                await route.send(msg)
            return
        if isinstance(msg, Fault) and msg.node == self._node:
            # A fault with no session raised by this node's own links is the ring itself
            # failing: every request is affected. (Stages never relay session-less faults.)
            self._gate.lose(msg, cancel_sends=False)
            self._ledger.event("fault", f"{msg.node}: {msg.kind}: {msg.detail}")
            for route in list(self._routes.values()):
                await route.send(msg)

    # --- requests ---------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling = Sampling(),
        tokens: trio.MemorySendChannel[Committed] | None = None,
        speculation: SpeculationConfig | None = None,
        receipt: bool = False,
        request_id: str | None = None,
        ignore_eos: bool = False,
    ) -> Completion:
        """Run one request through the ring; each batch of ids it commits is sent on
        ``tokens`` as one ``Committed`` (the caller reads them in another task, and closes
        the channel when it likes: ``generate`` only sends; ``shard.coordinator.text`` is the
        reader that turns them into text).

        ``ignore_eos`` generates exactly ``max_tokens`` ids: an end-of-sequence id is output
        like any other (benchmarks of a fixed length).

        ``receipt`` asks every stage for a signed receipt of the job and returns the signed
        run receipt in ``Completion.receipt`` (needs a coordinator key: ``signer``).

        ``speculation`` overrides the coordinator's K/D policy for this request (benchmarks
        and tests compare modes on one ring); ``SpeculationConfig(k=0)`` is plain decoding.

        ``request_id`` names the request's checkpoint (with a checkpoint store): its committed
        tokens are saved as they come, and the file is removed when the request ends.

        A call, not a message to the router: the request's driver runs in the caller's own
        task, so a caller that goes away cancels its request (and ends its session).

        Errors: ``BadRequest`` (before touching the ring) for settings that cannot be served;
        ``RingError`` when the ring fails the request; ``RequestFailed`` (a ``RingError``,
        logged once) for anything else on its path; ``CallerLeft`` when the caller closed the
        receive side of ``tokens`` mid-request.
        """
        checkpoint = None
        if request_id is not None and self._checkpoints is not None:
            checkpoint = Checkpointer.fresh(
                self._checkpoints, request_id, prompt_ids, max_tokens, sampling, ignore_eos
            )
        return await self._serve(
            prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling,
            tokens=tokens,
            speculation=speculation or self._speculation,
            receipt=receipt,
            eos_ids=() if ignore_eos else self._eos_ids,
            checkpoint=checkpoint,
        )

    async def _serve(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Sampling,
        tokens: trio.MemorySendChannel[Committed] | None,
        speculation: SpeculationConfig,
        receipt: bool,
        eos_ids: tuple[int, ...],
        checkpoint: Checkpointer | None,
    ) -> Completion:
        """``generate``'s body: the request's life in order (``checkpoint``: its file, kept
        current and removed once it completed)."""
        check_sampling(sampling)
        state = DecodeState.start(
            len(prompt_ids), max_tokens, eos_ids, max_len=self._limits.max_len
        )
        async with self._slots:
            if (lost := self._gate.lost) is not None:
                raise RingError(f"the ring is down: {lost.detail}")
            sid = SessionId(next(self._session_ids))
            route_send, route = trio.open_memory_channel[RouteEvent](_SESSION_BUFFER)
            self._routes[sid] = route_send
            self._ledger.sessions = len(self._routes)
            ended = False
            try:
                signs = receipt or self._receipts is not None
                job = self._job(prompt_ids, sid, state) if signs else None
                if job is not None:
                    self._jobs[sid] = (job, state)
                    if checkpoint is not None:  # a resumed run names what it resumes
                        job.resumes = checkpoint.resumes
                        checkpoint.bind(job.job)
                completion = await self._drive(
                    sid, route, job, prompt_ids, state, sampling, tokens, speculation, checkpoint
                )
                if checkpoint is not None:
                    checkpoint.done()
                if job is not None and self._signer is not None:
                    ended = True
                    await self._gate.end_session(sid)
                    completion = await collect_receipts(
                        job, self._signer, route, completion, self._limits.receipt_timeout_s
                    )
                    completion = await kept(completion, self._receipts, wanted=receipt)
            except RingError:
                self._ledger.request_failed()
                raise
            except (BadRequest, CallerLeft):
                raise
            except Exception as exc:  # this request's alone (shard.coordinator.supervise)
                self._ledger.request_failed()
                raise request_failed(sid, exc, state.output) from exc
            finally:
                del self._routes[sid]
                self._jobs.pop(sid, None)
                self._ledger.sessions = len(self._routes)
                if not ended:
                    await self._gate.end_session(sid)
                self._gate.ended(sid)
        self._ledger.request_done()
        return completion

    def _job(self, prompt_ids: Sequence[int], sid: SessionId, state: DecodeState) -> RunJob:
        if self._signer is None:
            raise BadRequest("this coordinator has no key to sign receipts with")
        nonce = self._nonces(sid) if self._nonces is not None else os.urandom(16)
        return RunJob.start(prompt_ids, nonce, max_tokens=state.max_tokens, stop_ids=state.eos_ids)

    async def _drive(
        self,
        sid: SessionId,
        route: trio.MemoryReceiveChannel[RouteEvent],
        job: RunJob | None,
        prompt_ids: Sequence[int],
        state: DecodeState,
        sampling: Sampling,
        tokens: trio.MemorySendChannel[Committed] | None,
        speculation: SpeculationConfig,
        checkpoint: Checkpointer | None,
    ) -> Completion:
        """Run the session's driver in this task (a nursery of one child would only wrap
        what it raises in a group). Errors: the ``RingError`` it ended with."""
        plan = RequestPlan(sid, job, prompt_ids, state, sampling, speculation, checkpoint)
        return await RequestDriver(self._shared, plan, route, tokens).run()

    async def resume_request(
        self,
        checkpoint: RequestCheckpoint,
        *,
        tokens: trio.MemorySendChannel[Committed] | None = None,
        speculation: SpeculationConfig | None = None,
        receipt: bool = False,
    ) -> Completion:
        """Continue a request a previous coordinator checkpointed: the committed tokens are
        kept, the rest is generated on the ring (``tokens`` gets only the new ones). The
        returned completion holds every output token, old and new. ``receipt``: a receipt
        of this run (the new tokens), naming the request it resumes (``RunReceipt.resumes``).

        Errors: as ``generate``; the checkpoint stays until the request ends.
        """
        done, left = checkpoint.output_ids, checkpoint.max_tokens - len(checkpoint.output_ids)
        eos_ids = () if checkpoint.ignore_eos else self._eos_ids  # as its first run had them
        store = self._checkpoints
        if left <= 0 or (done and done[-1] in eos_ids):
            if store is not None:
                store.done(checkpoint.request)
            reason = "stop" if done and done[-1] in eos_ids else "length"
            return Completion(done, reason, RunStats(0, 0.0, 0.0, 0.0, 0, 0.0))
        rest = await self._serve(
            (*checkpoint.prompt_ids, *checkpoint.output_ids),
            max_tokens=left,
            sampling=checkpoint.sampling,
            tokens=tokens,
            speculation=speculation or self._speculation,
            receipt=receipt,
            eos_ids=eos_ids,
            checkpoint=None if store is None else Checkpointer(store, checkpoint),
        )
        return attrs.evolve(rest, token_ids=(*checkpoint.output_ids, *rest.token_ids))


__all__ = ["Completion", "Coordinator", "CoordinatorStatistics", "Resync", "RingError"]
