"""Receipts from the failover harness: the three requests of ``tests/test_failover.py`` run
with receipts on a ring with a hot standby per stage, one node killed mid-request by a seeded
``FaultPlan``, in virtual time. Shared by the splice-receipt and ledger tests."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
import trio.testing

from shard.compute.offload import inline_compute
from shard.coordinator.coordinator import Completion, RingError
from shard.messages import RunReceipt
from shard.spec.ledger import LedgerSpec
from shard.spec.trust import CredentialPaths
from shard.testing.faults import FaultInjector, FaultPlan
from shard.transport import MemoryNetwork
from test_failover import MAX_TOKENS, PROMPTS, failover_spec, start_swarm


def spliced_receipts(
    model_dir: Path,
    plan: FaultPlan | None,
    *,
    coordinator_key: Path | None = None,
    receipt_log: Path | None = None,
    asked: bool = True,
) -> tuple[list[Completion | RingError], FaultInjector]:
    """Run ``PROMPTS`` with receipts under ``plan``'s fault; every request's result. The
    coordinator signs with ``coordinator_key`` if given (else a fresh key) and keeps every
    receipt in ``receipt_log`` (``[ledger] receipts``) if given; ``asked``: the requests ask
    for their receipts (``receipt=True``)."""
    injector = FaultInjector(plan or FaultPlan(0, ()))
    results: list[Completion | RingError | None] = [None] * len(PROMPTS)
    spec = failover_spec(model_dir)
    if coordinator_key is not None:
        keyed = attrs.evolve(spec.coordinator, credentials=CredentialPaths(key=coordinator_key))
        spec = attrs.evolve(spec, coordinator=keyed)
    if receipt_log is not None:
        spec = attrs.evolve(spec, ledger=LedgerSpec(receipts=str(receipt_log)))

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await start_swarm(
                    nursery,
                    spec,
                    model_dir,
                    network=MemoryNetwork(),
                    wrap=injector.wrap,
                    scopes=injector.scopes,
                )

                async def one(i: int) -> None:
                    try:
                        results[i] = await handle.coordinator.generate(
                            PROMPTS[i], max_tokens=MAX_TOKENS, receipt=asked
                        )
                    except RingError as exc:
                        results[i] = exc

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return [r for r in results if r is not None], injector


def receipts_of(results: list[Completion | RingError]) -> list[RunReceipt]:
    out = []
    for r in results:
        assert isinstance(r, Completion), f"a request failed: {r}"
        assert r.receipt is not None
        out.append(r.receipt)
    return out
