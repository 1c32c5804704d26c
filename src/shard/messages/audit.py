"""Spot checks as data: one audited chunk, a chain-inclusion proof, and the signed evidence of
a stage that lied about what it computed.

Plain records, like every message. Building, signing and checking evidence is
``shard.audit.evidence``; choosing chunks and comparing results is ``shard.audit.compare``. The
file a person checks offline (``shard receipt verify --evidence FILE``) is canonical JSON of
``Evidence``, so tensor payloads are base64 text here (``Blob``), not raw bytes.

Hex fields are lowercase, of fixed length: keys, chains, hashes, seeds and commitments 64
digits, signatures 128.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName
from shard.messages.receipts import StageReceipt
from shard.messages.values import DraftQ, Sampling, Tensor


@attrs.frozen
class Blob:
    """A tensor in a file: dtype name, shape, and its row-major bytes as base64."""

    dtype: str
    shape: tuple[int, ...]
    b64: str


@attrs.frozen
class AuditedChunk:
    """One chunk as it crossed the edge into the audited stage: token ids on the first edge,
    else hidden states (exactly one is set), with its routing header.

    What the tail's choice also reads: ``verify`` (a ``Verify`` chunk, else a ``Prefill``),
    ``final`` (a prefill's last chunk: the one the tail answers) and ``draft`` (a verify
    chunk's drafted ids). None of the three is in the stage's input chain (which hashes the
    payload only): they are the predecessor's word, like the chunk's copy itself."""

    epoch: int
    seq: int
    start: int
    ids: tuple[int, ...] = ()
    hidden: Blob | None = None
    verify: bool = False
    final: bool = False
    draft: tuple[int, ...] = ()
    q: tuple[DraftQ, ...] = ()  # the draft's distributions, when it sampled (Verify.q)


@attrs.frozen
class ChainProof:
    """Where one chunk sits in a hash chain: the chain's value just before it, and the records
    (``chunk_record`` bytes, hex) of every chunk after it, in order. Folding the chunk's own
    record and then ``later`` into ``before`` must give the chain the stage signed."""

    before: str
    later: tuple[str, ...] = ()


@attrs.frozen
class Evidence:
    """A failed audit, signed by the auditor: what the accused stage received and claimed,
    what the auditor computed from the same inputs, and how the two were compared.

    ``prior`` are the earlier chunks of the session the audited chunk attends to (from the
    predecessor's replay log), so anyone holding the block can recompute ``recomputed``.
    ``commitment`` is the hash of ``seed``, sent before the job; the seed, revealed here,
    chose the chunk. ``receipt`` is the accused's signed receipt for the job when it signed
    one (an evicted stage never does): with it, the proofs bind ``chunk`` and ``claimed`` to
    the accused's own signature; without it the evidence is the auditor's word.
    """

    accused: NodeName
    accused_key: str
    first: int
    last: int
    session: int
    index: int  # the audited chunk's place in the accused's output chain (0-based)
    commitment: str
    seed: str
    prior: tuple[AuditedChunk, ...]
    chunk: AuditedChunk
    claimed: Blob
    recomputed: Blob
    method: str  # "exact" | "sketch" | "tokens"
    rate: float
    dims: int
    threshold: float
    cosine: float | None
    input_proof: ChainProof
    output_proof: ChainProof
    receipt: StageReceipt | None
    auditor: NodeName
    auditor_key: str
    signed_at: int  # Unix seconds, the auditor's clock
    #: the tail ("tokens"): its session's sampling and the tie margin the comparison allowed
    sampling: Sampling = Sampling()
    margin: float = 0.0
    signature: str = ""


@attrs.frozen
class AuditRequest:
    """Coordinator -> auditor: re-run ``chunk`` of ``accused``'s block (after ``prior``, which
    rebuild the KV it attends to) and compare with ``claimed``.

    ``device_class`` and ``dtype`` are what the accused declared: where they equal the
    auditor's, the comparison is bit-exact, else by sketch. The seed is revealed to the
    auditor only (the accused never sees it); ``commitment`` is what was sent before the job.
    """

    accused: NodeName
    accused_key: str
    first: int
    last: int
    session: int
    index: int
    commitment: str
    seed: str
    rate: float
    prior: tuple[AuditedChunk, ...]
    chunk: AuditedChunk
    claimed: Blob
    input_proof: ChainProof
    output_proof: ChainProof
    device_class: str
    dtype: str
    receipt: StageReceipt | None = None
    #: the tail's choice: the session's sampling (from the predecessor's ``OpenSession``)
    sampling: Sampling = Sampling()
    #: the swarm batches chunks across sessions (``[limits] max_batch_rows`` > 1): a batched
    #: forward's output matches a lone recomputation only to rounding, so never bit-exact
    batched: bool = False
    #: how the accused holds its block's weights (``[swarm] weights``; None: dense in its
    #: dtype): an auditor replays only with the same kernels (``shard.audit.auditor``)
    weights: str | None = None


@attrs.frozen
class AuditVerdict:
    """Auditor -> scheduler: how one audit came out; ``evidence`` is set when it failed.
    ``tie``: the tail's token differed from the auditor's only at a near-tie (within the
    margin): not a strike."""

    accused: NodeName
    auditor: NodeName
    session: int
    index: int
    ok: bool
    method: str
    cosine: float | None
    detail: str
    evidence: Evidence | None = None
    tie: bool = False


@attrs.frozen
class AuditCopy:
    """Node -> scheduler (on its control link), only when the swarm audits: a copy of one ring
    chunk as this node sent it downstream (``side`` "sent") or received it from upstream
    ("received"). The scheduler feeds an audited stage's sampler from what its predecessor
    sent (its input) and what its successor received (its output), never from the audited
    stage's own word. ``kind`` is "chunk" (``hidden`` or ``ids`` set; ``verify``, ``final``
    and ``draft`` as on ``AuditedChunk``), "end" (the session ended), "open" (an
    ``OpenSession`` sent: its ``sampling``, which the tail's choice reads) or "verdict" (a
    ``Verdict`` the coordinator received from the tail: ``ids`` its target ids, ``accepted``).
    ``n`` counts the node's copies from 0, so a gap (a copy lost while the control link was
    down) is seen, and the sessions it touches are no longer audited.
    """

    side: str
    kind: str
    n: int
    session: int
    epoch: int = 0
    seq: int = 0
    start: int = 0
    replay: bool = False
    ids: tuple[int, ...] = ()
    hidden: Tensor | None = None
    verify: bool = False
    final: bool = False
    draft: tuple[int, ...] = ()
    q: tuple[DraftQ, ...] = ()  # the draft's distributions, when it sampled (Verify.q)
    accepted: int = 0
    sampling: Sampling = Sampling()
