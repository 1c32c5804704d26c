"""Evidence of a failed audit: built and signed by the auditor, checked offline by anyone.

``verify_evidence(evidence, pins)`` checks, with no network and no model:

- every encoding is canonical (lowercase hex of exact lengths; ``evidence_from_json`` takes
  exactly the bytes ``evidence_to_json`` writes);
- the seed is the one committed to (``commit(seed) == commitment``) and it chose this chunk
  (``is_audited(seed, chain just after the chunk, rate)``): the auditor did not pick it;
- the comparison, redone from the two results in the file, fails — bytes differ (``exact``)
  or the smallest per-row sketch cosine is below the threshold (``sketch``), and the recorded
  cosine is the recomputed one; for the tail (``tokens``) the claim is a verdict, the
  auditor's result the logits its choice read, and the choice redone from them (with the
  recorded sampling) differs from the claim beyond the recorded margin;
- with the accused's receipt: its signature, that it is the accused's key and block, that
  its job's nonce derives from the commitment (``audit_nonce``: committed before the job),
  and that the chain proofs fold the audited input and the claimed output into the
  receipt's signed chains at the stated index — the accused itself signed what it claimed;
- the auditor's signature over everything else; with ``pins.auditor``, that it is that key;
  with ``pins.authority``, that the receipt's token admits the accused's key as a stage.

What it cannot check offline is the recomputation itself (that needs the block's weights:
the file holds every input needed to redo it), nor, for the tail, that the draft, the final
flag and the sampling are what it was sent (its input chain hashes the hidden states only).
``Checked.bound`` says whether the accused's own signature backs the claim;
``Checked.unpinned`` whose keys nothing pinned.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import torch

from shard.audit.compare import (
    audit_nonce,
    choice_rows,
    commit,
    compare,
    compare_tokens,
    is_audited,
    verdict_at,
    verdict_of,
    wire_of,
)
from shard.compute.tensors import from_wire
from shard.messages import StageReceipt
from shard.messages import Tensor as WireTensor
from shard.messages.audit import AuditedChunk, ChainProof, Evidence
from shard.trust.admission import AdmissionError, AdmissionToken, TokenMalformed, verify
from shard.trust.canonical import as_body, from_canonical_json, to_canonical_json
from shard.trust.identity import NodeIdentity, short, verify_signature
from shard.trust.receipts import (
    RECEIPT_VERSION,
    Chain,
    ReceiptInvalid,
    chunk_record,
    payload_of,
    stage_signed_bytes,
    verdict_payload,
)

__all__ = [
    "Checked",
    "EvidenceInvalid",
    "EvidencePins",
    "chunk_payload",
    "evidence_from_json",
    "evidence_to_json",
    "fold",
    "sign_evidence",
    "verify_evidence",
]


class EvidenceInvalid(ReceiptInvalid):
    """An evidence file failed verification; the message names the first reason found."""


@attrs.frozen
class EvidencePins:
    """Who may have signed: the auditor's key, and the swarm authority (for the accused's
    admission token); ``revoked`` token serials are refused under the authority."""

    auditor: bytes | None = None
    authority: bytes | None = None
    revoked: frozenset[int] = frozenset()


@attrs.frozen
class Checked:
    """Evidence that passed. ``bound``: the accused's signed receipt backs the claimed output
    (else it is the auditor's word); ``unpinned``: signers no pin vouched for."""

    evidence: Evidence
    bound: bool
    unpinned: tuple[str, ...]


def chunk_payload(chunk: AuditedChunk) -> bytes:
    """The bytes a chunk's chain record hashes (as ``shard.trust.receipts`` hashes them)."""
    data = wire_of(chunk.hidden).data if chunk.hidden is not None else None
    return payload_of(chunk.ids, data)


def fold(proof: ChainProof, record: bytes) -> tuple[str, str]:
    """(chain just after ``record``, chain after every later record) for a proof."""
    chain = Chain(value=proof.before)
    chain.add(record)
    after = chain.value
    for later in proof.later:
        chain.add(bytes.fromhex(later))
    return after, chain.value


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(
        record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def signed_bytes(evidence: Evidence) -> bytes:
    """What the auditor signs: every field but its signature, canonical JSON, kind "audit"
    (an embedded receipt's empty version-4 fields left out, as its file leaves them)."""
    body = as_body(evidence)
    body.pop("signature")
    return _canonical({"kind": "audit", "v": RECEIPT_VERSION, **body})


def sign_evidence(evidence: Evidence, identity: NodeIdentity) -> Evidence:
    """``evidence`` signed by ``identity``. Errors: ``ValueError`` for another key."""
    if identity.public.hex() != evidence.auditor_key:
        raise ValueError("signing with a key other than the evidence's auditor_key")
    return attrs.evolve(evidence, signature=identity.sign(signed_bytes(evidence)).hex())


def evidence_to_json(evidence: Evidence) -> str:
    """The evidence file: every field, sorted keys, two-space indent, ASCII, and a newline."""
    return to_canonical_json(evidence)


def evidence_from_json(text: str) -> Evidence:
    """Parse an evidence file, strictly (exactly what ``evidence_to_json`` writes).

    Errors: ``EvidenceInvalid`` saying what is wrong."""
    return from_canonical_json(
        text,
        Evidence,
        error=EvidenceInvalid,
        what="shard audit evidence",
        canonical="not in the canonical encoding (the file must be exactly as written)",
    )


def _hex(value: str, digits: int, what: str) -> bytes:
    if len(value) != digits or re.fullmatch(r"[0-9a-f]*", value) is None:
        raise EvidenceInvalid(f"{what} is not {digits} lowercase hex digits")
    return bytes.fromhex(value)


def _check_encoding(ev: Evidence) -> None:
    for field in ("accused_key", "commitment", "seed", "auditor_key"):
        _hex(getattr(ev, field), 64, field)
    _hex(ev.signature, 128, "signature")
    for name, proof in (("input_proof", ev.input_proof), ("output_proof", ev.output_proof)):
        _hex(proof.before, 64, f"{name}.before")
        for record in proof.later:
            if len(record) % 2 or re.fullmatch(r"[0-9a-f]*", record) is None:
                raise EvidenceInvalid(f"{name}: a later record is not lowercase hex")
    if ev.method not in ("exact", "sketch", "tokens"):
        raise EvidenceInvalid(f"unknown comparison method {ev.method!r}")
    if not (0.0 < ev.rate <= 1.0 and 1 <= ev.dims <= 65536 and -1.0 <= ev.threshold <= 1.0):
        raise EvidenceInvalid("rate, dims or threshold out of range")
    if not 0.0 <= ev.margin <= 100.0:
        raise EvidenceInvalid("margin out of range")
    if (ev.chunk.hidden is None) == (not ev.chunk.ids):
        raise EvidenceInvalid("the audited chunk must carry exactly one of ids and hidden")


def _check_choice_and_mismatch(ev: Evidence) -> str:
    """The seed was committed and chose this chunk; the results really differ. Returns the
    output chain after every later chunk (for the receipt check)."""
    seed = bytes.fromhex(ev.seed)
    if commit(seed) != ev.commitment:
        raise EvidenceInvalid("the revealed seed is not the one committed to")
    try:
        claimed, recomputed = wire_of(ev.claimed), wire_of(ev.recomputed)
    except ValueError as exc:
        raise EvidenceInvalid(str(exc)) from None
    c = ev.chunk
    payload = _tail_payload(ev, claimed) if ev.method == "tokens" else claimed.data
    after, final = fold(ev.output_proof, chunk_record(c.epoch, c.seq, c.start, payload))
    if not is_audited(seed, after, ev.rate):
        raise EvidenceInvalid("the revealed seed did not choose this chunk for audit")
    if ev.method == "tokens":
        logits = from_wire(recomputed)
        result = compare_tokens(claimed, logits, c, ev.sampling, margin=ev.margin)
    else:
        result = compare(
            claimed,
            recomputed,
            exact=ev.method == "exact",
            seed=seed,
            dims=ev.dims,
            threshold=ev.threshold,
        )
    if result.ok:
        raise EvidenceInvalid(f"the results agree ({result.detail}): no lie is shown")
    if ev.method == "sketch" and (
        ev.cosine is None or result.cosine is None or abs(ev.cosine - result.cosine) > 1e-9
    ):
        raise EvidenceInvalid(f"the recorded cosine is not the recomputed {result.cosine}")
    return final


def _tail_payload(ev: Evidence, claimed: WireTensor) -> bytes:
    """What the tail's output chain hashed for the claimed verdict; checks that the claim is a
    verdict and the auditor's result the logits of the rows the choice reads."""
    rows = choice_rows(ev.chunk)
    try:
        ids, accepted = verdict_of(claimed)
        logits = from_wire(wire_of(ev.recomputed))
    except ValueError as exc:
        raise EvidenceInvalid(f"tail evidence: {exc}") from None
    if not rows or logits.dtype != torch.float32 or tuple(logits.shape[:1]) != (rows,):
        raise EvidenceInvalid(
            f"tail evidence: the recomputed logits {tuple(logits.shape)} are not the float32 "
            f"rows [{rows}, V] of a chunk's choice"
        )
    at, prefill = verdict_at(ev.chunk)
    return verdict_payload(ids, accepted, at=at, prefill=prefill)


def _check_receipt(
    ev: Evidence, receipt: StageReceipt, output_final: str, pins: EvidencePins
) -> None:
    who = f"receipt of {receipt.node}"
    key = _hex(receipt.public_key, 64, f"{who}: public_key")
    if not verify_signature(key, stage_signed_bytes(receipt), _hex(receipt.signature, 128, who)):
        raise EvidenceInvalid(f"{who}: bad signature (altered or forged)")
    if (receipt.node, receipt.public_key) != (ev.accused, ev.accused_key):
        raise EvidenceInvalid(f"{who}: not the accused's key")
    if (receipt.first, receipt.last) != (ev.first, ev.last):
        raise EvidenceInvalid(f"{who}: another block than the accused's")
    if receipt.nonce != audit_nonce(ev.commitment):
        raise EvidenceInvalid(
            f"{who}: its job's nonce does not bind this commitment (it was not sent before the job)"
        )
    if output_final != receipt.output_chain:
        raise EvidenceInvalid(f"{who}: the claimed output is not the one its output chain signs")
    if ev.index != receipt.chunks_out - 1 - len(ev.output_proof.later):
        raise EvidenceInvalid(f"{who}: the audited chunk is not at index {ev.index}")
    c = ev.chunk
    _, input_final = fold(ev.input_proof, chunk_record(c.epoch, c.seq, c.start, chunk_payload(c)))
    if input_final != receipt.input_chain:
        raise EvidenceInvalid(f"{who}: the audited input is not one its input chain signs")
    if pins.authority is not None:
        _check_admitted(receipt, key, ev.signed_at, pins, who)


def _check_admitted(
    receipt: StageReceipt, key: bytes, now: int, pins: EvidencePins, who: str
) -> None:
    assert pins.authority is not None
    try:
        token = AdmissionToken.from_text(receipt.token, source=f"{who}: admission token")
        verify(
            token,
            authority_pub=pins.authority,
            swarm=token.swarm,
            role="stage",
            now=now,
            revoked=pins.revoked,
            node_pub=key,
            whose=f"{who}: its token",
        )
    except (AdmissionError, TokenMalformed) as exc:
        raise EvidenceInvalid(
            f"{who}: not admitted by the pinned authority {short(pins.authority)} ({exc})"
        ) from None


def verify_evidence(evidence: Evidence, pins: EvidencePins = EvidencePins()) -> Checked:
    """Check evidence offline (see the module docstring). Errors: ``EvidenceInvalid``."""
    ev = evidence
    _check_encoding(ev)
    auditor = bytes.fromhex(ev.auditor_key)
    if not verify_signature(auditor, signed_bytes(ev), bytes.fromhex(ev.signature)):
        raise EvidenceInvalid(f"auditor {ev.auditor}: bad signature (altered or forged)")
    if pins.auditor is not None and auditor != pins.auditor:
        raise EvidenceInvalid(
            f"auditor {ev.auditor}: signed with {short(auditor)}, "
            f"not the pinned {short(pins.auditor)}"
        )
    final = _check_choice_and_mismatch(ev)
    if ev.receipt is not None:
        _check_receipt(ev, ev.receipt, final, pins)
    unpinned: list[str] = []
    if pins.auditor is None:
        unpinned.append(f"auditor {ev.auditor}")
    if ev.receipt is not None and pins.authority is None:
        unpinned.append(f"accused {ev.accused}")
    return Checked(ev, ev.receipt is not None, tuple(unpinned))
