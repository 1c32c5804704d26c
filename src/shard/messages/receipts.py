"""Signed receipts as data: a stage's account of a job, and the coordinator's of a whole run.

Plain records, like every message: they cross the wire through the one codec (a stage's
``StageReceipt`` inside ``StageReceiptOut``, the ``RunReceipt`` inside ``GenerateDone``).
What is signed, how, and what a verifier checks live in ``shard.trust.receipts`` and
``shard.trust.receipt_check``; the file a person verifies offline is canonical JSON of
``RunReceipt`` (``shard.trust.receipt_check.receipt_to_json``).

Hex fields are lowercase, of fixed length: ``job`` and ``nonce`` 32 digits, keys, chains and
hashes 64 (``input_base`` 64, or ""), signatures 128. ``token`` fields hold an admission
token's text (``shard-token-v1 <base64>``, no newline), or "" where the swarm has no authority.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName

#: Field metadata: the field is left out of the file and of the signed bytes while it is empty,
#: so a record that does not use it is spelt and signed exactly as before the field existed.
OMIT_EMPTY = {"omit_empty": True}


@attrs.frozen
class StageReceipt:
    """One stage's signed account of a job: its block, both hash chains, compute time, device,
    and the admission token that lets its key sign for the swarm."""

    job: str
    nonce: str
    node: NodeName
    public_key: str
    address: str
    first: int
    last: int
    chunks_in: int
    chunks_out: int
    input_chain: str
    output_chain: str
    compute_s: float
    device: str
    token: str = ""
    signature: str = ""
    #: a standby spliced in mid-job: where its input chain began — its predecessor's chain
    #: over what it sent the replaced node (``OpenSession.receipt_base``), so its input chain
    #: ends equal to the predecessor's output chain; "" for a stage there from the start
    input_base: str = attrs.field(default="", metadata=OMIT_EMPTY)


@attrs.frozen
class EdgeRecord:
    """Measured mean transit of one ring edge."""

    src: NodeName
    dst: NodeName
    mean_s: float


@attrs.frozen
class VerdictRecord:
    """One verdict the tail sent for the job, in the order the coordinator received it.

    ``target_ids[i]`` is the target's token for absolute position ``at + i``; ``prefill``
    marks the answer to the prompt's last chunk (``at`` is then the prompt's length). The tail's
    output chain hashes every field, so the list is the tail's, not the coordinator's, word.
    """

    epoch: int
    seq: int
    start: int
    at: int
    prefill: bool
    target_ids: tuple[int, ...]
    accepted: int


@attrs.frozen
class SpliceRecord:
    """A standby spliced into the ring mid-run, in the coordinator's words: ``replaced`` held
    layers ``[first, last)`` until the output had ``at_token`` committed tokens, ``by`` from
    then on (the request re-sent from there)."""

    first: int
    last: int
    replaced: NodeName
    by: NodeName
    at_token: int


@attrs.frozen
class ResumeRecord:
    """A run that continues a request another coordinator began and could not finish (it
    died; ``Coordinator.resume_request``), in the resuming coordinator's words: the request's
    checkpoint id, the job id of its first run ("" if that one asked for no receipt) and how
    many output tokens were committed before this run (its prompt is the request's prompt and
    those tokens, its output the rest)."""

    request: str
    job: str
    at_token: int


@attrs.frozen
class RunReceipt:
    """The coordinator's signed account of a whole run: every stage receipt, every verdict,
    the output, how it ended, and the admission token of the coordinator's key.

    ``max_tokens`` and ``stop_ids`` enter the job id (``shard.trust.receipts.job_id``), which
    every stage signs when the session opens, so the end rules cannot be changed after the
    run; the verifier recomputes the end from them and the tail-chosen output (version 3)."""

    job: str
    nonce: str
    swarm: str
    model: str
    n_layers: int
    prompt_hash: str
    output_ids: tuple[int, ...]
    output_hash: str
    coordinator: NodeName
    coordinator_key: str
    coordinator_token: str
    signed_at: int  # Unix seconds, the coordinator's clock: when every token must be valid
    sent_chain: str
    received_chain: str
    stages: tuple[StageReceipt, ...]
    verdicts: tuple[VerdictRecord, ...]
    edges: tuple[EdgeRecord, ...]
    tok_s: float
    alpha: float | None
    #: how the output ended: "stop" (the tail chose one of ``stop_ids`` right after the last
    #: output token; a stop id is not output) or "length" (``max_tokens`` ids)
    finish_reason: str
    max_tokens: int  # the requested maximum (the job id binds it: stages signed it)
    stop_ids: tuple[int, ...]  # ids that end the run, sorted (the EOS ids; () with ignore_eos)
    stop_at: int  # output index where the tail chose the stop id (== len(output_ids)); -1: length
    signature: str = ""
    #: standbys spliced in during the run, in order (version 4; empty: spelt as version 3)
    splices: tuple[SpliceRecord, ...] = attrs.field(default=(), metadata=OMIT_EMPTY)
    #: the request this run resumes, if any (version 4; None: spelt as version 3)
    resumes: ResumeRecord | None = attrs.field(default=None, metadata=OMIT_EMPTY)
