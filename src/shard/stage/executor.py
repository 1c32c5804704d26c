"""StageExecutor: one contiguous block of layers, its per-session KV caches, and (at the tail)
the target's choice.

The executor reads chunks from its inbox in order (frames on one edge are FIFO), runs its
block, and writes to its outbox: hidden states for the next stage, or — at the tail — a small
``Verdict`` of token ids that goes straight back to the coordinator (direct return), with the
drafts of the checkpoint's MTP block for a session that asks (``shard.stage.tail_drafts``).
Control messages (``OpenSession``, ``EndSession``) travel the ring in the same FIFO order as
chunks, so a session's KV exists before its first chunk and is freed after its last.

A chunk at ``start`` writes K/V at ``[start, start+n)`` and attends to everything before, so
rollback after a rejected draft is just a later chunk overwriting the same positions.

Chunks of different sessions waiting together run in one forward (``shard.stage.batch``:
packed rows, each session keeping its own KV cache); each gets its own checks, output, ``Hop``,
receipt entry and fault, exactly as if it had run alone."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import attrs
import torch
import trio

from shard.compute import offload
from shard.decode.state import BadRequest, check_sampling
from shard.messages import (
    EndSession,
    Epoch,
    Fault,
    Hop,
    Message,
    OpenSession,
    Prefill,
    SessionId,
    StageReceiptOut,
    Truncate,
    Verdict,
    Verify,
    incarnation_of,
)
from shard.model.llama import StageModel
from shard.stage.batch import (
    Answer,
    Carried,
    Planned,
    Queued,
    forward_batch,
    gather,
    is_chunk,
    rows_of,
)
from shard.stage.chunks import (
    Session,
    StageFailed,
    features_refusal,
    is_replay,
    kv_refusal,
    output,
    plan,
)
from shard.stage.config import ExecutorConfig, StageAides
from shard.stage.statistics import StageStatistics
from shard.stage.tail_drafts import drafts_refusal
from shard.trust.receipts import payload_of, verdict_payload

log = logging.getLogger(__name__)

_LOOKAHEAD = 64
_EPOCHS_KEPT = 4  # epochs remembered per allowed session (see _note_epoch)
_ACTIVE_S = 2.0  # a session seen here this recently (seconds) is one a gather may wait for


class StageExecutor:
    """Runs one block of layers for every session passing through this node.

    Cancellation: cancelling ``run`` abandons the chunk being computed only after its worker
    thread returns (the thread is never killed mid-forward); caches are dropped with the actor.

    Errors: a chunk that cannot be computed (a shape that does not fit, a position past the
    session's KV length) becomes a ``Fault`` of kind ``chunk`` sent downstream — the tail
    relays it to the coordinator — and the executor keeps serving other sessions. A chunk this
    node lacks the KV for (an unknown session, or a start past the positions written so far:
    frames were lost on a failed link) is never computed on garbage: it becomes a ``gap`` fault,
    which the coordinator answers by re-sending the session. A closed inbox ends ``run``
    normally; bugs propagate.

    Replayed chunks (``Prefill.replay``, after a splice) are computed into the KV and go no
    further; a repeated ``OpenSession`` keeps the session's KV. An ``OpenSession`` asking for
    more than ``max_len`` positions (the spec's ``limits.max_len``) or with sampling settings
    that mean nothing is refused with a ``request`` fault, so KV memory stays within
    ``max_sessions`` x ``max_len`` whatever a peer asks (so are features it cannot give:
    ``chunks.features_refusal``); with ``kv_budget_bytes`` an ``OpenSession`` whose KV would
    take the open sessions' total past it is a ``capacity`` fault, nothing allocated.

    Batching: every chunk waiting in the local queue (up to ``max_batch_rows`` rows; with
    ``gather_window_s`` > 0 it also waits up to that long for the chunks of sessions seen here
    in the last ``_ACTIVE_S``, never for a lone session's) runs in one forward; a control
    message ends the gather and is handled after the batch (``shard.stage.batch``). A stale
    chunk is dropped from its batch, a chunk that fails its checks becomes its own fault,
    and the others run. ``max_batch_rows = 1`` turns batching off.
    """

    def __init__(
        self,
        model: StageModel,
        config: ExecutorConfig,
        inbox: trio.MemoryReceiveChannel[Message],
        outbox: trio.MemorySendChannel[Message],
        *,
        limiter: trio.CapacityLimiter | None = None,
        clock: Callable[[], float] = time.time,
        aides: StageAides | None = None,
    ) -> None:
        self._max_batch_rows = config.max_batch_rows
        self._gather_window_s = config.gather_window_s
        self._kv_budget = config.kv_budget_bytes
        self._model = model
        aides = aides if aides is not None else StageAides()
        self._graphs = aides.graphs  # None: every chunk eager (StageModel.forward)
        self._drafts = aides.drafts  # the tail's MTP block (``OpenSession.drafts``), or None
        self._receipts = aides.receipts
        self._node = config.node
        self._inbox = inbox
        self._outbox = outbox
        self._max_sessions = config.max_sessions
        # A session's KV length is capped by the swarm's limits.max_len (KV memory is
        # max_sessions x max_len whatever an OpenSession asks) and by the model's context.
        context = model.config.max_position_embeddings
        self._max_len = context if config.max_len is None else min(config.max_len, context)
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        # Hop stamps are wall-clock so that hops from different processes line up on one host;
        # they are reported, never used to decide anything.
        self._clock = clock
        self._sessions: dict[SessionId, Session] = {}
        self._chunks = 0
        self._positions = 0
        self._compute_s = 0.0
        self._faults = 0
        self._stale = 0
        self._epochs: dict[SessionId, int] = {}
        self._retired: deque[int] = deque(maxlen=64)  # incarnations of previous coordinators
        self._forwards = 0
        self._max_rows = 0
        self._queued_s = 0.0
        self._started = clock()

    def statistics(self) -> StageStatistics:
        return StageStatistics(
            node=self._node,
            first=self._model.first,
            last=self._model.last,
            sessions=len(self._sessions),
            chunks=self._chunks,
            positions=self._positions,
            compute_s=self._compute_s,
            faults=self._faults,
            stale_skipped=self._stale,
            kv_bytes=self._kv_bytes(),
            forwards=self._forwards,
            max_batch_rows=self._max_rows,
            forwards_per_s=self._forwards / max(self._clock() - self._started, 1e-9),
            queued_s=self._queued_s,
            session_queued_s=tuple(
                (sid, s.queued_s / s.chunks) for sid, s in self._sessions.items() if s.chunks
            ),
        )

    def _kv_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The local queue lets the reader look past frames waiting to be computed: when a
        # newer epoch of a session arrives, queued frames of older epochs are skipped
        # (early cancellation). Its size bounds how far ahead the reader may run.
        queue_send, queue_recv = trio.open_memory_channel[Queued](_LOOKAHEAD)
        async with self._inbox, self._outbox, trio.open_nursery() as nursery:
            nursery.start_soon(self._read, queue_send)
            task_status.started()
            async with queue_recv:
                await self._serve(queue_recv)

    async def _serve(self, queue: trio.MemoryReceiveChannel[Queued]) -> None:
        """Handle the queue in order: each chunk with those waiting behind it (one batch),
        then the control message that ended the gather, if any."""
        pending: Queued | None = None
        while True:
            if pending is None:
                try:
                    pending = await queue.receive()
                except trio.EndOfChannel:
                    return
            item, pending = pending, None
            if is_chunk(item.msg):
                batch, pending = await gather(
                    item,
                    queue,
                    max_rows=self._max_batch_rows,
                    window_s=self._gather_window_s,
                    expected=self._expected(),
                )
                await self._run_batch(batch)
            else:
                await self._handle(item.msg)

    async def _read(self, queue: trio.MemorySendChannel[Queued]) -> None:
        """Move frames from the inbox to the local queue, noting each session's newest epoch;
        a ``Truncate`` is applied (and passed downstream) at once, ahead of the queue."""
        async with queue:
            async for msg in self._inbox:
                if isinstance(msg, Truncate):
                    self._note_epoch(msg.session, msg.epoch)
                    if not self._model.is_last:
                        await self._outbox.send(msg)
                    continue
                if isinstance(msg, Prefill | Verify) and not is_replay(msg):
                    self._note_epoch(msg.session, msg.epoch)
                    self._record_input(msg)
                    sess = self._sessions.get(msg.session)
                    if sess is not None:
                        sess.arrived(trio.current_time(), verify=isinstance(msg, Verify))
                elif not isinstance(msg, Prefill | Verify):
                    self._record_input(msg)
                await queue.send(Queued(msg, self._clock()))

    def _expected(self) -> list[SessionId]:
        """Sessions a gather may wait for: open here, seen in the last ``_ACTIVE_S``, and due
        within the window (their last chunk came one typical spacing ago) — the rest of a wave
        of sessions. A session whose next chunk is not due yet (two streams half a lap apart)
        is not waited for: waiting would only add the window to every lap."""
        if not self._gather_window_s:
            return []
        now = trio.current_time()
        due = now + self._gather_window_s
        return [
            sid
            for sid, sess in self._sessions.items()
            if now - sess.seen <= _ACTIVE_S and sess.due_by(due)
        ]

    def _record_input(self, msg: Message) -> None:
        """Receipts hash inputs as they arrive (skipped stale chunks included), in order."""
        if self._receipts is None:
            return
        if isinstance(msg, OpenSession):
            self._receipts.opened(msg.session, msg.job, msg.nonce, msg.receipt_base)
        elif isinstance(msg, Prefill | Verify):
            data = msg.hidden.data if msg.hidden is not None else None
            payload = payload_of(msg.ids, data)
            self._receipts.received(msg.session, msg.epoch, msg.seq, msg.start, payload)

    def _record_output(self, msg: Prefill | Verify, out: Message, compute_s: float) -> None:
        if self._receipts is None:
            return
        if isinstance(out, Verdict):
            prefill = isinstance(msg, Prefill)
            at = msg.start + rows_of(msg) if prefill else msg.start + 1  # as the tail keys it
            payload = verdict_payload(out.target_ids, out.accepted, at=at, prefill=prefill)
        elif isinstance(out, Prefill | Verify) and out.hidden is not None:
            payload = out.hidden.data
        else:
            return
        self._receipts.sent(out.session, out.epoch, out.seq, out.start, payload, compute_s)

    def _note_epoch(self, session: SessionId, epoch: int) -> None:
        # Bounded: frames for sessions that were never opened must not grow this without
        # limit. Past the bound a session just loses early cancellation (never correctness).
        known = session in self._epochs
        if not known and len(self._epochs) >= _EPOCHS_KEPT * self._max_sessions:
            return
        if epoch > self._epochs.get(session, -1):
            self._epochs[session] = epoch

    async def _handle(self, msg: Message) -> None:
        if isinstance(msg, OpenSession):
            await self._open(msg)
        elif isinstance(msg, EndSession):
            self._forget(self._sessions.pop(msg.session, None))
            self._epochs.pop(msg.session, None)
            receipt = self._receipts.close(msg.session) if self._receipts else None
            if receipt is not None:
                await self._outbox.send(StageReceiptOut(session=msg.session, receipt=receipt))
            if not self._model.is_last:
                await self._outbox.send(msg)
        elif isinstance(msg, StageReceiptOut) or (isinstance(msg, Fault) and msg.session):
            await self._outbox.send(msg)  # relay towards the coordinator
        elif isinstance(msg, Fault):
            # Nobody upstream has a reason to send a ring-wide fault (the coordinator learns
            # of dead links itself); relaying one would let any peer declare the ring down.
            log.warning("%s: dropped a fault with no session from upstream: %s", self._node, msg)
        else:
            log.warning("%s: ignoring unexpected %s", self._node, type(msg).__name__)

    async def _open(self, msg: OpenSession) -> None:
        if msg.receipt_base:  # where this stage's input chain began: not the next one's
            msg = attrs.evolve(msg, receipt_base="")
        if msg.session in self._sessions:  # re-sent after a failure: keep the KV
            if not self._model.is_last:
                await self._outbox.send(msg)
            return
        if incarnation_of(msg.session) in self._retired:  # a replay of a dead coordinator's
            log.warning("%s: ignored session %d of a previous coordinator", self._node, msg.session)
            return
        self._drop_orphans(msg.session)
        if len(self._sessions) >= self._max_sessions:
            await self._fault(
                msg.session,
                "capacity",
                f"{len(self._sessions)} sessions open (limits.max_sessions); retry later",
            )
            return
        try:
            check_sampling(msg.sampling)
        except BadRequest as exc:
            await self._fault(msg.session, "request", f"{self._node}: {exc}")
            return
        limit = self._max_len
        if not 0 < msg.max_len <= limit:
            detail = f"{self._node}: max_len {msg.max_len} not in [1, {limit}] (limits.max_len)"
            await self._fault(msg.session, "request", detail)
            return
        refusal = features_refusal(self._model, msg)
        if refusal is None and self._model.is_last:
            refusal = drafts_refusal(msg)
        if refusal is not None:
            await self._fault(msg.session, "request", f"{self._node}: {refusal}")
            return
        if not await self._within_budget(msg):
            return
        # Zeroing a session's KV touches every page of it (30 MiB for 2,048 positions of a
        # 10-layer SmolLM2 block): off the loop, so frames and heartbeats keep moving.
        cache = await offload.run_sync(self._model.new_cache, msg.max_len, limiter=self._limiter)
        if self._graphs is not None:  # warm: capture this session's shapes now
            await offload.run_sync(self._graphs.opened, cache, limiter=self._limiter)
        opened = Session.opened(
            msg, cache, tail=self._model.is_last, now=trio.current_time(), drafts=self._drafts
        )
        self._sessions[msg.session] = opened
        if not self._model.is_last:
            await self._outbox.send(msg)

    async def _within_budget(self, msg: OpenSession) -> bool:
        """Whether the session's KV fits ``kv_budget_bytes``; refuses it (a ``capacity``
        fault, nothing allocated) if not."""
        if self._kv_budget is None:
            return True
        refusal = kv_refusal(self._model, msg.max_len, self._kv_bytes(), self._kv_budget)
        if refusal is None:
            return True
        await self._fault(msg.session, "capacity", f"{self._node}: {refusal}")
        return False

    def _drop_orphans(self, session: SessionId) -> None:
        """Sessions opened by an earlier coordinator (another incarnation in the id's high
        bits) can never continue: a ring has one coordinator, and a restarted one resumes
        with new sessions. Free them, and retire their incarnation: its ``OpenSession``
        coming later (replayed from a log) is ignored, never left to free these."""
        incarnation = incarnation_of(session)
        for sid in [s for s in self._sessions if incarnation_of(s) != incarnation]:
            if incarnation_of(sid) not in self._retired:
                self._retired.append(incarnation_of(sid))
            log.warning("%s: dropped session %d of a previous coordinator", self._node, sid)
            self._forget(self._sessions.pop(sid))
            self._epochs.pop(sid, None)
            if self._receipts is not None:
                self._receipts.close(sid)

    def _forget(self, sess: Session | None) -> None:
        if sess is not None and self._graphs is not None:
            self._graphs.forget(sess.cache)

    async def _fault(
        self, session: SessionId, kind: str, detail: str, *, epoch: Epoch | None = None
    ) -> None:
        self._faults += 1
        await self._outbox.send(
            Fault(node=self._node, kind=kind, detail=detail, session=session, epoch=epoch)
        )

    async def _run_batch(self, items: list[Queued]) -> None:
        """Check each chunk, run those that pass in one forward, then send each chunk's own
        output (or fault) in queue order."""
        began = self._clock()
        slots: list[Planned | tuple[Prefill | Verify, StageFailed]] = []
        for item in items:
            msg = item.msg
            assert is_chunk(msg)
            if not is_replay(msg) and msg.epoch < self._epochs.get(msg.session, -1):
                self._stale += 1  # a newer epoch is queued behind it: skip the stale chunk
                continue
            try:
                slots.append(plan(self._model, self._node, self._sessions, msg, item.arrived))
            except StageFailed as exc:
                slots.append((msg, exc))
        planned = [slot for slot in slots if isinstance(slot, Planned)]
        outs: list[torch.Tensor | Carried | Answer] = []
        compute_s = 0.0
        if planned:
            t0 = time.perf_counter()
            outs = await offload.run_sync(
                forward_batch, self._model, self._graphs, planned, limiter=self._limiter
            )
            compute_s = time.perf_counter() - t0
            self._count(planned, compute_s, began)
        results = iter(outs)
        rows = sum(p.rows for p in planned)
        for slot in slots:
            if not isinstance(slot, Planned):
                bad, failed = slot
                await self._fault(bad.session, failed.kind, str(failed), epoch=bad.epoch)
                continue
            hop = Hop(
                node=self._node,
                compute_s=compute_s,
                received_at=began,
                sent_at=self._clock(),
                queued_s=max(began - slot.arrived, 0.0),
                batch_rows=rows,
                forward=self._forwards,
            )
            sess = self._sessions.get(slot.msg.session)
            window = sess.features if sess is not None else None
            out = output(slot.msg, next(results), (*slot.msg.hops, hop), window)
            if isinstance(out, Verdict) and sess is not None and sess.drafting is not None:
                answer, clock, limiter = sess.drafting.answer, self._clock, self._limiter
                out = await offload.run_sync(answer, slot.msg, out, clock, limiter=limiter)
            if out is not None and not is_replay(slot.msg):
                self._record_output(slot.msg, out, compute_s)
                await self._outbox.send(out)

    def _count(self, planned: list[Planned], compute_s: float, began: float) -> None:
        rows = sum(p.rows for p in planned)
        self._forwards += 1
        self._max_rows = max(self._max_rows, rows)
        self._chunks += len(planned)
        self._positions += rows
        self._compute_s += compute_s
        for p in planned:
            wait = max(began - p.arrived, 0.0)
            self._queued_s += wait
            sess = self._sessions.get(p.msg.session)
            if sess is not None:
                sess.queued_s += wait
                sess.chunks += 1
