"""Auditor: re-runs a sampled chunk of another stage's block and says whether it told the truth.

Any node holding the same block can audit (a standby, a spare, a dedicated auditor). For each
``AuditRequest`` it builds a fresh KV cache, replays the session's earlier chunks into it (the
ones the predecessor's replay log keeps: same inputs, same shapes, same order, so the KV is the
one an honest stage would hold), runs the audited chunk, and compares its output with the
claimed one (``shard.audit.compare.compare``: bit-exact when both ends declare the same device
class and dtype and the accused does not batch, else by seeded sketch against a threshold
calibrated for the two ends' dtypes, ``threshold_for``). At the tail it runs the head on the
rows the choice reads and compares the verdict it chooses from them with the claimed one
(``shard.audit.compare.compare_tokens``: no margin where replay is bit-exact, else
``token_margin``). A failed audit comes back with signed ``Evidence``
(``shard.audit.evidence``) that anyone can check offline.

A replay proves something only on the kernels the accused ran: an auditor holding its block
quantized otherwise (``[swarm] weights``: ``stored``, ``int8``, ``int4``, or dense) than the
accused declared (``AuditRequest.weights``) answers "error" and accuses nobody. Quantized
weights keep batched audits tight: their kernels give each row the same bits alone as among
others, and a batched stage's output equalled the lone replay bit for bit where measured
(``bench/audit_calibration.py``, ``tests/test_quant_audit.py``).

``audit_chunk`` is the synchronous core (tests call it directly); ``Auditor`` is the actor
around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch
import trio

from shard.audit.compare import (
    Comparison,
    blob_of,
    calibrated_threshold,
    choice_rows,
    compare,
    compare_tokens,
    tensor_of,
    wire_of,
)
from shard.audit.evidence import sign_evidence
from shard.compute import offload
from shard.compute.tensors import to_wire
from shard.messages import NodeName
from shard.messages.audit import AuditedChunk, AuditRequest, AuditVerdict, Evidence
from shard.model.llama import StageModel
from shard.spec.audit import AuditSpec
from shard.trust.identity import NodeIdentity

_DEFAULT = AuditSpec()

__all__ = [
    "Auditor",
    "AuditorStatistics",
    "Examiner",
    "audit_chunk",
    "audit_offloaded",
    "dtype_name",
    "kernels",
    "recompute",
    "threshold_for",
]


#: ``weights`` values that hold a block quantized (``shard.spec.device.WEIGHTS``).
QUANTIZED = frozenset({"stored", "int8", "int4"})


class AuditFailed(Exception):
    """A request the auditor cannot run (another block or weights, a malformed chunk)."""


def kernels(weights: str | None) -> str:
    """What a replay must share with the accused besides its dtype: its quantized form, or
    "dense" (None or a float ``weights``, which only names the dtype, compared apart)."""
    return weights if weights in QUANTIZED else "dense"


def dtype_name(model: StageModel) -> str:
    return str(model.dtype).removeprefix("torch.")


def _input(model: StageModel, chunk: AuditedChunk) -> torch.Tensor:
    if chunk.hidden is None:
        return torch.tensor([chunk.ids], dtype=torch.int64, device=model.device)  # [1, S]
    try:
        hidden = tensor_of(chunk.hidden)
    except ValueError as exc:
        raise AuditFailed(f"bad hidden payload in an audit request: {exc}") from None
    return hidden.to(model.device, model.dtype)  # [1, S, D]


def recompute(
    model: StageModel, prior: Sequence[AuditedChunk], chunk: AuditedChunk
) -> torch.Tensor:
    """``chunk``'s output on ``model`` after replaying ``prior`` into a fresh cache: hidden
    states, or at the tail the logits of the rows its choice reads (``[1, R, V]``, the head
    run on those rows only, as the tail runs it)."""
    every = (*prior, chunk)
    end = max(c.start + int(_input(model, c).shape[1]) for c in every)
    cache = model.new_cache(min(end, model.config.max_position_embeddings))
    tail = model.is_last
    with torch.inference_mode():
        for c in prior:
            if tail:
                model(_input(model, c), c.start, cache, head_rows=0)
            else:
                model(_input(model, c), c.start, cache)
        if tail:
            return model(_input(model, chunk), chunk.start, cache, head_rows=choice_rows(chunk))
        return model(_input(model, chunk), chunk.start, cache)


def threshold_for(model: StageModel, req: AuditRequest, policy: AuditSpec) -> float:
    """The sketch threshold for ``req``: the spec's, else calibrated for the accused's declared
    dtype and this auditor's (``shard.audit.compare.calibrated_threshold``)."""
    if policy.cosine_threshold is not None:
        return policy.cosine_threshold
    return calibrated_threshold(req.dtype, dtype_name(model))


def _compare(
    model: StageModel, req: AuditRequest, mine: torch.Tensor, *, exact: bool, policy: AuditSpec
) -> Comparison:
    """The claim against the auditor's result ``mine`` (see ``audit_chunk``)."""
    try:
        claimed = wire_of(req.claimed)
    except ValueError as exc:
        raise AuditFailed(str(exc)) from None
    if model.is_last:
        margin = _margin(model, exact, policy)
        return compare_tokens(claimed, mine, req.chunk, req.sampling, margin=margin)
    return compare(
        claimed,
        to_wire(mine),
        exact=exact,
        seed=bytes.fromhex(req.seed),
        dims=policy.sketch_dims,
        threshold=threshold_for(model, req, policy),
    )


def audit_chunk(
    model: StageModel,
    req: AuditRequest,
    *,
    node: NodeName,
    identity: NodeIdentity,
    device_class: str,
    policy: AuditSpec = _DEFAULT,
    now: int = 0,
    weights: str | None = None,
) -> AuditVerdict:
    """Recompute and compare one chunk; a failure carries signed evidence. ``weights``: how
    ``model`` holds its block (as ``load_stage`` was told).

    Errors: ``AuditFailed`` for a request of another block or weights, or with malformed
    inputs."""
    if (model.first, model.last) != (req.first, req.last):
        raise AuditFailed(
            f"{node} holds layers [{model.first}, {model.last}), not [{req.first}, {req.last})"
        )
    if kernels(weights) != kernels(req.weights):
        raise AuditFailed(
            f"{node} holds layers [{model.first}, {model.last}) as weights = {weights!r}, "
            f"{req.accused} as {req.weights!r}: a replay on other kernels proves nothing; "
            "give the auditor its stage's weights"
        )
    if model.is_last and not choice_rows(req.chunk):
        raise AuditFailed("the tail makes no choice on a prefill chunk before the last")
    try:
        out = recompute(model, req.prior, req.chunk)
    except ValueError as exc:  # chunks the model cannot run: a width, a position, a rollback
        raise AuditFailed(f"the audited chunks do not run on this block: {exc}") from None
    # What the evidence holds: at the tail the logits its choice reads ([R, V], fp32 on the
    # CPU, as it reads them), else the hidden states (a float64 auditor, a reference run,
    # reports in float32: evidence holds wire dtypes only).
    if model.is_last:
        mine = out[0].to("cpu", torch.float32)
    else:
        mine = out.float() if out.dtype == torch.float64 else out
    # Bit-exact only where the accused computed the chunk as the auditor does: same device
    # class and dtype, and no batching (a batched forward sums rows in another order).
    exact = not req.batched and (req.device_class, req.dtype) == (device_class, dtype_name(model))
    result = _compare(model, req, mine, exact=exact, policy=policy)
    recomputed = to_wire(mine)
    evidence = None
    if not result.ok:
        evidence = sign_evidence(
            Evidence(
                accused=req.accused,
                accused_key=req.accused_key,
                first=req.first,
                last=req.last,
                session=req.session,
                index=req.index,
                commitment=req.commitment,
                seed=req.seed,
                prior=req.prior,
                chunk=req.chunk,
                claimed=req.claimed,
                recomputed=blob_of(recomputed),
                method=result.method,
                rate=req.rate,
                dims=policy.sketch_dims,
                threshold=threshold_for(model, req, policy),
                cosine=result.cosine,
                input_proof=req.input_proof,
                output_proof=req.output_proof,
                receipt=req.receipt,
                auditor=node,
                auditor_key=identity.public.hex(),
                signed_at=now,
                sampling=req.sampling,
                margin=_margin(model, exact, policy),
            ),
            identity,
        )
    return AuditVerdict(
        accused=req.accused,
        auditor=node,
        session=req.session,
        index=req.index,
        ok=result.ok,
        method=result.method,
        cosine=result.cosine,
        detail=result.detail,
        evidence=evidence,
        tie=result.tie,
    )


def _margin(model: StageModel, exact: bool, policy: AuditSpec) -> float:
    return policy.token_margin if model.is_last and not exact else 0.0


async def audit_offloaded(
    model: StageModel,
    req: AuditRequest,
    *,
    node: NodeName,
    identity: NodeIdentity,
    device_class: str,
    policy: AuditSpec,
    limiter: trio.CapacityLimiter,
    now: int,
    weights: str | None = None,
) -> AuditVerdict:
    """``audit_chunk`` in the forward pass's worker thread; a request that cannot be run comes
    back as a verdict with ``ok`` True and ``method`` "error" (it accuses nobody)."""

    def work() -> AuditVerdict:
        return audit_chunk(
            model, req, node=node, identity=identity, device_class=device_class,
            policy=policy, now=now, weights=weights,
        )  # fmt: skip

    try:
        return await offload.run_sync(work, limiter=limiter)
    except AuditFailed as exc:
        return AuditVerdict(
            req.accused, node, req.session, req.index, True, "error", None, str(exc)
        )


@attrs.frozen
class AuditorStatistics:
    """Counters of one auditor: audits run, failed, and requests it could not run."""

    audits: int
    failed: int
    errors: int


@attrs.frozen
class Examiner:
    """Who audits and with what: the block it recomputes with (``model``, held as ``weights``
    says: ``audit_chunk``), its node name and signing identity, its device class and the
    swarm's audit policy."""

    model: StageModel
    node: NodeName
    identity: NodeIdentity
    device_class: str
    policy: AuditSpec = _DEFAULT
    weights: str | None = None


class Auditor:
    """Answers each ``AuditRequest`` from ``requests`` with an ``AuditVerdict`` on ``verdicts``.

    The recomputation runs in the forward pass's worker thread behind ``limiter`` (share the
    node's limiter: an auditor that is also a standby must not race its own stage).

    Cancellation: cancelling ``run`` abandons the audit in progress after its thread returns.
    Errors: a request the auditor cannot run (another block or weights, a malformed payload)
    is logged
    as a verdict with ``ok`` True and ``method`` "error" — an unrunnable audit accuses nobody
    — and counted in ``statistics().errors``; bugs propagate. A closed ``requests`` ends
    ``run``.
    """

    def __init__(
        self,
        examiner: Examiner,
        requests: trio.MemoryReceiveChannel[AuditRequest],
        verdicts: trio.MemorySendChannel[AuditVerdict],
        *,
        limiter: trio.CapacityLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        e = examiner
        self._model = e.model
        self._weights = e.weights  # how ``model`` holds its block (``audit_chunk``)
        self._node = e.node
        self._identity = e.identity
        self._device_class = e.device_class
        self._requests = requests
        self._verdicts = verdicts
        self._policy = e.policy
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self._clock = clock
        self._audits = self._failed = self._errors = 0

    def statistics(self) -> AuditorStatistics:
        return AuditorStatistics(self._audits, self._failed, self._errors)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._requests, self._verdicts:
            task_status.started()
            async for req in self._requests:
                await self._verdicts.send(await self._one(req))

    async def _one(self, req: AuditRequest) -> AuditVerdict:
        now = int(self._clock())

        def work() -> AuditVerdict:
            return audit_chunk(
                self._model,
                req,
                node=self._node,
                identity=self._identity,
                device_class=self._device_class,
                policy=self._policy,
                now=now,
                weights=self._weights,
            )

        self._audits += 1
        try:
            verdict = await offload.run_sync(work, limiter=self._limiter)
        except AuditFailed as exc:
            self._errors += 1
            return AuditVerdict(
                req.accused, self._node, req.session, req.index, True, "error", None, str(exc)
            )
        self._failed += not verdict.ok
        return verdict
