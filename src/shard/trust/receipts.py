"""Signed receipts, the making side: hash chains, what is signed, the stage's and the
coordinator's receipt books. Checking a receipt is ``shard.trust.receipt_check``.

Each stage signs a ``StageReceipt`` per job: its layer range, the job id and nonce, hash chains
over every chunk it received (input) and sent (output), the chunk count, its compute time,
device identity and admission token. The coordinator signs the ``RunReceipt``: prompt and
output hashes, every stage receipt, every verdict the tail sent, its own chains over what it
sent to stage 0 and received from the tail, its token, node addresses, measured edge transit,
tok/s and α, and how the output ended (finish reason, the requested maximum, the stop ids
and where one matched). The records themselves are messages (``shard.messages.receipts``):
they cross the wire through the one codec like everything else.

Chains hash each chunk's routing header (session-free: epoch, seq, start) and its raw payload
(token ids, hidden-state bytes, or for the tail a verdict: its target ids, accepted count, the
absolute position of its first id and whether it answered the prompt) — the same bytes on
both ends of an edge, so a chain is a commitment to the exact activations that crossed it. A
stage hashes its inputs as they arrive (stale chunks it later skips included), so chains match
under early cancellation.

The job id binds the nonce, the prompt and the end rules (``max_tokens``, ``stop_ids``):
every stage signs the job when its session opens, so whoever holds the coordinator's key
cannot later claim another maximum or other stop ids to pass off a cut output as complete.

What is signed is canonical JSON (sorted keys, no spaces, ASCII, no NaN) of every field but
the signature, under a ``kind`` and a version, so a stage signature is never valid as a run's.

A splice (``docs/failover.md``) keeps the chains whole. A stage's chains live for the job:
an ``OpenSession`` for a job it already records (a full re-send, or the copy a spliced-in
standby forwards) does not restart them. The spliced-in standby's input chain starts where
its predecessor's chain over what it had sent the replaced node stood (the replayed
``OpenSession`` carries it: ``receipt_base``), so it ends equal to the predecessor's output
chain; the coordinator lists each splice (``SpliceRecord``) in the run receipt. A run that
resumes a request a dead coordinator began names it (``ResumeRecord``). Version 4 is those
three fields; a receipt with none is spelt and signed exactly as version 3.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs

from shard.messages import (
    EdgeRecord,
    NodeName,
    ResumeRecord,
    RunReceipt,
    SpliceRecord,
    StageReceipt,
    VerdictRecord,
)
from shard.trust.canonical import as_body
from shard.trust.identity import NodeIdentity

__all__ = [
    "CHAIN_START",
    "RECEIPT_VERSION",
    "SPLICED_VERSION",
    "Chain",
    "EdgeRecord",
    "ReceiptInvalid",
    "ReceiptSigner",
    "ResumeRecord",
    "RunJob",
    "RunReceipt",
    "RunSigner",
    "SpliceRecord",
    "StageReceipt",
    "VerdictRecord",
    "chunk_record",
    "ends_hash",
    "hash_ids",
    "ids_bytes",
    "job_id",
    "payload_of",
    "run_signed_bytes",
    "sign_run",
    "sign_stage",
    "stage_signed_bytes",
    "verdict_chunk_record",
    "verdict_payload",
]

#: 3: run receipts bind how the output ended (``finish_reason``, ``max_tokens``, ``stop_ids``,
#: ``stop_at``) and the job id binds the end rules; version-2 receipts are refused.
RECEIPT_VERSION = 3
#: 4: splices (``RunReceipt.splices``, ``StageReceipt.input_base``); a receipt without them is
#: signed as version 3, so every version-3 receipt still verifies.
SPLICED_VERSION = 4
_CHAIN_INIT = hashlib.blake2b(b"shard-receipt-chain-v1", digest_size=32).hexdigest()
#: the value every chain starts from (but a spliced-in standby's input chain)
CHAIN_START = _CHAIN_INIT
_HEX64 = frozenset("0123456789abcdef")


class ReceiptInvalid(Exception):
    """A receipt failed verification; the message names the first reason found."""


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _i64(value: int) -> bytes:
    return int(value).to_bytes(8, "little", signed=True)


def ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the receipts hash them: little-endian int64, in order."""
    return b"".join(_i64(t) for t in ids)


def chunk_record(epoch: int, seq: int, start: int, payload: bytes) -> bytes:
    """What one chunk contributes to a chain (the same on both ends of an edge)."""
    header = f"{epoch}:{seq}:{start}:{len(payload)}:".encode()
    return header + _h(payload)


@attrs.define
class Chain:
    """A running hash chain: ``c_{i+1} = H(c_i ‖ record_i)``."""

    value: str = _CHAIN_INIT
    count: int = 0

    def add(self, record: bytes) -> None:
        self.value = _h(bytes.fromhex(self.value) + record).hex()
        self.count += 1


def ends_hash(max_tokens: int, stop_ids: Sequence[int]) -> str:
    """The end rules a job binds: the requested maximum and the ids that end the run."""
    return _h(b"shard-ends-v1:" + _i64(max_tokens) + ids_bytes(stop_ids)).hex()


def job_id(nonce: str, prompt_hash: str, *, max_tokens: int, stop_ids: Sequence[int]) -> str:
    """The job a nonce, a prompt and the end rules bind to (``stop_ids`` sorted)."""
    ends = ends_hash(max_tokens, stop_ids)
    return _h(bytes.fromhex(nonce) + bytes.fromhex(prompt_hash) + bytes.fromhex(ends)).hex()[:32]


def hash_ids(ids: Sequence[int]) -> str:
    return _h(ids_bytes(ids)).hex()


def payload_of(ids: Sequence[int], hidden_data: bytes | None) -> bytes:
    """The bytes a chunk carries: hidden-state bytes on later edges, else its token ids."""
    return hidden_data if hidden_data is not None else ids_bytes(ids)


def verdict_payload(target_ids: Sequence[int], accepted: int, *, at: int, prefill: bool) -> bytes:
    """What a verdict contributes to the tail's output chain and the coordinator's input:
    ``at`` is the absolute position of ``target_ids[0]``, ``prefill`` whether the verdict
    answered the prompt's last chunk (the fixed-size tail keeps the bytes unambiguous)."""
    return ids_bytes(target_ids) + _i64(accepted) + _i64(at) + (b"\x01" if prefill else b"\x00")


def verdict_chunk_record(v: VerdictRecord) -> bytes:
    """The chain record of one verdict, as the tail and the coordinator both hash it."""
    payload = verdict_payload(v.target_ids, v.accepted, at=v.at, prefill=v.prefill)
    return chunk_record(v.epoch, v.seq, v.start, payload)


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(
        record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def stage_signed_bytes(receipt: StageReceipt) -> bytes:
    """What a stage signs: every field but the signature, canonical JSON, kind "stage";
    version 4 with an ``input_base``, else exactly version 3's bytes."""
    body = as_body(receipt)
    body.pop("signature")
    version = SPLICED_VERSION if "input_base" in body else RECEIPT_VERSION
    return _canonical({"kind": "stage", "v": version, **body})


def run_signed_bytes(receipt: RunReceipt) -> bytes:
    """What the coordinator signs: every field but its signature (stage receipts whole, their
    signatures included), canonical JSON, kind "run"; version 4 with splices or a resume,
    else 3."""
    body = as_body(receipt)
    body.pop("signature")
    spliced = "splices" in body or "resumes" in body or any(s.input_base for s in receipt.stages)
    version = SPLICED_VERSION if spliced else RECEIPT_VERSION
    return _canonical({"kind": "run", "v": version, **body})


def sign_stage(receipt: StageReceipt, identity: NodeIdentity) -> StageReceipt:
    """``receipt`` signed by ``identity``. Errors: ``ValueError`` for another key."""
    if identity.public.hex() != receipt.public_key:
        raise ValueError("signing with a key other than the receipt's public_key")
    return attrs.evolve(receipt, signature=identity.sign(stage_signed_bytes(receipt)).hex())


def sign_run(receipt: RunReceipt, identity: NodeIdentity) -> RunReceipt:
    """``receipt`` signed by ``identity``. Errors: ``ValueError`` for another key."""
    if identity.public.hex() != receipt.coordinator_key:
        raise ValueError("signing with a key other than the receipt's coordinator_key")
    return attrs.evolve(receipt, signature=identity.sign(run_signed_bytes(receipt)).hex())


def _finite(value: float, digits: int) -> float:
    """A float fit for canonical JSON: rounded, and 0.0 for NaN or infinity."""
    return round(float(value), digits) if math.isfinite(value) else 0.0


@attrs.define
class _Job:
    job: str
    nonce: str
    base: str = ""
    inputs: Chain = attrs.field(factory=Chain)
    outputs: Chain = attrs.field(factory=Chain)
    compute_s: float = 0.0


class ReceiptSigner:
    """A stage's receipt book: chains per job, signed into a ``StageReceipt`` at the end.

    Synchronous and cheap (one BLAKE2b per chunk per direction); the executor calls it in
    frame order — ``received`` as frames arrive, ``sent`` as results leave — so its chains
    match its neighbours' exactly. Only sessions opened with a nonce are recorded. ``token``
    is the text of the admission token of ``identity`` ("" in a swarm with no authority).
    """

    def __init__(
        self,
        identity: NodeIdentity,
        *,
        node: str,
        address: str,
        first: int,
        last: int,
        device: str,
        token: str = "",
    ) -> None:
        self._identity = identity
        self._node = NodeName(node)
        self._address = address
        self._first = first
        self._last = last
        self._device = device
        self._token = token
        self._jobs: dict[int, _Job] = {}

    def opened(self, session: int, job: str, nonce: str, base: str = "") -> None:
        """A session opened for ``job``. Its chains live for the job: opened again for the same
        job (a re-send, or a standby's forwarded copy after a splice) they carry on. ``base``
        (a replayed ``OpenSession``'s ``receipt_base``) starts a new job's input chain there;
        anything but 64 lowercase hex digits is ignored (the receipt then will not link)."""
        if not nonce:
            return
        known = self._jobs.get(session)
        if known is not None and (known.job, known.nonce) == (job, nonce):
            return
        if len(base) != 64 or not _HEX64.issuperset(base):
            base = ""
        self._jobs[session] = _Job(job, nonce, base, Chain(base or _CHAIN_INIT))

    def received(self, session: int, epoch: int, seq: int, start: int, payload: bytes) -> None:
        job = self._jobs.get(session)
        if job is not None:
            job.inputs.add(chunk_record(epoch, seq, start, payload))

    def sent(
        self, session: int, epoch: int, seq: int, start: int, payload: bytes, compute_s: float
    ) -> None:
        job = self._jobs.get(session)
        if job is not None:
            job.outputs.add(chunk_record(epoch, seq, start, payload))
            job.compute_s += compute_s

    def close(self, session: int) -> StageReceipt | None:
        """The signed receipt for ``session`` (None when no receipt was asked for)."""
        job = self._jobs.pop(session, None)
        if job is None:
            return None
        receipt = StageReceipt(
            job=job.job,
            nonce=job.nonce,
            node=self._node,
            public_key=self._identity.public.hex(),
            address=self._address,
            first=self._first,
            last=self._last,
            chunks_in=job.inputs.count,
            chunks_out=job.outputs.count,
            input_chain=job.inputs.value,
            output_chain=job.outputs.value,
            compute_s=_finite(job.compute_s, 6),
            device=self._device,
            token=self._token,
            input_base=job.base,
        )
        return sign_stage(receipt, self._identity)


@attrs.frozen
class RunSigner:
    """What the coordinator needs to sign run receipts: its key and that key's admission token
    ("" with no authority), its name, the swarm, the model, the ring, and a wall clock."""

    identity: NodeIdentity
    coordinator: str
    model: str
    n_layers: int
    n_stages: int
    swarm: str = ""
    token: str = ""
    clock: Callable[[], float] = time.time


@attrs.define
class RunJob:
    """The coordinator's side of one job: its end rules, its chains, the verdicts and the
    stage receipts that came back."""

    nonce: str
    prompt_hash: str
    prompt_len: int
    max_tokens: int
    stop_ids: tuple[int, ...]  # sorted
    sent: Chain = attrs.field(factory=Chain)
    received: Chain = attrs.field(factory=Chain)
    verdicts: list[VerdictRecord] = attrs.field(factory=list)
    stages: list[StageReceipt] = attrs.field(factory=list)
    splices: list[SpliceRecord] = attrs.field(factory=list)
    resumes: ResumeRecord | None = None  # the request this run continues (resume_request)

    @classmethod
    def start(
        cls,
        prompt_ids: Sequence[int],
        nonce: bytes,
        *,
        max_tokens: int,
        stop_ids: Collection[int],
    ) -> RunJob:
        """A job for ``prompt_ids`` that ends after ``max_tokens`` ids or at the first of
        ``stop_ids`` (the EOS ids; empty: it runs to ``max_tokens``)."""
        return cls(
            nonce=nonce.hex(),
            prompt_hash=hash_ids(prompt_ids),
            prompt_len=len(prompt_ids),
            max_tokens=max_tokens,
            stop_ids=tuple(sorted(set(stop_ids))),
        )

    @property
    def job(self) -> str:
        return job_id(
            self.nonce, self.prompt_hash, max_tokens=self.max_tokens, stop_ids=self.stop_ids
        )

    def sent_chunk(self, epoch: int, seq: int, start: int, ids: Sequence[int]) -> None:
        self.sent.add(chunk_record(epoch, seq, start, ids_bytes(ids)))

    def received_verdict(
        self, epoch: int, seq: int, start: int, target_ids: Sequence[int], accepted: int
    ) -> None:
        """Record a verdict. A chunk starting inside the prompt is the prompt's last one (only
        that one is answered): its first target id is at the prompt's length; a verify chunk's
        at ``start + 1`` — the positions the tail keyed its choices by."""
        prefill = start < self.prompt_len
        at = self.prompt_len if prefill else start + 1
        record = VerdictRecord(epoch, seq, start, at, prefill, tuple(target_ids), accepted)
        self.verdicts.append(record)
        self.received.add(verdict_chunk_record(record))

    def stage_receipt(self, receipt: StageReceipt) -> None:
        self.stages.append(receipt)

    def spliced(self, record: SpliceRecord) -> None:
        """A standby took a block over while the job ran (``record.at_token``: the output
        tokens committed then)."""
        self.splices.append(record)

    def finish(
        self,
        signer: RunSigner,
        *,
        output_ids: Sequence[int],
        finish_reason: str,
        edges: Sequence[EdgeRecord],
        tok_s: float,
        alpha: float | None,
    ) -> RunReceipt:
        """The signed run receipt (stages in ring order, verdicts in arrival order).
        ``finish_reason`` is the request's: "stop" (the tail chose a stop id right after the
        output; the stop id is not output) or "length"."""
        return sign_run(
            RunReceipt(
                job=self.job,
                nonce=self.nonce,
                swarm=signer.swarm,
                model=signer.model,
                n_layers=signer.n_layers,
                prompt_hash=self.prompt_hash,
                output_ids=tuple(output_ids),
                output_hash=hash_ids(output_ids),
                coordinator=NodeName(signer.coordinator),
                coordinator_key=signer.identity.public.hex(),
                coordinator_token=signer.token,
                signed_at=int(signer.clock()),
                sent_chain=self.sent.value,
                received_chain=self.received.value,
                stages=tuple(sorted(self.stages, key=lambda s: s.first)),
                verdicts=tuple(self.verdicts),
                edges=tuple(attrs.evolve(e, mean_s=_finite(e.mean_s, 6)) for e in edges),
                tok_s=_finite(tok_s, 4),
                alpha=None if alpha is None else _finite(alpha, 6),
                finish_reason=finish_reason,
                max_tokens=self.max_tokens,
                stop_ids=self.stop_ids,
                stop_at=len(output_ids) if finish_reason == "stop" else -1,
                splices=tuple(self.splices),
                resumes=self.resumes,
            ),
            signer.identity,
        )
