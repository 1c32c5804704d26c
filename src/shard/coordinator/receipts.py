"""Gathering a request's receipts once its session ended: every stage's signed receipt from
the session's route, then the coordinator's signed run receipt over them.

A plain coroutine over the route (no actor of its own): the router calls it in the request's
task, after the driver ended and the session's ``EndSession`` went out.
"""

from __future__ import annotations

import attrs
import trio

from shard.coordinator.events import Completion, Resync, RingError, RouteEvent
from shard.coordinator.receipt_log import ReceiptLog
from shard.messages import Fault, StageReceiptOut, Verdict
from shard.trust.receipts import EdgeRecord, RunJob, RunSigner


async def collect_receipts(
    job: RunJob,
    signer: RunSigner,
    route: trio.MemoryReceiveChannel[RouteEvent],
    completion: Completion,
    timeout_s: float,
) -> Completion:
    """Gather every stage's receipt (recording the verdicts still in flight, which the tail's
    chain includes), and sign the run receipt.

    A repair meanwhile is harmless when every stage it replaced had already signed (its
    receipt is in): that stage computed all of this job, and the splice record the repair
    added is dropped, for the splice is no part of this run. Any other repair fails it.

    Errors: ``RingError`` (with the committed tokens) when a stage faults, the ring is
    repaired meanwhile and a replaced stage had not signed yet (the session had ended before
    the standby had it, so nobody signs that block), or receipts are missing after
    ``timeout_s`` (the spec's ``limits.receipt_timeout_s``).
    """
    known = len(job.splices)  # the repairs before: each request handled its own
    with trio.move_on_after(timeout_s) as waited:
        while len(job.stages) < signer.n_stages:
            msg = await route.receive()
            if isinstance(msg, Verdict):
                job.received_verdict(msg.epoch, msg.seq, msg.start, msg.target_ids, msg.accepted)
            elif isinstance(msg, StageReceiptOut):
                job.stage_receipt(msg.receipt)
            elif isinstance(msg, Fault) and msg.kind != "gap":
                raise RingError(f"{msg.node}: {msg.detail}", committed=completion.token_ids)
            elif isinstance(msg, Resync):
                if signed_before(job, known):
                    continue
                raise RingError(
                    f"the ring was repaired before every receipt arrived ({msg.reason}): "
                    "a repair while receipts are collected can leave a stage's receipt "
                    "unsigned (a replaced stage's, always)",
                    committed=completion.token_ids,
                )
    if waited.cancelled_caught:
        raise RingError(
            f"only {len(job.stages)} of {signer.n_stages} stage receipts arrived",
            committed=completion.token_ids,
        )
    stats = completion.stats
    run = job.finish(
        signer,
        output_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        edges=[EdgeRecord(e.src, e.dst, round(e.mean_s, 6)) for e in stats.edges],
        tok_s=stats.tok_s,
        alpha=stats.accepted / stats.drafted if stats.drafted else None,
    )
    return attrs.evolve(completion, receipt=run)


def signed_before(job: RunJob, known: int) -> bool:
    """Whether the repairs after the job's first ``known`` splice records replaced only
    stages whose receipts for it are already in; if so their records are dropped (the job
    was done there before the splice). False for a repair that spliced nothing (a node back
    in its own slot: frames on its broken link may be lost) or replaced a stage that had
    not signed."""
    new = job.splices[known:]
    done = {(s.node, s.first, s.last) for s in job.stages}
    if not new or any((sp.replaced, sp.first, sp.last) not in done for sp in new):
        return False
    del job.splices[known:]
    return True


async def kept(completion: Completion, log: ReceiptLog | None, *, wanted: bool) -> Completion:
    """``completion`` once its receipt is in the coordinator's receipt ``log`` (if any),
    without the receipt when its caller did not ask for one (signed for the log only)."""
    if log is not None and completion.receipt is not None:
        await log.keep(completion.receipt)
    return completion if wanted else attrs.evolve(completion, receipt=None)


__all__ = ["collect_receipts", "kept", "signed_before"]
