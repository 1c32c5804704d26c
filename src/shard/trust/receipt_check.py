"""Checking a run receipt offline, and the canonical JSON file it travels as.

``verify_run(receipt, pins)`` checks, with no network:

- every encoding is canonical: hex is lowercase and of its exact length (no spaces), tokens
  re-encode to the same text, and (``receipt_from_json``) the file is exactly the JSON that
  ``receipt_to_json`` writes — no duplicate keys, no other spacing, order or number forms;
- every signature (each stage's, and the coordinator's over the whole receipt);
- who may sign: with ``pins.authority``, the coordinator and every stage carry an admission
  token of that authority for this swarm, for their role, valid when the receipt was signed,
  for the very key that signed — so pinning the authority pins every signer; with
  ``pins.coordinator``, the coordinator's key is that key;
- the blocks tile ``[0, n_layers)`` in ring order with no gap or overlap;
- the chains link: coordinator-sent == stage 0 input, stage i output == stage i+1 input,
  tail output == coordinator-received (so nobody can claim work it did not pass on);
- splices (version 4): a standby spliced into a block mid-run is the stage the run's splice
  record names, its input chain began at its predecessor's chain over what the replaced node
  was sent (``input_base``) and so still equals the predecessor's output chain; the edge out
  of it is checked by counts — its output is the last part of what its successor received,
  which also holds what the replaced node sent, so it may have sent no more chunks than were
  received there — except out of a spliced-in tail, whose chain must hash exactly the last
  verdicts listed. A splice record relaxes nothing unless the stage signed ``input_base``.
  One splice per block per run;
- a run that resumes a request (version 4, ``resumes``) names it well-formed (the claim
  itself is the resuming coordinator's word);
- the verdicts listed are the ones the tail's output chain commits to, and every output
  token is the tail's last word for its position: the output is bound to the tail's
  signature, not just to the coordinator's;
- the nonce binds to the job (job = H(nonce ‖ prompt hash ‖ end rules)) and every stage
  signed that job — so the requested maximum and the stop ids are the ones the ring was
  given when the session opened, not ones chosen afterwards;
- how the output ended, recomputed from the tail's choices and those end rules: no output
  token is a stop id (a stop id ends the run and is not output); a "stop" means the tail
  chose a stop id right after the last output token (``stop_at`` == the output's length,
  below ``max_tokens``); a "length" holds exactly ``max_tokens`` ids. Any other cut — a
  prefix, 0 tokens, a "length" short of the maximum, a "stop" where no stop id matched — is
  refused;
- the output hash is the hash of the output token ids in the receipt.

It returns what it could not pin (``Verified.unpinned``), so a caller never mistakes an
internally consistent receipt for one tied to known keys. What a receipt does not prove is in
``docs/security.md``.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import attrs

from shard import strict_json
from shard.messages import RunReceipt, SpliceRecord, StageReceipt
from shard.trust.admission import AdmissionError, AdmissionToken, TokenMalformed, verify
from shard.trust.canonical import from_canonical_json, to_canonical_json
from shard.trust.identity import short, verify_signature
from shard.trust.receipts import (
    RECEIPT_VERSION,
    SPLICED_VERSION,
    Chain,
    ReceiptInvalid,
    hash_ids,
    job_id,
    run_signed_bytes,
    stage_signed_bytes,
    verdict_chunk_record,
)


@attrs.frozen
class ReceiptPins:
    """Who may have signed: the swarm's authority (every signer must be admitted by it) and/or
    the coordinator's own key; ``revoked`` serials are refused under the authority."""

    authority: bytes | None = None
    coordinator: bytes | None = None
    revoked: Collection[int] = frozenset()


@attrs.frozen
class Verified:
    """A receipt that passed, with the signers nothing pinned (empty when all were), and for
    a "stop" the stop id the tail chose after the output."""

    receipt: RunReceipt
    unpinned: tuple[str, ...]
    stop_id: int | None = None


# --- canonical encodings ---------------------------------------------------------------------

_HEX_DIGITS = {"job": 32, "nonce": 32, "signature": 128}
_VERSIONS = f"version {RECEIPT_VERSION} or {SPLICED_VERSION}"


def _hex(value: str, digits: int, what: str) -> bytes:
    if len(value) != digits or re.fullmatch(r"[0-9a-f]*", value) is None:
        raise ReceiptInvalid(
            f"{what} is not {digits} lowercase hex digits (receipts accept one spelling only)"
        )
    return bytes.fromhex(value)


def _check_stage_hex(stage: StageReceipt, who: str) -> None:
    for field in ("job", "nonce", "public_key", "input_chain", "output_chain", "signature"):
        _hex(getattr(stage, field), _HEX_DIGITS.get(field, 64), f"{who}: {field}")
    if stage.input_base:
        _hex(stage.input_base, 64, f"{who}: input_base")


def _check_run_hex(receipt: RunReceipt) -> None:
    fields = ("job", "nonce", "prompt_hash", "output_hash", "coordinator_key")
    for field in (*fields, "sent_chain", "received_chain", "signature"):
        _hex(getattr(receipt, field), _HEX_DIGITS.get(field, 64), f"run receipt: {field}")


def _token(text: str, who: str) -> AdmissionToken:
    try:
        token = AdmissionToken.from_text(text, source=f"{who}: admission token")
    except TokenMalformed as exc:
        raise ReceiptInvalid(str(exc)) from None
    if token.to_text().rstrip("\n") != text:
        raise ReceiptInvalid(f"{who}: admission token is not in its canonical encoding")
    return token


def receipt_to_json(receipt: RunReceipt) -> str:
    """The receipt file: every field, sorted keys, two-space indent, ASCII, and a newline.
    This is the one spelling ``receipt_from_json`` accepts."""
    return to_canonical_json(receipt)


def receipt_from_json(text: str) -> RunReceipt:
    """Parse a receipt file, strictly: every field of the right type and no other, no
    duplicate keys, and exactly the bytes ``receipt_to_json`` would write.

    A version-2 receipt (before receipts bound how the output ended) is refused with a
    message that says so: it cannot show that its output was not cut.

    Errors: ``ReceiptInvalid`` saying what is wrong.
    """
    _refuse_old_version(text)
    return from_canonical_json(
        text,
        RunReceipt,
        error=ReceiptInvalid,
        what=f"a shard run receipt ({_VERSIONS})",
        canonical="not in the canonical encoding (the file must be exactly what `--receipt` "
        "wrote: sorted keys, two-space indent, one spelling per number)",
    )


def _refuse_old_version(text: str) -> None:
    try:
        data = strict_json.loads(text, duplicate_keys=True, constants=True)
    except ValueError:
        return  # the strict parse says what is wrong
    if isinstance(data, dict) and "job" in data and "finish_reason" not in data:
        raise ReceiptInvalid(
            "a version-2 receipt: it was signed before receipts bound how the output ended "
            "(finish reason, max_tokens, stop ids), so it cannot show that its output was not "
            f"cut; this shard verifies {_VERSIONS} only — run the request again "
            "with --receipt"
        )


# --- verification ----------------------------------------------------------------------------


def _check_signature(public: bytes, message: bytes, signature: bytes, who: str) -> None:
    if not verify_signature(public, message, signature):
        raise ReceiptInvalid(f"{who}: bad signature (the receipt was altered or forged)")


def _check_admitted(
    text: str, *, key: bytes, role: str, receipt: RunReceipt, pins: ReceiptPins, who: str
) -> None:
    assert pins.authority is not None
    if not text:
        raise ReceiptInvalid(
            f"{who} carries no admission token, so the authority cannot vouch for its key "
            "(a receipt of an insecure swarm: pin its coordinator with --coordinator instead)"
        )
    token = _token(text, who)
    try:
        verify(
            token,
            authority_pub=pins.authority,
            swarm=receipt.swarm,
            role=role,
            now=receipt.signed_at,
            revoked=pins.revoked,
            node_pub=key,
            whose=f"{who}: its token",
        )
    except AdmissionError as exc:
        raise ReceiptInvalid(
            f"{who}: not admitted by the pinned authority {short(pins.authority)} as a {role} "
            f"of swarm {receipt.swarm!r} with key {short(key)} ({exc.reason})"
        ) from None


def _check_stage(stage: StageReceipt, receipt: RunReceipt, pins: ReceiptPins, who: str) -> None:
    _check_stage_hex(stage, who)
    key = bytes.fromhex(stage.public_key)
    _check_signature(key, stage_signed_bytes(stage), bytes.fromhex(stage.signature), who)
    if stage.token:
        _token(stage.token, who)
    if pins.authority is not None:
        _check_admitted(stage.token, key=key, role="stage", receipt=receipt, pins=pins, who=who)
    if (stage.job, stage.nonce) != (receipt.job, receipt.nonce):
        raise ReceiptInvalid(f"{who}: signed another job or nonce")


def _check_coordinator(receipt: RunReceipt, pins: ReceiptPins) -> None:
    _check_run_hex(receipt)
    who = f"coordinator {receipt.coordinator}"
    key = bytes.fromhex(receipt.coordinator_key)
    _check_signature(key, run_signed_bytes(receipt), bytes.fromhex(receipt.signature), who)
    if pins.coordinator is not None and key != pins.coordinator:
        raise ReceiptInvalid(
            f"{who}: signed with key {short(key)}, not the pinned {short(pins.coordinator)}"
        )
    if receipt.coordinator_token:
        _token(receipt.coordinator_token, who)
    if pins.authority is not None:
        token = receipt.coordinator_token
        _check_admitted(token, key=key, role="coordinator", receipt=receipt, pins=pins, who=who)


def splices_by_block(receipt: RunReceipt) -> dict[int, SpliceRecord]:
    """The run's splice records by the first layer of their block. Errors: ``ReceiptInvalid``
    for a block spliced twice (which replaced node computed which chunks is then unknown) or
    a splice past the output."""
    found: dict[int, SpliceRecord] = {}
    for sp in receipt.splices:
        where = f"splice of [{sp.first}, {sp.last}) ({sp.replaced} -> {sp.by})"
        if sp.first in found:
            raise ReceiptInvalid(
                f"{where}: that block was spliced twice in one run; receipts credit one "
                "replaced node per block, so this one cannot say who computed which chunks"
            )
        if not 0 <= sp.at_token <= len(receipt.output_ids) or sp.replaced == sp.by:
            raise ReceiptInvalid(f"{where}: at token {sp.at_token} of {len(receipt.output_ids)}")
        found[sp.first] = sp
    return found


def _check_ring(receipt: RunReceipt, pins: ReceiptPins) -> None:
    """Stage signatures and pins, the tiling, and the chains from coordinator to tail (the
    edge out of a spliced-in standby by counts: module docstring)."""
    if not receipt.stages:
        raise ReceiptInvalid("no stage receipts")
    splices = splices_by_block(receipt)
    expected_first = 0
    upstream_chain, upstream = receipt.sent_chain, str(receipt.coordinator)
    spliced_out: int | None = None  # chunks a spliced-in upstream sent (its edge: by counts)
    for stage in receipt.stages:
        who = f"stage {stage.node} [{stage.first}, {stage.last})"
        _check_stage(stage, receipt, pins, who)
        if stage.first != expected_first or stage.last <= stage.first:
            raise ReceiptInvalid(
                f"{who}: blocks do not tile the layers (expected a block starting at "
                f"{expected_first})"
            )
        _check_edge(upstream, upstream_chain, spliced_out, stage.input_chain, stage.chunks_in, who)
        sp = splices.pop(stage.first, None)
        if sp is not None and (sp.last, sp.by) != (stage.last, stage.node):
            raise ReceiptInvalid(
                f"{who}: the run says {sp.by} was spliced into [{sp.first}, {sp.last})"
            )
        if sp is None and stage.input_base:
            raise ReceiptInvalid(f"{who}: its input chain starts mid-job, but no splice is listed")
        expected_first = stage.last
        upstream_chain, upstream = stage.output_chain, str(stage.node)
        # only a standby that signed it began mid-job: a splice record alone relaxes nothing
        spliced_out = stage.chunks_out if sp is not None and stage.input_base else None
    if expected_first != receipt.n_layers:
        raise ReceiptInvalid(
            f"blocks end at layer {expected_first} but the model has {receipt.n_layers}"
        )
    if splices:
        sp = next(iter(splices.values()))
        raise ReceiptInvalid(f"the splice of [{sp.first}, {sp.last}) matches no stage's block")
    if spliced_out is None:
        _check_edge(upstream, upstream_chain, None, receipt.received_chain, 0, "coordinator")
        return
    # A tail spliced in: its verdicts are the last ones listed, bound to its signature.
    if spliced_out > len(receipt.verdicts):
        raise ReceiptInvalid(
            f"{upstream}, spliced in, claims {spliced_out} verdicts sent but the coordinator "
            f"received {len(receipt.verdicts)} in all"
        )
    chain = Chain()
    for v in receipt.verdicts[len(receipt.verdicts) - spliced_out :]:
        chain.add(verdict_chunk_record(v))
    if chain.value != upstream_chain:
        raise ReceiptInvalid(f"{upstream}, spliced in, sent other verdicts than the last listed")


def _check_edge(
    upstream: str, sent: str, spliced_out: int | None, received: str, count: int, who: str
) -> None:
    """One ring edge: what ``upstream`` sent is what ``who`` received — unless ``upstream``
    was spliced in mid-run (``spliced_out``: how many chunks it sent), whose output is only the
    last part of what was received: it cannot have sent more than that."""
    if received == sent:
        return
    if spliced_out is None:
        if who == "coordinator":
            raise ReceiptInvalid(f"coordinator received other verdicts than {upstream} sent")
        raise ReceiptInvalid(f"{who}: input chain differs from what {upstream} sent")
    if spliced_out > count:
        raise ReceiptInvalid(
            f"{upstream}, spliced in, claims {spliced_out} chunks sent but {who} received "
            f"{count} in all"
        )


def _check_output_bound(receipt: RunReceipt) -> dict[int, int]:
    """The verdicts are the tail's (its output chain), and each output token is the tail's
    last word, in arrival order, for its position (stale verdicts are said over later).
    Returns those last words by output index (0: the first output token's position)."""
    chain = Chain()
    for v in receipt.verdicts:
        chain.add(verdict_chunk_record(v))
    if chain.value != receipt.received_chain:
        raise ReceiptInvalid("the verdicts listed are not the ones the tail's chain commits to")
    prompt_ends = {v.at for v in receipt.verdicts if v.prefill}
    if len(prompt_ends) != 1:
        raise ReceiptInvalid(
            f"the tail answered the prompt {len(prompt_ends)} ways (expected exactly one "
            "prompt length), so the output cannot be placed"
        )
    (prompt_len,) = prompt_ends
    said: dict[int, int] = {}
    for v in receipt.verdicts:
        said.update((v.at - prompt_len + i, token) for i, token in enumerate(v.target_ids))
    for i, token in enumerate(receipt.output_ids):
        if said.get(i) != token:
            raise ReceiptInvalid(
                f"output token {i} ({token}) is not what the tail chose at position "
                f"{prompt_len + i} ({said.get(i)}): the output is not the one the ring computed"
            )
    return said


def _check_ending(receipt: RunReceipt, said: dict[int, int]) -> int | None:
    """How the output ended, recomputed from the tail's choices (``said``, by output index)
    and the end rules (bound to every stage's signature by the job id); returns the stop id
    the tail chose for a "stop". A stop id is not output: a "stop" means the tail chose one
    right after the last output token. Any other cut is refused."""
    r, out = receipt, receipt.output_ids
    if list(r.stop_ids) != sorted(set(r.stop_ids)):
        raise ReceiptInvalid("stop_ids are not sorted and distinct (one spelling only)")
    if r.max_tokens < 1:
        raise ReceiptInvalid(f"max_tokens {r.max_tokens} is not a request's maximum (>= 1)")
    stops = frozenset(r.stop_ids)
    inside = next((i for i, token in enumerate(out) if token in stops), None)
    if inside is not None:
        raise ReceiptInvalid(
            f"output token {inside} ({out[inside]}) is a stop id: the run ended there"
        )
    if r.finish_reason == "stop":
        chosen = said.get(len(out))
        if r.stop_at != len(out) or chosen not in stops or len(out) >= r.max_tokens:
            raise ReceiptInvalid(
                f'finish "stop" at output index {r.stop_at}, but after the {len(out)} output '
                f"tokens the tail chose {chosen}, not a stop id {list(r.stop_ids)} within "
                f"max_tokens {r.max_tokens}: the output was cut, not stopped"
            )
        return chosen
    if r.finish_reason == "length":
        if len(out) != r.max_tokens or r.stop_at != -1:
            raise ReceiptInvalid(
                f'finish "length" after {len(out)} tokens but the request asked for '
                f"{r.max_tokens} (stop_at {r.stop_at}): the output was cut"
            )
        return None
    raise ReceiptInvalid(
        f'finish reason {r.finish_reason!r}: a receipt ends with "stop" or "length"'
    )


def _unpinned(receipt: RunReceipt, pins: ReceiptPins) -> tuple[str, ...]:
    if pins.authority is not None:
        return ()
    stages = tuple(f"stage {s.node}" for s in receipt.stages)
    if pins.coordinator is not None:
        return stages
    return (f"coordinator {receipt.coordinator}", *stages)


_I64 = range(-(2**63), 2**63)


def _check_int64(receipt: RunReceipt) -> None:
    """Every integer the chains and hashes encode fits their int64 (a signed file may hold any
    JSON integer; hashing one past int64 would fail, not refuse)."""
    r = receipt
    ints = [r.max_tokens, *r.stop_ids, *r.output_ids]
    for v in r.verdicts:
        ints += [v.epoch, v.seq, v.start, v.at, v.accepted, *v.target_ids]
    if any(i not in _I64 for i in ints):
        raise ReceiptInvalid("an integer past int64: no run receipt holds one")


def verify_run(receipt: RunReceipt, pins: ReceiptPins = ReceiptPins()) -> Verified:
    """Check a run receipt offline (see the module docstring). Errors: ``ReceiptInvalid``."""
    _check_coordinator(receipt, pins)
    _check_int64(receipt)
    r = receipt
    if r.job != job_id(r.nonce, r.prompt_hash, max_tokens=r.max_tokens, stop_ids=r.stop_ids):
        raise ReceiptInvalid(
            "job id does not bind the nonce to the prompt hash and the end rules "
            "(max_tokens, stop_ids) every stage signed"
        )
    if receipt.output_hash != hash_ids(receipt.output_ids):
        raise ReceiptInvalid("output hash does not match the output token ids")
    if (rs := receipt.resumes) is not None:
        if rs.job:
            _hex(rs.job, 32, "run receipt: resumes.job")
        if not rs.request or rs.at_token < 0:
            raise ReceiptInvalid(f"resumes request {rs.request!r} at token {rs.at_token}")
    _check_ring(receipt, pins)
    stop_id = _check_ending(receipt, _check_output_bound(receipt))
    return Verified(receipt, _unpinned(receipt, pins), stop_id)
