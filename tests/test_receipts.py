"""Signed receipts: a real in-process run verifies offline; any alteration fails with a reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from shard.coordinator.router import Coordinator
from shard.decode.control import SpecConfig
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint
from shard.trust.receipts import ReceiptInvalid, RunReceipt, verify_run

DEADLINE_S = 60.0


def ring_spec(model_dir: Path, draft: str = "none") -> SwarmSpec:
    data: dict[str, Any] = {
        "swarm": {"name": "receipts", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 128, "prefill_chunk": 4},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9200"},
        "stage": [
            {"name": "s0", "listen": "127.0.0.1:9201", "layers": [0, 1]},
            {"name": "s1", "listen": "127.0.0.1:9202", "layers": [1, 3]},
            {"name": "s2", "listen": "127.0.0.1:9203", "layers": [3, 4]},
        ],
        "speculation": {"draft": draft, **({"draft_layers": 2} if draft == "auto" else {})},
    }
    return SwarmSpec.from_dict(data, source="receipts.toml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("receipts"), seed=21, n_layers=4)


async def run_with_receipt(spec: SwarmSpec, model_dir: Path, **kw: Any) -> RunReceipt:
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=model_dir, task_status=task_status)
            )
            coordinator: Coordinator = handle.coordinator
            done = await coordinator.generate([5, 6, 7, 5, 6, 7, 5], receipt=True, **kw)
            nursery.cancel_scope.cancel()
    assert done.receipt is not None
    return done.receipt


async def test_plain_run_receipt_verifies(tiny: Path) -> None:
    """A receipt from a real run verifies: signatures, tiling, chains, nonce, output hash."""
    receipt = await run_with_receipt(ring_spec(tiny), tiny, max_tokens=12)
    verify_run(receipt)
    assert [(s.first, s.last) for s in receipt.stages] == [(0, 1), (1, 3), (3, 4)]
    assert all(s.chunks_in == s.chunks_out for s in receipt.stages[:-1])  # tail: verdicts only
    assert len({s.public_key for s in receipt.stages}) == 3
    # Round trip through the file format keeps it valid.
    verify_run(RunReceipt.from_json(receipt.to_json()))


async def test_pipelined_speculative_receipt_verifies(tiny: Path) -> None:
    """With drafts, pipelining and stale chunks the chains still link end to end."""
    receipt = await run_with_receipt(
        ring_spec(tiny, "auto"), tiny, max_tokens=16, speculation=SpecConfig(k=3, depth=3)
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
    from shard.trust.identity import NodeIdentity
    from shard.trust.receipts import Chain, EdgeRecord, StageReceipt, hash_ids, job_id

    coord, keys = NodeIdentity.generate(), [NodeIdentity.generate() for _ in range(2)]
    nonce, prompt = "ab" * 16, hash_ids([1, 2, 3])
    job = job_id(nonce, prompt)
    a, b, c = Chain(), Chain(), Chain()
    a.add(b"x")
    b.add(b"y")
    c.add(b"z")

    def stage(i: int, first: int, last: int, cin: str, cout: str) -> StageReceipt:
        return StageReceipt(
            job,
            nonce,
            f"s{i}",
            keys[i].public.hex(),
            "h:1",
            first,
            last,
            1,
            1,
            cin,
            cout,
            0.1,
            "cpu",
        ).signed(keys[i])

    def run(stages: tuple[StageReceipt, ...], sent: str, received: str) -> RunReceipt:
        return RunReceipt(
            job, nonce, "m", 4, prompt, (9,), hash_ids([9]), "coord", coord.public.hex(),
            sent, received, stages, (EdgeRecord("coord", "s0", 0.01),), 1.0, None,
        ).signed(coord)  # fmt: skip

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
    data = json.loads(good.to_json())
    data["job"] = "00" * 16
    with pytest.raises(ReceiptInvalid):
        verify_run(RunReceipt.from_json(json.dumps(data)))
