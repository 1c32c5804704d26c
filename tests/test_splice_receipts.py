"""Receipts that survive a splice: a stage killed mid-request and replaced by its hot standby
still gives every request a receipt that verifies, naming who held the block before and after.

The failover harness (``tests/test_failover.py``: three requests, a hot standby per stage,
virtual time) with receipts on; each fault's plan is in the failure message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from shard.messages import NodeName, RunReceipt, SpliceRecord, VerdictRecord
from shard.testing.faults import FaultPlan
from shard.trust.identity import NodeIdentity
from shard.trust.receipt_check import receipt_from_json, receipt_to_json, verify_run
from shard.trust.receipts import (
    CHAIN_START,
    Chain,
    ReceiptInvalid,
    sign_run,
    sign_stage,
    verdict_chunk_record,
)
from splice_receipts import receipts_of, spliced_receipts
from test_failover import model_dir as model_dir


@pytest.fixture(scope="module")
def spliced_s1(model_dir: Path) -> list[RunReceipt]:
    plan = FaultPlan.random(1030, kind="kill", node="s1", frames=(14, 40))
    results, injector = spliced_receipts(model_dir, plan)
    assert injector.fired, f"{plan}: the fault never fired"
    return receipts_of(results)


PREFILL, DECODE = (1, 5), (14, 40)  # frames as in tests/test_failover.py


@pytest.mark.parametrize(
    ("kind", "node", "frames"),
    [
        ("kill", "s0", DECODE),
        ("kill", "s2", DECODE),
        *[("kill", node, PREFILL) for node in ("s0", "s1", "s2")],
        ("stall", "s1", DECODE),  # frozen past dead_after_s: spliced as a dead node
    ],
    ids=["kill-s0-decode", "kill-s2-decode", "kill-s0-prefill", "kill-s1-prefill",
         "kill-s2-prefill", "stall-s1-decode"],
)  # fmt: skip
def test_every_spliced_stage_leaves_receipts_that_verify(
    model_dir: Path, kind: str, node: str, frames: tuple[int, int]
) -> None:
    """Stage 0 (fed by the coordinator), a middle stage or the tail spliced, during prefill
    or decode, killed or frozen: every request's receipt verifies and names the splice."""
    plan = FaultPlan.random(1030, kind=kind, node=node, frames=frames, seconds=(2.0, 4.0))
    results, injector = spliced_receipts(model_dir, plan)
    assert injector.fired, f"{plan}: the fault never fired"
    for receipt in receipts_of(results):
        try:
            verify_run(receipt)
        except ReceiptInvalid as exc:
            raise AssertionError(f"{plan}: {exc}") from None
        (splice,) = receipt.splices
        assert (splice.replaced, splice.by) == (node, f"{node}-standby"), plan
    if node == "s2":  # the spliced-in tail's verdicts stay bound to its signature
        receipt = receipts_of(results)[0]
        last = receipt.verdicts[-1]
        altered = (*receipt.verdicts[:-1], attrs.evolve(last, accepted=last.accepted + 1))
        with pytest.raises(ReceiptInvalid, match="sent other verdicts than the last listed"):
            verify_run(_forged(receipt, verdicts=altered, received_chain=_chain(altered)))


def _chain(verdicts: tuple[VerdictRecord, ...]) -> str:
    chain = Chain()
    for v in verdicts:
        chain.add(verdict_chunk_record(v))
    return chain.value


def _forged(receipt: RunReceipt, **changes: Any) -> RunReceipt:
    """``receipt`` with ``changes``, re-signed by a forger's coordinator key (what is checked
    is then the ring, not the coordinator's signature)."""
    forger = NodeIdentity.generate()
    changed = attrs.evolve(receipt, coordinator_key=forger.public.hex(), **changes)
    return sign_run(changed, forger)


def test_a_spliced_request_receipt_verifies_and_names_the_standby(
    spliced_s1: list[RunReceipt],
) -> None:
    """Every request crossed by the splice: the receipt verifies, through its file too; the
    standby signed the block, its input chain continuing its predecessor's."""
    for receipt in spliced_s1:
        verify_run(receipt_from_json(receipt_to_json(receipt)))
        (splice,) = receipt.splices
        assert (splice.first, splice.last, splice.replaced, splice.by) == (2, 4, "s1", "s1-standby")
        assert 0 <= splice.at_token <= len(receipt.output_ids)
        s0, standby, s2 = receipt.stages
        assert standby.node == "s1-standby" and standby.input_base not in ("", CHAIN_START)
        assert standby.input_chain == s0.output_chain  # the input edge still links exactly
        assert standby.chunks_in < s0.chunks_out  # the rest went to s1 before it died
        assert standby.chunks_out < s2.chunks_in
        assert not s0.input_base and not s2.input_base


def test_a_splice_record_alone_relaxes_no_edge(spliced_s1: list[RunReceipt]) -> None:
    """A splice listed for a block whose stage did not sign that it began mid-job (a
    coordinator excusing the tail's chain, say) changes nothing: the edge must link."""
    receipt = spliced_s1[0]
    ghost = SpliceRecord(4, 6, NodeName("ghost"), NodeName("s2"), 0)
    fewer = receipt.verdicts[:-1]
    forged = _forged(
        receipt, splices=(*receipt.splices, ghost), verdicts=fewer, received_chain=_chain(fewer)
    )
    with pytest.raises(ReceiptInvalid, match="coordinator received other verdicts than s2"):
        verify_run(forged)


def test_a_spliced_receipt_with_its_splice_removed_is_refused(
    spliced_s1: list[RunReceipt],
) -> None:
    """Dropping the splice record (re-signed by whoever) leaves a standby whose chain starts
    mid-job with nobody said to have been replaced: refused."""
    forger = NodeIdentity.generate()
    receipt = spliced_s1[0]
    forged = sign_run(
        attrs.evolve(receipt, splices=(), coordinator_key=forger.public.hex()), forger
    )
    with pytest.raises(ReceiptInvalid, match="starts mid-job, but no splice is listed"):
        verify_run(forged)


def test_a_spliced_standby_cannot_claim_more_than_was_received(
    spliced_s1: list[RunReceipt],
) -> None:
    """The edge out of the standby is checked by counts: more chunks sent than its successor
    received is refused (re-signed with a forger's keys: the check, not the signature)."""
    forger = NodeIdentity.generate()
    receipt = spliced_s1[0]
    s0, standby, s2 = receipt.stages
    inflated = sign_stage(
        attrs.evolve(standby, chunks_out=s2.chunks_in + 1, public_key=forger.public.hex()),
        forger,
    )
    forged = sign_run(
        attrs.evolve(receipt, stages=(s0, inflated, s2), coordinator_key=forger.public.hex()),
        forger,
    )
    with pytest.raises(ReceiptInvalid, match="spliced in, claims"):
        verify_run(forged)
