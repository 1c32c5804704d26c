"""Signed receipts: who computed what for a job, checkable offline by anyone.

Each stage signs a ``StageReceipt`` per job: its layer range, the job id and nonce, hash chains
over every chunk it received (input) and sent (output), the chunk count, its compute time and
device identity. The coordinator signs the ``RunReceipt``: prompt and output hashes, every stage
receipt, its own chains over what it sent to stage 0 and received from the tail, node keys and
addresses, measured edge transit, tok/s and α. ``verify_run`` checks, with no network:

- every signature (each stage's, and the coordinator's over the whole receipt);
- the blocks tile ``[0, n_layers)`` in ring order with no gap or overlap;
- the chains link: coordinator-sent == stage 0 input, stage i output == stage i+1 input,
  tail output == coordinator-received (so nobody can claim work it did not pass on);
- the nonce binds to the job (job = H(nonce ‖ prompt hash)) and every stage signed that job;
- the output hash is the hash of the output token ids in the receipt.

Chains hash each chunk's routing header (session-free: job, epoch, seq, start) and its raw
payload (token ids, or hidden-state bytes) — the same bytes on both ends of an edge, so a chain
is a commitment to the exact activations that crossed it. A stage hashes its inputs as they
arrive (stale chunks it later skips included), so chains match under early cancellation.

Pure functions and records; the ``ReceiptSigner`` actor and the wiring live in ``stage.py`` /
``coordinator.py``. What a receipt proves: that the signers *claim* consistent work; together
with spot checks (replaying a chunk on another node) it makes lying detectable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import attrs

from shard.trust.identity import NodeIdentity, verify_signature

RECEIPT_VERSION = 1
_CHAIN_INIT = hashlib.blake2b(b"shard-receipt-chain-v1", digest_size=32).hexdigest()


class ReceiptInvalid(Exception):
    """A receipt failed verification; the message names the first reason found."""


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the receipts hash them: little-endian int64, in order."""
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)


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


def job_id(nonce: str, prompt_hash: str) -> str:
    """The job a nonce and prompt bind to."""
    return _h(bytes.fromhex(nonce) + bytes.fromhex(prompt_hash)).hex()[:32]


def hash_ids(ids: Sequence[int]) -> str:
    return _h(ids_bytes(ids)).hex()


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


@attrs.frozen
class StageReceipt:
    """One stage's signed account of a job."""

    job: str
    nonce: str
    node: str
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
    signature: str = ""

    def signed_bytes(self) -> bytes:
        body = attrs.asdict(self)
        body.pop("signature")
        return _canonical({"kind": "stage", "v": RECEIPT_VERSION, **body})

    def signed(self, identity: NodeIdentity) -> StageReceipt:
        if identity.public.hex() != self.public_key:
            raise ValueError("signing with a key other than the receipt's public_key")
        return attrs.evolve(self, signature=identity.sign(self.signed_bytes()).hex())


@attrs.frozen
class EdgeRecord:
    src: str
    dst: str
    mean_s: float


@attrs.frozen
class RunReceipt:
    """The coordinator's signed account of a whole run."""

    job: str
    nonce: str
    model: str
    n_layers: int
    prompt_hash: str
    output_ids: tuple[int, ...]
    output_hash: str
    coordinator: str
    coordinator_key: str
    sent_chain: str
    received_chain: str
    stages: tuple[StageReceipt, ...]
    edges: tuple[EdgeRecord, ...]
    tok_s: float
    alpha: float | None
    signature: str = ""

    def signed_bytes(self) -> bytes:
        body = attrs.asdict(self, recurse=True)
        body.pop("signature")
        return _canonical({"kind": "run", "v": RECEIPT_VERSION, **body})

    def signed(self, identity: NodeIdentity) -> RunReceipt:
        if identity.public.hex() != self.coordinator_key:
            raise ValueError("signing with a key other than the receipt's coordinator_key")
        return attrs.evolve(self, signature=identity.sign(self.signed_bytes()).hex())

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self, recurse=True), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunReceipt:
        """Errors: ``ReceiptInvalid`` when the text is not a receipt of this version."""
        try:
            data = json.loads(text)
            stages = tuple(StageReceipt(**s) for s in data.pop("stages"))
            edges = tuple(EdgeRecord(**e) for e in data.pop("edges"))
            data["output_ids"] = tuple(data["output_ids"])
            return cls(stages=stages, edges=edges, **data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ReceiptInvalid(f"not a shard run receipt: {exc}") from None


def stage_receipt_from_json(text: str) -> StageReceipt:
    try:
        return StageReceipt(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ReceiptInvalid(f"not a stage receipt: {exc}") from None


def _check_signature(public_hex: str, message: bytes, signature_hex: str, who: str) -> None:
    try:
        public, signature = bytes.fromhex(public_hex), bytes.fromhex(signature_hex)
    except ValueError:
        raise ReceiptInvalid(f"{who}: key or signature is not hex") from None
    if not verify_signature(public, message, signature):
        raise ReceiptInvalid(f"{who}: bad signature (the receipt was altered or forged)")


def verify_run(receipt: RunReceipt) -> None:
    """Check a run receipt offline (see the module docstring). Errors: ``ReceiptInvalid``."""
    _check_signature(
        receipt.coordinator_key, receipt.signed_bytes(), receipt.signature, receipt.coordinator
    )
    if receipt.job != job_id(receipt.nonce, receipt.prompt_hash):
        raise ReceiptInvalid("job id does not bind the nonce to the prompt hash")
    if receipt.output_hash != hash_ids(receipt.output_ids):
        raise ReceiptInvalid("output hash does not match the output token ids")
    if not receipt.stages:
        raise ReceiptInvalid("no stage receipts")
    expected_first = 0
    upstream_chain, upstream = receipt.sent_chain, receipt.coordinator
    for stage in receipt.stages:
        who = f"stage {stage.node} [{stage.first}, {stage.last})"
        _check_signature(stage.public_key, stage.signed_bytes(), stage.signature, who)
        if (stage.job, stage.nonce) != (receipt.job, receipt.nonce):
            raise ReceiptInvalid(f"{who}: signed another job or nonce")
        if stage.first != expected_first or stage.last <= stage.first:
            raise ReceiptInvalid(
                f"{who}: blocks do not tile the layers (expected a block starting at "
                f"{expected_first})"
            )
        if stage.input_chain != upstream_chain:
            raise ReceiptInvalid(f"{who}: input chain differs from what {upstream} sent")
        expected_first = stage.last
        upstream_chain, upstream = stage.output_chain, stage.node
    if expected_first != receipt.n_layers:
        raise ReceiptInvalid(
            f"blocks end at layer {expected_first} but the model has {receipt.n_layers}"
        )
    if receipt.received_chain != upstream_chain:
        raise ReceiptInvalid(f"coordinator received other verdicts than {upstream} sent")


def payload_of(ids: Sequence[int], hidden_data: bytes | None) -> bytes:
    """The bytes a chunk carries: hidden-state bytes on later edges, else its token ids."""
    return hidden_data if hidden_data is not None else ids_bytes(ids)


@attrs.define
class _Job:
    job: str
    nonce: str
    inputs: Chain = attrs.field(factory=Chain)
    outputs: Chain = attrs.field(factory=Chain)
    compute_s: float = 0.0


class ReceiptSigner:
    """A stage's receipt book: chains per job, signed into a ``StageReceipt`` at the end.

    Synchronous and cheap (one BLAKE2b per chunk per direction); the executor calls it in
    frame order — ``received`` as frames arrive, ``sent`` as results leave — so its chains
    match its neighbours' exactly. Only sessions opened with a nonce are recorded.
    """

    def __init__(
        self, identity: NodeIdentity, *, node: str, address: str, first: int, last: int, device: str
    ) -> None:
        self._identity = identity
        self._node = node
        self._address = address
        self._first = first
        self._last = last
        self._device = device
        self._jobs: dict[int, _Job] = {}

    def opened(self, session: int, job: str, nonce: str) -> None:
        if nonce:
            self._jobs[session] = _Job(job, nonce)

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
            compute_s=round(job.compute_s, 6),
            device=self._device,
        )
        return receipt.signed(self._identity)


def verdict_payload(target_ids: Sequence[int], accepted: int) -> bytes:
    """What a verdict contributes to the tail's output chain and the coordinator's input."""
    return ids_bytes(target_ids) + int(accepted).to_bytes(8, "little", signed=True)


@attrs.define
class RunJob:
    """The coordinator's side of one job: its chains and the stage receipts that came back."""

    nonce: str
    prompt_hash: str
    sent: Chain = attrs.field(factory=Chain)
    received: Chain = attrs.field(factory=Chain)
    stages: list[StageReceipt] = attrs.field(factory=list)

    @classmethod
    def start(cls, prompt_ids: Sequence[int], nonce: bytes) -> RunJob:
        return cls(nonce=nonce.hex(), prompt_hash=hash_ids(prompt_ids))

    @property
    def job(self) -> str:
        return job_id(self.nonce, self.prompt_hash)

    def sent_chunk(self, epoch: int, seq: int, start: int, ids: Sequence[int]) -> None:
        self.sent.add(chunk_record(epoch, seq, start, ids_bytes(ids)))

    def received_verdict(
        self, epoch: int, seq: int, start: int, target_ids: Sequence[int], accepted: int
    ) -> None:
        self.received.add(chunk_record(epoch, seq, start, verdict_payload(target_ids, accepted)))

    def stage_receipt(self, text: str) -> None:
        self.stages.append(stage_receipt_from_json(text))

    def finish(
        self,
        identity: NodeIdentity,
        *,
        coordinator: str,
        model: str,
        n_layers: int,
        output_ids: Sequence[int],
        edges: Sequence[EdgeRecord],
        tok_s: float,
        alpha: float | None,
    ) -> RunReceipt:
        """The signed run receipt (stages in ring order)."""
        return RunReceipt(
            job=self.job,
            nonce=self.nonce,
            model=model,
            n_layers=n_layers,
            prompt_hash=self.prompt_hash,
            output_ids=tuple(output_ids),
            output_hash=hash_ids(output_ids),
            coordinator=coordinator,
            coordinator_key=identity.public.hex(),
            sent_chain=self.sent.value,
            received_chain=self.received.value,
            stages=tuple(sorted(self.stages, key=lambda s: s.first)),
            edges=tuple(edges),
            tok_s=round(tok_s, 4),
            alpha=None if alpha is None else round(alpha, 6),
        ).signed(identity)


@attrs.frozen
class RunSigner:
    """What the coordinator needs to sign run receipts: its key, name, the model, the ring."""

    identity: NodeIdentity
    coordinator: str
    model: str
    n_layers: int
    n_stages: int
