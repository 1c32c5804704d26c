"""Signed receipts: a real in-process run verifies offline; any alteration fails with a reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from receipt_fixtures import ring_spec, run_with_receipt
from shard.decode.control import SpeculationConfig
from shard.testing import make_tiny_checkpoint
from shard.trust.receipt_check import receipt_from_json, receipt_to_json, verify_run
from shard.trust.receipts import ReceiptInvalid, RunReceipt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("receipts"), seed=21, n_layers=4)


async def test_plain_run_receipt_verifies(tiny: Path) -> None:
    """A receipt from a real run verifies: signatures, tiling, chains, nonce, output hash."""
    receipt = await run_with_receipt(ring_spec(tiny), tiny, max_tokens=12)
    verify_run(receipt)
    assert receipt.verdicts[0].prefill  # the tail's answer to the prompt comes first
    assert [(s.first, s.last) for s in receipt.stages] == [(0, 1), (1, 3), (3, 4)]
    assert all(s.chunks_in == s.chunks_out for s in receipt.stages[:-1])  # tail: verdicts only
    assert len({s.public_key for s in receipt.stages}) == 3
    # Round trip through the file format keeps it valid.
    verify_run(receipt_from_json(receipt_to_json(receipt)))


async def test_pipelined_speculative_receipt_verifies(tiny: Path) -> None:
    """With drafts, pipelining and stale chunks the chains still link end to end."""
    receipt = await run_with_receipt(
        ring_spec(tiny, "auto"), tiny, max_tokens=16, speculation=SpeculationConfig(k=3, depth=3)
    )
    verify_run(receipt)


def _mutations(receipt: RunReceipt) -> list[tuple[str, RunReceipt]]:
    """Every field of the run and of each stage, altered by one character or one unit."""
    out: list[tuple[str, RunReceipt]] = []

    def alter(value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                return "x"
            flipped = "0" if value[-1] != "0" else "1"
            return value[:-1] + flipped
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return value + 1
        if isinstance(value, float):
            return value + 0.5
        if isinstance(value, tuple) and value and isinstance(value[0], int):
            return (value[0] + 1, *value[1:])
        return None

    for field in attrs.fields(RunReceipt):
        changed = alter(getattr(receipt, field.name))
        if changed is not None:
            out.append((field.name, attrs.evolve(receipt, **{field.name: changed})))
    for i, stage in enumerate(receipt.stages):
        for field in attrs.fields(type(stage)):
            changed = alter(getattr(stage, field.name))
            if changed is None:
                continue
            stages = list(receipt.stages)
            stages[i] = attrs.evolve(stage, **{field.name: changed})
            out.append((f"stages[{i}].{field.name}", attrs.evolve(receipt, stages=tuple(stages))))
    return out


async def test_any_altered_field_fails(tiny: Path) -> None:
    """Flipping any field of the run or of any stage receipt makes verification fail."""
    receipt = await run_with_receipt(ring_spec(tiny), tiny, max_tokens=8)
    mutations = _mutations(receipt)
    assert len(mutations) > 40
    for name, bad in mutations:
        with pytest.raises(ReceiptInvalid):
            verify_run(bad)
        assert name  # each mutation named, for the failure message above


async def test_dropped_or_swapped_stages_fail_with_reasons(tiny: Path) -> None:
    """Dropping a stage receipt or swapping two is caught, and the reason says what broke."""
    receipt = await run_with_receipt(ring_spec(tiny), tiny, max_tokens=8)
    stages = receipt.stages
    dropped = attrs.evolve(receipt, stages=(stages[0], stages[2]))
    swapped = attrs.evolve(receipt, stages=(stages[1], stages[0], stages[2]))
    for bad in (dropped, swapped):
        with pytest.raises(ReceiptInvalid, match="signature"):
            verify_run(bad)  # the coordinator signed the stage list


def test_forged_receipt_caught_beyond_signatures() -> None:
    """Re-signed by a forger, a receipt with broken tiling or chains still fails, by reason."""
    from shard.messages import VerdictRecord
    from shard.trust.identity import NodeIdentity
    from shard.trust.receipts import (
        Chain,
        EdgeRecord,
        StageReceipt,
        hash_ids,
        job_id,
        sign_run,
        sign_stage,
        verdict_chunk_record,
    )

    coord, keys = NodeIdentity.generate(), [NodeIdentity.generate() for _ in range(2)]
    nonce, prompt = "ab" * 16, hash_ids([1, 2, 3])
    job = job_id(nonce, prompt, max_tokens=1, stop_ids=())
    verdicts = (VerdictRecord(0, 0, 0, 3, True, (9,), 0),)
    a, b, c = Chain(), Chain(), Chain()
    a.add(b"x")
    b.add(b"y")
    c.add(verdict_chunk_record(verdicts[0]))  # the tail's output chain: its one verdict

    def stage(i: int, first: int, last: int, cin: str, cout: str) -> StageReceipt:
        return sign_stage(
            StageReceipt(
                job, nonce, f"s{i}", keys[i].public.hex(), "h:1", first, last, 1, 1, cin, cout,
                0.1, "cpu",
            ),
            keys[i],
        )  # fmt: skip

    def run(stages: tuple[StageReceipt, ...], sent: str, received: str) -> RunReceipt:
        return sign_run(
            RunReceipt(
                job, nonce, "lab", "m", 4, prompt, (9,), hash_ids([9]), "coord",
                coord.public.hex(), "", 1_800_000_000, sent, received, stages, verdicts,
                (EdgeRecord("coord", "s0", 0.01),), 1.0, None, "length", 1, (), -1,
            ),
            coord,
        )  # fmt: skip

    good = run(
        (stage(0, 0, 2, a.value, b.value), stage(1, 2, 4, b.value, c.value)), a.value, c.value
    )
    verify_run(good)
    gap = run(
        (stage(0, 0, 1, a.value, b.value), stage(1, 2, 4, b.value, c.value)), a.value, c.value
    )
    with pytest.raises(ReceiptInvalid, match="tile"):
        verify_run(gap)
    broken = run(
        (stage(0, 0, 2, a.value, a.value), stage(1, 2, 4, b.value, c.value)), a.value, c.value
    )
    with pytest.raises(ReceiptInvalid, match="input chain"):
        verify_run(broken)
    short = run((stage(0, 0, 2, a.value, b.value),), a.value, b.value)
    with pytest.raises(ReceiptInvalid, match="model has 4"):
        verify_run(short)
    data = json.loads(receipt_to_json(good))
    data["job"] = "00" * 16
    with pytest.raises(ReceiptInvalid):
        verify_run(receipt_from_json(json.dumps(data, indent=2, sort_keys=True) + "\n"))
