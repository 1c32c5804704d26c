"""ReplayLog: what the sending side of one ring edge sent downstream, per live session.

When the node behind an edge dies, a standby holding the same block is spliced in and knows
nothing of the live sessions. The sender of the edge into it (the previous stage, or the
coordinator for stage 0) replays its log: each session's ``OpenSession``, then every chunk it
sent, in the order sent and with the same shapes, as ``Prefill(replay=True)``. The standby
computes them into its KV and forwards nothing, so only the lost block is rebuilt. Same inputs,
same chunk shapes, same order: the rebuilt KV is bit-identical to the lost one.

Pruning keeps the log exact and bounded. A chunk at ``start`` rewrites every position from
``start`` on, so logged chunks that start at or after it are dropped: nothing kept ever read
their KV (a chunk attends only to positions before its own start and to itself). A chunk that
starts earlier is kept whole even when it is partly overwritten, because the chunks after it
were computed against its KV. What is left is about one copy of each session's positions.

For receipts the log also keeps, per session with a job, the receipt chain over every chunk
the edge really sent (``sent``, called by the edge after each send; ``shard.trust.receipts``:
the records its sender's output chain hashes): the replayed ``OpenSession`` carries it as
``receipt_base``, so a spliced-in standby's input chain starts where the replaced node's
stood and ends equal to the sender's output chain. It lives for the job (a re-sent
``OpenSession`` of the same job keeps it).

A new coordinator's first ``OpenSession`` (another incarnation in the session id's high bits)
drops the sessions of the one before from the log, as the stages drop them
(``StageExecutor``): replayed into a standby and forwarded, a previous coordinator's
``OpenSession`` made the next stage drop the new coordinator's live sessions (the soak of
issue 40: three requests stalled 60 s after a splice that followed a takeover).

A session whose log would pass ``max_bytes`` is dropped from the log (``replayable`` says so):
a standby then misses its KV, reports a gap, and the coordinator re-sends the session from its
own log of token ids, which is small. Nothing is lost; it only costs more compute.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from shard.messages import (
    ChunkSeq,
    EndSession,
    Epoch,
    Message,
    OpenSession,
    Prefill,
    SessionId,
    Tensor,
    Verify,
    incarnation_of,
)
from shard.trust.receipts import Chain, chunk_record, payload_of

#: Default bound on one edge's log: hidden states of every live session, in host memory.
DEFAULT_MAX_BYTES = 1 << 30


@attrs.frozen
class LoggedChunk:
    """One chunk as it crossed the edge: token ids (first edge) or hidden states."""

    epoch: Epoch
    seq: ChunkSeq
    start: int
    ids: tuple[int, ...]
    hidden: Tensor | None

    @property
    def nbytes(self) -> int:
        return len(self.hidden.data) if self.hidden is not None else 8 * len(self.ids)

    @property
    def length(self) -> int:
        return len(self.ids) if self.hidden is None else int(self.hidden.shape[1])


@attrs.define
class _SessionLog:
    open: OpenSession
    chunks: list[LoggedChunk] = attrs.field(factory=list)
    nbytes: int = 0
    sent: Chain = attrs.field(factory=Chain)  # receipts: every chunk sent for the job


@attrs.frozen
class ReplayLogStatistics:
    sessions: int
    chunks: int
    nbytes: int
    dropped: int


class ReplayLog:
    """Per-session log of an edge's traffic (see the module docstring). Not thread-safe: one
    actor (the edge's sender) records and replays."""

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._sessions: dict[SessionId, _SessionLog] = {}
        self._dropped: set[SessionId] = set()
        self._nbytes = 0

    def statistics(self) -> ReplayLogStatistics:
        chunks = sum(len(s.chunks) for s in self._sessions.values())
        return ReplayLogStatistics(len(self._sessions), chunks, self._nbytes, len(self._dropped))

    def replayable(self, session: SessionId) -> bool:
        return session in self._sessions

    def record(self, msg: Message) -> None:
        """Note a message that was sent downstream."""
        if isinstance(msg, OpenSession):
            incarnation = incarnation_of(msg.session)
            for sid in [s for s in self._sessions if incarnation_of(s) != incarnation]:
                self._forget(sid)  # a previous coordinator's: dead on every stage
            self._dropped = {s for s in self._dropped if incarnation_of(s) == incarnation}
            known = self._sessions.get(msg.session)
            self._forget(msg.session)
            self._dropped.discard(msg.session)
            fresh = _SessionLog(msg)
            if known is not None and (known.open.job, known.open.nonce) == (msg.job, msg.nonce):
                fresh.sent = known.sent  # the same job re-sent: its receipt chain carries on
            self._sessions[msg.session] = fresh
        elif isinstance(msg, EndSession):
            self._forget(msg.session)
            self._dropped.discard(msg.session)
        elif isinstance(msg, Prefill | Verify) and not (isinstance(msg, Prefill) and msg.replay):
            log = self._sessions.get(msg.session)
            if log is None:
                return
            # Starts increase along the list (every record drops the chunks at or after its
            # own start), so pruning only ever pops from the end: O(1) amortised per chunk.
            freed = 0
            while log.chunks and log.chunks[-1].start >= msg.start:
                freed += log.chunks.pop().nbytes
            chunk = LoggedChunk(msg.epoch, msg.seq, msg.start, msg.ids, msg.hidden)
            log.chunks.append(chunk)
            log.nbytes += chunk.nbytes - freed
            self._nbytes += chunk.nbytes - freed
            if self._nbytes > self._max_bytes:
                self._forget(msg.session)
                self._dropped.add(msg.session)

    def sent(self, msg: Message) -> None:
        """Note a chunk the edge really sent (not a replay) in its session's receipt chain:
        called by the sender after the send, where ``record`` may come before it (the
        coordinator logs a chunk as it queues it for the link)."""
        if not isinstance(msg, Prefill | Verify) or (isinstance(msg, Prefill) and msg.replay):
            return
        log = self._sessions.get(msg.session)
        if log is not None and log.open.nonce:
            data = msg.hidden.data if msg.hidden is not None else None
            log.sent.add(chunk_record(msg.epoch, msg.seq, msg.start, payload_of(msg.ids, data)))

    def chunks(self, session: SessionId) -> tuple[LoggedChunk, ...]:
        log = self._sessions.get(session)
        return tuple(log.chunks) if log is not None else ()

    def opening(self, session: SessionId) -> OpenSession | None:
        log = self._sessions.get(session)
        return log.open if log is not None else None

    def replay(self) -> Iterator[Message]:
        """Every live session: its ``OpenSession``, then its chunks as replay prefills."""
        for sid, log in list(self._sessions.items()):
            opening = log.open
            yield attrs.evolve(opening, receipt_base=log.sent.value) if opening.nonce else opening
            for c in log.chunks:
                yield Prefill(
                    sid,
                    c.epoch,
                    c.seq,
                    c.start,
                    final=False,
                    ids=c.ids,
                    hidden=c.hidden,
                    replay=True,
                )

    def _forget(self, session: SessionId) -> None:
        log = self._sessions.pop(session, None)
        if log is not None:
            self._nbytes -= log.nbytes
