"""A request resumed by a second coordinator signs a receipt that names the request it
resumes, and the ledger counts the request once: the failover harness's coordinator restart
(``tests/test_failover.py``) with receipts on, in virtual time."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
import trio.testing

from shard.compute.offload import inline_compute
from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.coordinator import Completion
from shard.messages import ResumeRecord
from shard.nodes.coordinator import CoordinatorHandle, run_coordinator
from shard.testing import generate_watching
from shard.transport import MemoryNetwork
from shard.trust.ledger import LedgerPins, build_ledger
from shard.trust.receipt_check import receipt_from_json, receipt_to_json, verify_run
from test_failover import MAX_TOKENS, PROMPTS, failover_spec, start_swarm
from test_failover import model_dir as model_dir
from test_failover import references as references


def _restart(model_dir: Path, tmp_path: Path) -> tuple[RequestCheckpoint, Completion]:
    """Run PROMPTS[1] with a receipt, kill the coordinator after 8 tokens, resume the request
    with a receipt on a new coordinator; the checkpoint resumed and the completion."""
    base = failover_spec(model_dir, standbys=False)
    spec = attrs.evolve(
        base, failover=attrs.evolve(base.failover, checkpoint_dir=str(tmp_path / "ckpt"))
    )
    out: list[tuple[RequestCheckpoint, Completion]] = []

    async def main() -> None:
        network = MemoryNetwork()
        scopes: dict[str, trio.CancelScope] = {}
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                first = await start_swarm(nursery, spec, model_dir, network=network, scopes=scopes)
                halfway, seen = trio.Event(), []

                def tokens(ids: tuple[int, ...]) -> None:
                    seen.extend(ids)
                    if len(seen) >= 8:
                        halfway.set()

                with trio.CancelScope() as request:

                    async def ask() -> None:
                        await generate_watching(
                            first.coordinator,
                            PROMPTS[1],
                            tokens,
                            max_tokens=MAX_TOKENS,
                            request_id="r1",
                            receipt=True,
                        )

                    nursery.start_soon(ask)
                    await halfway.wait()
                    scopes["coord"].cancel()  # the coordinator dies, its request with it
                    request.cancel()
                (checkpoint,) = CheckpointStore(tmp_path / "ckpt").pending()
                second: CoordinatorHandle = await nursery.start(
                    lambda task_status: run_coordinator(
                        spec, network=network, model_dir=model_dir, task_status=task_status
                    )
                )
                done = await second.coordinator.resume_request(checkpoint, receipt=True)
                out.append((checkpoint, done))
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out[0]


def test_a_resumed_request_signs_a_receipt_naming_it_and_counts_once(
    model_dir: Path, references: list[tuple[int, ...]], tmp_path: Path
) -> None:
    """The checkpoint holds the first run's job; the resumed run's receipt verifies, covers
    the new tokens and names that job; the ledger counts it (the tokens before the restart
    were signed by nobody, the first coordinator died: counted as unsigned)."""
    checkpoint, done = _restart(model_dir, tmp_path)
    assert done.token_ids == references[1]
    assert len(checkpoint.job) == 32 and checkpoint.output_ids
    receipt = done.receipt
    assert receipt is not None
    verify_run(receipt_from_json(receipt_to_json(receipt)))
    k = len(checkpoint.output_ids)
    assert receipt.resumes == ResumeRecord("r1", checkpoint.job, k)
    assert receipt.output_ids == done.token_ids[k:]
    assert receipt.job != checkpoint.job
    pins = LedgerPins(coordinators=frozenset({bytes.fromhex(receipt.coordinator_key)}))
    book = build_ledger([("resumed.json", receipt_to_json(receipt).encode())], pins, "all")
    assert book.refused == ()
    assert book.totals.receipts == 1 and book.totals.tokens == len(done.token_ids) - k
    # delivered before the restart, signed by nobody: counted apart, so the two add up to
    # what the client received
    assert book.totals.unsigned_tokens == k
    assert book.totals.tokens + book.totals.unsigned_tokens == len(done.token_ids)
