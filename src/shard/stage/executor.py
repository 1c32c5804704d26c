"""StageExecutor: one contiguous block of layers, its per-session KV caches, and (at the tail)
the target's choice.

The executor reads chunks from its inbox in order (frames on one edge are FIFO), runs its
block, and writes to its outbox: hidden states for the next stage, or — at the tail — a small
``Verdict`` of token ids that goes straight back to the coordinator (direct return). Control
messages (``OpenSession``, ``EndSession``) travel the ring in the same FIFO order as chunks, so
a session's KV exists before its first chunk and is freed after its last.

A chunk at ``start`` writes K/V at ``[start, start+n)`` and attends to everything before, so
rollback after a rejected draft is just a later chunk overwriting the same positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import torch
import trio

from shard.decode.state import BadRequest, check_sampling
from shard.decode.verify import choose_token, verify_chunk
from shard.messages import (
    SESSION_BITS,
    EndSession,
    Epoch,
    Fault,
    Hop,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    StageReceiptOut,
    Truncate,
    Verdict,
    Verify,
)
from shard.model.llama import KVCache, StageModel
from shard.stage import offload
from shard.stage.graphs import ChunkGraphs
from shard.stage.tensors import from_wire, to_wire
from shard.trust.receipts import ReceiptSigner, payload_of, verdict_payload

log = logging.getLogger(__name__)

_LOOKAHEAD = 64
_EPOCHS_KEPT = 4  # epochs remembered per allowed session (see _note_epoch)


class StageFailed(Exception):
    """A chunk could not be computed; reported downstream as a ``Fault`` for that session."""

    def __init__(self, message: str, kind: str = "chunk") -> None:
        super().__init__(message)
        self.kind = kind


@attrs.frozen
class StageStatistics:
    """Counters of one executor, for the status feed and benchmarks."""

    node: NodeName
    first: int
    last: int
    sessions: int
    chunks: int
    positions: int
    compute_s: float
    faults: int
    stale_skipped: int
    kv_bytes: int  # KV cache memory held by the open sessions


@attrs.define
class _Session:
    cache: KVCache
    sampling: Sampling
    written: int = 0  # positions [0, written) hold KV a later chunk may attend to


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
    ``max_sessions`` x ``max_len`` whatever a peer asks.
    """

    def __init__(
        self,
        model: StageModel,
        *,
        node: NodeName,
        inbox: trio.MemoryReceiveChannel[Message],
        outbox: trio.MemorySendChannel[Message],
        max_sessions: int = 16,
        max_len: int | None = None,
        limiter: trio.CapacityLimiter | None = None,
        clock: Callable[[], float] = time.time,
        receipts: ReceiptSigner | None = None,
        graphs: ChunkGraphs | None = None,
    ) -> None:
        self._model = model
        self._graphs = graphs  # None: every chunk eager (StageModel.forward)
        self._receipts = receipts
        self._node = node
        self._inbox = inbox
        self._outbox = outbox
        self._max_sessions = max_sessions
        # A session's KV length is capped by the swarm's limits.max_len (KV memory is
        # max_sessions x max_len whatever an OpenSession asks) and by the model's context.
        context = model.config.max_position_embeddings
        self._max_len = context if max_len is None else min(max_len, context)
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        # Hop stamps are wall-clock so that hops from different processes line up on one host;
        # they are reported, never used to decide anything.
        self._clock = clock
        self._sessions: dict[SessionId, _Session] = {}
        self._chunks = 0
        self._positions = 0
        self._compute_s = 0.0
        self._faults = 0
        self._stale = 0
        self._epochs: dict[SessionId, int] = {}

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
            kv_bytes=sum(s.cache.k.nbytes + s.cache.v.nbytes for s in self._sessions.values()),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # The local queue lets the reader look past frames waiting to be computed: when a
        # newer epoch of a session arrives, queued frames of older epochs are skipped
        # (early cancellation). Its size bounds how far ahead the reader may run.
        queue_send, queue_recv = trio.open_memory_channel[Message](_LOOKAHEAD)
        async with self._inbox, self._outbox, trio.open_nursery() as nursery:
            nursery.start_soon(self._read, queue_send)
            task_status.started()
            async with queue_recv:
                async for msg in queue_recv:
                    await self._handle(msg)

    async def _read(self, queue: trio.MemorySendChannel[Message]) -> None:
        """Move frames from the inbox to the local queue, noting each session's newest epoch;
        a ``Truncate`` is applied (and passed downstream) at once, ahead of the queue."""
        async with queue:
            async for msg in self._inbox:
                if isinstance(msg, Truncate):
                    self._note_epoch(msg.session, msg.epoch)
                    if not self._model.is_last:
                        await self._outbox.send(msg)
                    continue
                if isinstance(msg, Prefill | Verify) and not _is_replay(msg):
                    self._note_epoch(msg.session, msg.epoch)
                    self._record_input(msg)
                elif not isinstance(msg, Prefill | Verify):
                    self._record_input(msg)
                await queue.send(msg)

    def _record_input(self, msg: Message) -> None:
        """Receipts hash inputs as they arrive (skipped stale chunks included), in order."""
        if self._receipts is None:
            return
        if isinstance(msg, OpenSession):
            self._receipts.opened(msg.session, msg.job, msg.nonce)
        elif isinstance(msg, Prefill | Verify):
            data = msg.hidden.data if msg.hidden is not None else None
            payload = payload_of(msg.ids, data)
            self._receipts.received(msg.session, msg.epoch, msg.seq, msg.start, payload)

    def _record_output(self, msg: Prefill | Verify, out: Message, compute_s: float) -> None:
        if self._receipts is None:
            return
        if isinstance(out, Verdict):
            prefill = isinstance(msg, Prefill)
            at = msg.start + _chunk_len(msg) if prefill else msg.start + 1  # as _forward keys it
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
        elif isinstance(msg, Prefill | Verify):
            if not _is_replay(msg) and msg.epoch < self._epochs.get(msg.session, -1):
                self._stale += 1  # a newer epoch is queued behind it: skip the stale chunk
                return
            try:
                out = await self._compute(msg)
            except StageFailed as exc:
                await self._fault(msg.session, exc.kind, str(exc), epoch=msg.epoch)
                return
            if out is not None and not _is_replay(msg):
                self._record_output(msg, out, out.hops[-1].compute_s if out.hops else 0.0)
                await self._outbox.send(out)
        elif isinstance(msg, StageReceiptOut) or (isinstance(msg, Fault) and msg.session):
            await self._outbox.send(msg)  # relay towards the coordinator
        elif isinstance(msg, Fault):
            # Nobody upstream has a reason to send a ring-wide fault (the coordinator learns
            # of dead links itself); relaying one would let any peer declare the ring down.
            log.warning("%s: dropped a fault with no session from upstream: %s", self._node, msg)
        else:
            log.warning("%s: ignoring unexpected %s", self._node, type(msg).__name__)

    async def _open(self, msg: OpenSession) -> None:
        if msg.session in self._sessions:  # re-sent after a failure: keep the KV
            if not self._model.is_last:
                await self._outbox.send(msg)
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
        cache = self._model.new_cache(msg.max_len)
        if self._graphs is not None:  # warm: capture this session's shapes now
            await offload.run_sync(self._graphs.opened, cache, limiter=self._limiter)
        self._sessions[msg.session] = _Session(cache, msg.sampling)
        if not self._model.is_last:
            await self._outbox.send(msg)

    def _drop_orphans(self, session: SessionId) -> None:
        """Sessions opened by an earlier coordinator (another incarnation in the id's high
        bits) can never continue: a ring has one coordinator, and a restarted one resumes
        with new sessions. Free them."""
        incarnation = session >> SESSION_BITS
        for sid in [s for s in self._sessions if s >> SESSION_BITS != incarnation]:
            log.warning("%s: dropped session %d of a previous coordinator", self._node, sid)
            self._forget(self._sessions.pop(sid))
            self._epochs.pop(sid, None)
            if self._receipts is not None:
                self._receipts.close(sid)

    def _forget(self, sess: _Session | None) -> None:
        if sess is not None and self._graphs is not None:
            self._graphs.forget(sess.cache)

    async def _fault(
        self, session: SessionId, kind: str, detail: str, *, epoch: Epoch | None = None
    ) -> None:
        self._faults += 1
        await self._outbox.send(
            Fault(node=self._node, kind=kind, detail=detail, session=session, epoch=epoch)
        )

    async def _compute(self, msg: Prefill | Verify) -> Prefill | Verify | Verdict | None:
        received_at = self._clock()
        sess = self._sessions.get(msg.session)
        if sess is None:
            raise StageFailed(f"{self._node}: session {msg.session} is not open here", "gap")
        x = self._input(msg)
        n = int(x.shape[1])
        if msg.start < 0 or msg.start + n > sess.cache.max_len:
            raise StageFailed(
                f"{self._node}: positions [{msg.start}, {msg.start + n}) do not fit the "
                f"session's KV length {sess.cache.max_len}"
            )
        if msg.start > sess.written:
            raise StageFailed(
                f"{self._node}: session {msg.session} chunk at {msg.start} but only positions "
                f"< {sess.written} are written here (frames were lost)",
                "gap",
            )
        if isinstance(msg, Verify) and len(msg.draft) >= n:
            raise StageFailed(
                f"{self._node}: {len(msg.draft)} drafted tokens in a chunk of {n} positions"
            )
        t0 = time.perf_counter()
        out = await offload.run_sync(self._forward, x, msg.start, sess, msg, limiter=self._limiter)
        compute_s = time.perf_counter() - t0
        sess.written = msg.start + n
        self._chunks += 1
        self._positions += n
        self._compute_s += compute_s
        hop = Hop(
            node=self._node, compute_s=compute_s, received_at=received_at, sent_at=self._clock()
        )
        hops = (*msg.hops, hop)
        if isinstance(out, torch.Tensor):
            return attrs.evolve(msg, ids=(), hidden=to_wire(out), hops=hops)
        if out is None:
            return None
        return Verdict(
            session=msg.session,
            epoch=msg.epoch,
            seq=msg.seq,
            start=msg.start,
            target_ids=out[0],
            accepted=out[1],
            hops=hops,
        )

    def _input(self, msg: Prefill | Verify) -> torch.Tensor:
        if self._model.is_first:
            if not msg.ids or msg.hidden is not None:
                raise StageFailed(f"{self._node}: the first stage needs token ids, got hidden")
            vocab = self._model.config.vocab_size
            if any(not 0 <= t < vocab for t in msg.ids):
                raise StageFailed(f"{self._node}: token id out of range [0, {vocab})")
            return torch.tensor([msg.ids], dtype=torch.int64, device=self._model.device)  # [1, S]
        if msg.hidden is None:
            raise StageFailed(f"{self._node}: a middle or tail stage needs hidden states")
        try:
            hidden = from_wire(msg.hidden, device=self._model.device)
        except ValueError as exc:
            raise StageFailed(f"{self._node}: bad hidden payload: {exc}") from exc
        if hidden.dtype != self._model.dtype:
            raise StageFailed(
                f"{self._node}: hidden states are {msg.hidden.dtype}, this block runs in "
                f"{self._model.dtype}; every stage of a swarm must use the spec's dtype"
            )
        dim = self._model.config.hidden_size
        shape = tuple(hidden.shape)
        if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != dim:
            raise StageFailed(f"{self._node}: hidden shape {shape} is not [1, S >= 1, {dim}]")
        return hidden

    def _forward(
        self, x: torch.Tensor, start: int, sess: _Session, msg: Prefill | Verify
    ) -> torch.Tensor | tuple[tuple[int, ...], int] | None:
        """Worker-thread body: the block's forward, and the target's choice at the tail."""
        with torch.inference_mode():
            run = self._graphs if self._graphs is not None else self._model
            out = run(x, start, sess.cache)
            if not self._model.is_last:
                return out
            if isinstance(msg, Prefill) and (not msg.final or msg.replay):
                return None
            # The choice is made in fp32 on the CPU whatever the block's dtype and device:
            # only the rows it reads (1, or K+1) cross, and the sampler's generator is a CPU one.
            rows = 1 if isinstance(msg, Prefill) else len(msg.draft) + 1
            logits = out[0, -rows:].to("cpu", torch.float32)  # [rows, V]
            if isinstance(msg, Prefill):
                token = choose_token(logits[-1], sess.sampling, msg.start + int(x.shape[1]))
                return (token,), 0
            verdict = verify_chunk(logits, msg.draft, sess.sampling, msg.start + 1)
            return verdict.target_ids, verdict.accepted


def _chunk_len(msg: Prefill | Verify) -> int:
    """Positions a chunk feeds: its ids on the first edge, else the hidden states' ``[1, S, D]``."""
    return len(msg.ids) if msg.hidden is None else msg.hidden.shape[1]


def _is_replay(msg: Prefill | Verify) -> bool:
    return isinstance(msg, Prefill) and msg.replay
