"""Gathering receipts when the ring is repaired meanwhile (``shard.coordinator.receipts``): a
repair that replaced only stages which had already signed leaves the job whole and drops its
splice records; any other repair still fails the request with its committed tokens."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from shard.coordinator.events import Completion, Resync, RingError, RouteEvent
from shard.coordinator.receipts import collect_receipts, signed_before
from shard.messages import (
    NodeName,
    RunStats,
    SessionId,
    SpliceRecord,
    StageReceipt,
    StageReceiptOut,
)
from shard.trust.identity import NodeIdentity
from shard.trust.receipts import RunJob, RunSigner

BLOCKS = ((0, 2), (2, 4), (4, 6))


def receipt(node: str, block: tuple[int, int]) -> StageReceipt:
    return StageReceipt(
        job="j",
        nonce="n",
        node=NodeName(node),
        public_key="k",
        address="a",
        first=block[0],
        last=block[1],
        chunks_in=1,
        chunks_out=1,
        input_chain="i",
        output_chain="o",
        compute_s=0.0,
        device="cpu",
    )


def job_with(*stages: str) -> RunJob:
    job = RunJob.start([1, 2, 3], os.urandom(16), max_tokens=1, stop_ids=())
    for name, block in zip(stages, BLOCKS, strict=False):
        job.stage_receipt(receipt(name, block))
    return job


def splice(replaced: str, block: tuple[int, int]) -> SpliceRecord:
    return SpliceRecord(block[0], block[1], NodeName(replaced), NodeName(f"{replaced}-sb"), 1)


def test_a_repair_of_a_stage_that_had_signed_leaves_the_job_whole() -> None:
    job = job_with("s0", "s1")
    job.spliced(splice("s0", BLOCKS[0]))  # before: a splice the run took part in
    job.spliced(splice("s1", BLOCKS[1]))
    assert signed_before(job, 1)
    assert job.splices == [splice("s0", BLOCKS[0])]


@pytest.mark.parametrize(
    ("splices", "why"),
    [
        ([], "a repair that spliced nothing (a node back in its slot)"),
        ([("s2", BLOCKS[2])], "the replaced stage had not signed"),
        ([("s1", BLOCKS[1]), ("s2", BLOCKS[2])], "one of two had not signed"),
        ([("s1", BLOCKS[0])], "another block of the same name"),
    ],
)
def test_any_other_repair_is_not_harmless(
    splices: list[tuple[str, tuple[int, int]]], why: str
) -> None:
    job = job_with("s0", "s1")
    for name, block in splices:
        job.spliced(splice(name, block))
    assert not signed_before(job, 0), why
    assert len(job.splices) == len(splices)  # nothing dropped


async def collect(
    job: RunJob, repair: SpliceRecord, *, then: list[RouteEvent]
) -> Completion | RingError:
    """``collect_receipts`` for a 3-stage ring while the ring is repaired: ``repair`` is
    recorded and its ``Resync`` routed once collection has begun (as the coordinator does),
    then the events ``then``."""
    signer = RunSigner(NodeIdentity.generate(), "coord", "m", n_layers=6, n_stages=3)
    send, route = trio.open_memory_channel[RouteEvent](8)
    stats = RunStats(tokens=1, seconds=1.0, tok_s=1.0, prefill_s=0.5, laps=1, mean_lap_s=0.5)
    completion = Completion(token_ids=(7,), finish_reason="length", stats=stats)
    done: list[Completion | RingError] = []

    async def gather() -> None:
        try:
            done.append(await collect_receipts(job, signer, route, completion, timeout_s=1.0))
        except RingError as exc:
            done.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gather)
            await trio.testing.wait_all_tasks_blocked()
            job.spliced(repair)
            for event in [Resync(False, f"{repair.replaced} replaced"), *then]:
                await send.send(event)
    return done[0]


async def test_collection_goes_on_past_a_harmless_repair_and_fails_on_another() -> None:
    last = StageReceiptOut(session=SessionId(1), receipt=receipt("s2", BLOCKS[2]))
    done = await collect(job_with("s0", "s1"), splice("s1", BLOCKS[1]), then=[last])
    assert isinstance(done, Completion)
    assert done.receipt is not None and done.receipt.splices == ()
    failed = await collect(job_with("s0"), splice("s1", BLOCKS[1]), then=[last])
    assert isinstance(failed, RingError)
    assert "repaired before every receipt arrived" in str(failed)
    assert failed.committed == (7,)
