"""AuditSampler: the coordinator's side of spot checks on one stage — it watches what crossed
the edges into and out of that stage, decides which chunks are audited, and builds the
``AuditRequest`` an auditor runs.

It keeps, per session, the same hash chains the stage's receipt signs (``ChainLog``: every
record, so any chunk's inclusion proof can be cut later), and the inputs each chunk attends
to, pruned exactly like the predecessor's replay log (``shard.failover.replay``): a chunk at
``start`` makes every earlier-logged chunk starting at or after it dead. The decision for an
output chunk is ``is_audited(seed, output chain just after it, rate)`` — fixed the moment the
stage sent it, unknowable to the stage without the seed (``shard.audit.compare``).

At the tail the outputs are verdicts (``Verdict``: target ids and the accepted count, as the
coordinator received them); the chain record is the one the tail's receipt signs
(``verdict_payload``, keyed by the audited input's position), the claim a ``verdict_blob``,
and the request carries the session's sampling (from the ``OpenSession`` the predecessor
sent), which the tail's choice reads.

Two ways to audit: ``output`` returns a request for a chosen chunk at once (mid-request: the
proofs end at that chunk, and there is no receipt yet, so failed-audit evidence is the
auditor's word); ``after_receipt`` returns the requests for every chosen chunk of a finished
job with full proofs and the stage's signed receipt, so the evidence binds the accused's own
signature. Synchronous and cheap (one hash per chunk per direction, plus the decision).
"""

from __future__ import annotations

import attrs

from shard.audit.compare import blob_of, commit, is_audited, verdict_at, verdict_blob
from shard.messages import (
    EndSession,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    StageReceipt,
    Verdict,
    Verify,
)
from shard.messages.audit import AuditedChunk, AuditRequest, Blob, ChainProof
from shard.trust.receipts import Chain, chunk_record, payload_of, verdict_payload

__all__ = ["Accused", "AuditSampler", "ChainLog"]


@attrs.define
class ChainLog:
    """A hash chain and every record in it: ``values[i]`` is the chain before record ``i``."""

    chain: Chain = attrs.field(factory=Chain)
    records: list[bytes] = attrs.field(factory=list)
    values: list[str] = attrs.field(factory=list)

    def add(self, record: bytes) -> int:
        """Append a record; return its index."""
        self.values.append(self.chain.value)
        self.records.append(record)
        self.chain.add(record)
        return len(self.records) - 1

    def after(self, i: int) -> str:
        """The chain value just after record ``i``."""
        return self.values[i + 1] if i + 1 < len(self.values) else self.chain.value

    def proof(self, i: int) -> ChainProof:
        return ChainProof(self.values[i], tuple(r.hex() for r in self.records[i + 1 :]))


@attrs.frozen
class Accused:
    """Who is sampled: the stage's name, key, block, and the device class and dtype it
    declared (the auditor compares bit-exactly only where its own are the same)."""

    node: NodeName
    key: str
    first: int
    last: int
    device_class: str
    dtype: str
    batched: bool = False  # the swarm batches: compare by sketch (``AuditRequest.batched``)
    weights: str | None = None  # its declared weights (``AuditRequest.weights``)


@attrs.define
class _Pending:
    chunk: AuditedChunk
    prior: tuple[AuditedChunk, ...]
    input_index: int


@attrs.define
class _Session:
    inputs: ChainLog = attrs.field(factory=ChainLog)
    outputs: ChainLog = attrs.field(factory=ChainLog)
    live: list[AuditedChunk] = attrs.field(factory=list)  # pruned as the replay log is
    pending: dict[tuple[int, int, int], _Pending] = attrs.field(factory=dict)
    by_output: list[_Pending | None] = attrs.field(factory=list)
    claimed: list[Blob] = attrs.field(factory=list)  # every output, for ``after_receipt``
    sampling: Sampling = Sampling()  # the tail's choice reads it


class AuditSampler:
    """See the module docstring. Each chunk it chooses comes back from ``output`` as its
    ``AuditRequest``."""

    def __init__(
        self,
        accused: Accused,
        *,
        seed: bytes,
        rate: float,
    ) -> None:
        self._accused = accused
        self._seed = seed
        self.commitment = commit(seed)
        self._rate = rate
        self._sessions: dict[SessionId, _Session] = {}

    def input(self, msg: Message) -> None:
        """A message the predecessor sent the accused (replays and other kinds are ignored,
        as the stage's receipt ignores them)."""
        if isinstance(msg, OpenSession):
            self._sessions.setdefault(msg.session, _Session()).sampling = msg.sampling
        elif isinstance(msg, EndSession):
            pass  # kept for ``after_receipt``; ``forget`` drops it
        elif isinstance(msg, Prefill | Verify) and not (isinstance(msg, Prefill) and msg.replay):
            sess = self._sessions.setdefault(msg.session, _Session())
            hidden = blob_of(msg.hidden) if msg.hidden is not None else None
            verify = isinstance(msg, Verify)
            final = isinstance(msg, Prefill) and msg.final
            draft = tuple(msg.draft) if isinstance(msg, Verify) else ()
            q = tuple(msg.q) if isinstance(msg, Verify) else ()
            chunk = AuditedChunk(
                msg.epoch, msg.seq, msg.start, tuple(msg.ids), hidden, verify, final, draft, q
            )
            data = msg.hidden.data if msg.hidden is not None else None
            index = sess.inputs.add(
                chunk_record(msg.epoch, msg.seq, msg.start, payload_of(msg.ids, data))
            )
            while sess.live and sess.live[-1].start >= msg.start:
                sess.live.pop()
            sess.pending[(msg.epoch, msg.seq, msg.start)] = _Pending(chunk, tuple(sess.live), index)
            sess.live.append(chunk)

    def output(self, msg: Message) -> AuditRequest | None:
        """A chunk the accused sent on (hidden states), or its verdict (the tail): the request
        to audit it, when the seed chooses it. A verdict is taken only once its input is in
        (its chain record is keyed by the input's position)."""
        if not isinstance(msg, Prefill | Verify | Verdict):
            return None
        sess = self._sessions.get(msg.session)
        if sess is None:
            return None
        key = (msg.epoch, msg.seq, msg.start)
        if isinstance(msg, Verdict):
            pending = sess.pending.get(key)
            if pending is None:
                return None
            at, prefill = verdict_at(pending.chunk)
            payload = verdict_payload(msg.target_ids, msg.accepted, at=at, prefill=prefill)
            claimed = verdict_blob(tuple(msg.target_ids), msg.accepted)
        elif isinstance(msg, Prefill | Verify) and msg.hidden is not None:
            payload, claimed = msg.hidden.data, blob_of(msg.hidden)
        else:
            return None
        index = sess.outputs.add(chunk_record(msg.epoch, msg.seq, msg.start, payload))
        pending = sess.pending.pop(key, None)
        sess.by_output.append(pending)
        sess.claimed.append(claimed)
        if pending is None or not self.chosen(msg.session, index):
            return None
        return self._request(msg.session, sess, index, pending, None)

    def has_input(self, msg: Prefill | Verify | Verdict) -> bool:
        """Whether the input of the output chunk ``msg`` has been seen (and not yet matched)."""
        sess = self._sessions.get(msg.session)
        return sess is not None and (msg.epoch, msg.seq, msg.start) in sess.pending

    def chosen(self, session: SessionId, index: int) -> bool:
        sess = self._sessions[session]
        return is_audited(self._seed, sess.outputs.after(index), self._rate)

    def after_receipt(self, session: SessionId, receipt: StageReceipt) -> list[AuditRequest]:
        """Requests for every chosen chunk of a finished job, bound to its receipt."""
        sess = self._sessions.get(session)
        if sess is None:
            return []
        out = []
        for index, pending in enumerate(sess.by_output):
            if pending is not None and self.chosen(session, index):
                out.append(self._request(session, sess, index, pending, receipt))
        return out

    def forget(self, session: SessionId) -> None:
        self._sessions.pop(session, None)

    def _request(
        self,
        session: SessionId,
        sess: _Session,
        index: int,
        pending: _Pending,
        receipt: StageReceipt | None,
    ) -> AuditRequest:
        a = self._accused
        return AuditRequest(
            accused=a.node,
            accused_key=a.key,
            first=a.first,
            last=a.last,
            session=session,
            index=index,
            commitment=self.commitment,
            seed=self._seed.hex(),
            rate=self._rate,
            prior=pending.prior,
            chunk=pending.chunk,
            claimed=sess.claimed[index],
            input_proof=sess.inputs.proof(pending.input_index),
            output_proof=sess.outputs.proof(index),
            device_class=a.device_class,
            dtype=a.dtype,
            receipt=receipt,
            sampling=sess.sampling,
            batched=a.batched,
            weights=a.weights,
        )
