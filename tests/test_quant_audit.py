"""Spot checks on quantized blocks: the auditor replays on the accused's kernels (its
``weights``), a batched quantized stage's output is its lone replay bit for bit (the int4
kernel's row invariance; dense float32 is not), so an honest batched stored ring's audits see
no gap while every lie is still caught; an auditor holding other weights accuses nobody.

A tiny checkpoint in the stored layout (Q4_0 layers, Q8_0 embedding: ``quant_fixtures``);
the charter of the other audit tests: loopback, in-process, bounded.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import attrs
import pytest
import torch
import trio
import trio.testing

from audit_fixtures import AUDITOR_KEY, BatchedDriver, accused_record
from audit_fixtures import one_thread as one_thread
from quant_fixtures import stored_tiny
from receipt_fixtures import ring_spec, run_with_receipt
from shard.audit.auditor import audit_chunk, audit_offloaded, recompute
from shard.audit.compare import tensor_of
from shard.audit.sampler import AuditSampler
from shard.cli import main
from shard.compute.offload import inline_compute
from shard.coordinator.coordinator import Completion
from shard.messages import NodeName
from shard.messages.audit import AuditRequest, AuditVerdict
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.quant import kernel_dtype
from shard.nodes.auditing import weights_of
from shard.nodes.inprocess import run_swarm
from shard.spec.audit import AuditSpec
from shard.testing import make_tiny_checkpoint
from shard.testing.cheats import batched_lies, cheating
from shard.transport import MemoryNetwork
from shard.trust.receipt_check import receipt_to_json, verify_run
from test_failover import MAX_TOKENS, PROMPTS, failover_spec
from test_quant_failover import local_references

POLICY = AuditSpec(rate=1.0)
SESSIONS = 4


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stored_tiny(tmp_path_factory.mktemp("quant-audit"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("quant-audit-f"), seed=5, n_layers=6)


def _blocks(model_dir: Path, weights: str | None) -> tuple[StageModel, StageModel]:
    return load_stage(model_dir, 0, 2, weights=weights), load_stage(
        model_dir, 2, 4, weights=weights
    )


def _requests(
    head: StageModel, accused: StageModel, weights: str | None, seed: int
) -> list[AuditRequest]:
    """Every chunk of ``SESSIONS`` sessions batched through ``accused``, each one audited."""
    rng = random.Random(seed)
    record = attrs.evolve(accused_record(accused, batched=True), weights=weights)
    sampler = AuditSampler(record, seed=rng.randbytes(32), rate=1.0)
    return BatchedDriver(head, accused, sampler).run(list(range(1, SESSIONS + 1)), rng, chunks=12)


def _audit(auditor: StageModel, req: AuditRequest, weights: str | None) -> AuditVerdict:
    return audit_chunk(
        auditor, req, node=NodeName("aud"), identity=AUDITOR_KEY, device_class="cpu",
        policy=POLICY, now=1_700_000_000, weights=weights,
    )  # fmt: skip


def _bit_equal(auditor: StageModel, reqs: list[AuditRequest]) -> int:
    """How many claimed outputs equal the auditor's lone replay bit for bit."""
    same = 0
    for req in reqs:
        mine = recompute(auditor, req.prior, req.chunk)
        same += torch.equal(tensor_of(req.claimed).float(), mine.float())
    return same


@pytest.mark.parametrize(("checkpoint", "weights"), [("stored", "stored"), ("dense", "int4")])
def test_a_batched_quantized_stage_is_its_lone_replay_bit_for_bit(
    checkpoint: str, weights: str, request: pytest.FixtureRequest
) -> None:
    """Batched four sessions at a time, a stage holding int4 weights (stored Q4_0, or a float
    checkpoint quantized at load) sends on exactly what a lone replay computes, every chunk:
    each audit passes with 1 - cosine at the sketch's own rounding (0 gap). Dense float32
    weights, for contrast, are not batch invariant (some chunk differs in its last bits)."""
    model_dir: Path = request.getfixturevalue(checkpoint)
    head, block = _blocks(model_dir, weights)
    reqs = _requests(head, block, weights, seed=7)
    auditor = load_stage(model_dir, 2, 4, weights=weights)
    assert len(reqs) == SESSIONS * 12
    assert _bit_equal(auditor, reqs) == len(reqs)
    verdicts = [_audit(auditor, r, weights) for r in reqs]
    assert all(v.ok and v.method == "sketch" for v in verdicts)
    assert max(1 - (v.cosine or 0.0) for v in verdicts) <= 1e-15
    head_f, block_f = _blocks(model_dir, "float32")
    dense_reqs = _requests(head_f, block_f, "float32", seed=7)
    dense_auditor = load_stage(model_dir, 2, 4, weights="float32")
    assert _bit_equal(dense_auditor, dense_reqs) < len(dense_reqs)


@pytest.fixture
def lying_batches() -> Iterator[None]:
    with batched_lies():
        yield


@pytest.mark.usefixtures("lying_batches")
@pytest.mark.parametrize("kind", ["noise", "skip_layer", "identity"])
def test_each_lie_of_a_batched_stored_stage_fails_its_audit(stored: Path, kind: str) -> None:
    """A stored stage lying on every chunk (noise at 1e-3 of the output's std — 30x below
    the tests' 3e-2 —, a skipped layer, the input passed on), batched four sessions at a
    time, fails every audit against the calibrated float32 threshold."""
    head, honest = _blocks(stored, "stored")
    cheat = cheating(honest, kind, noise=1e-3, seed=3)
    reqs = _requests(head, cheat, "stored", seed=11)
    verdicts = [_audit(honest, r, "stored") for r in reqs]
    assert verdicts and not any(v.ok for v in verdicts), [v.detail for v in verdicts if v.ok]
    assert all(v.evidence is not None for v in verdicts)


def test_an_auditor_on_other_kernels_accuses_nobody(stored: Path) -> None:
    """An auditor whose block is held otherwise than the accused declared (dense against
    stored, stored against int4) answers "error" — ok, no evidence — where a dense replay of
    the same stored chunk would have failed it; with the accused's weights it passes."""
    head, block = _blocks(stored, "stored")
    req = _requests(head, block, "stored", seed=5)[3]
    dense = load_stage(stored, 2, 4, weights="float32")
    for auditor, weights, declared in ((dense, "float32", "stored"), (block, "stored", "int4")):
        verdict = trio.run(
            partial(
                audit_offloaded,
                auditor,
                attrs.evolve(req, weights=declared),
                node=NodeName("aud"),
                identity=AUDITOR_KEY,
                device_class="cpu",
                policy=POLICY,
                limiter=trio.CapacityLimiter(1),
                now=0,
                weights=weights,
            )
        )
        assert verdict.ok and verdict.method == "error" and verdict.evidence is None
        assert "other kernels" in verdict.detail
    if kernel_dtype(torch.device("cpu")) is torch.bfloat16:  # fp32 kernels: dense agrees
        lie = _audit(dense, attrs.evolve(req, weights="float32"), "float32")
        assert not lie.ok  # what a dense auditor unaware of the stage's weights would conclude
    assert _audit(block, req, "stored").ok


def test_a_standby_holds_its_stages_quantized_weights(stored: Path) -> None:
    """A standby (or auditor) with no ``weights`` of its own holds its stage's quantized
    form; a node the spec does not name (it joined) holds the swarm's."""
    spec = attrs.evolve(failover_spec(stored), weights="stored")
    assert weights_of(spec, "s1") == weights_of(spec, "s1-standby") == "stored"
    assert weights_of(spec, "gpu-joined") == "stored"
    spec = spec.with_runtime("s1", weights="int4")
    assert weights_of(spec, "s1-standby") == "int4"
    assert weights_of(spec, "s0-standby") == "stored"
    assert weights_of(failover_spec(stored), "s1-standby") is None


def test_a_batched_stored_ring_is_audited_with_no_gap(stored: Path) -> None:
    """A 3-stage ring with weights = "stored" batching three requests, every chunk audited
    (hold mode: no token is released before its audits pass) by the hot standbys, which hold
    the stored block: every verdict passes with 1 - cosine at rounding (0 gap), and the
    outputs equal the local stored run."""
    # hold mode: every chunk is audited and each verdict's release waits for its audits
    held = AuditSpec(enabled=True, mode="hold")
    spec = attrs.evolve(failover_spec(stored), weights="stored", audit=held)
    assert spec.limits.max_batch_rows > 1  # the swarm batches: requests say batched
    verdicts: list[AuditVerdict] = []
    results: list[Completion] = []

    async def main() -> None:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(
                    partial(run_swarm, spec, model_dir=stored, network=MemoryNetwork())
                )
                checks = handle.checks
                assert checks is not None
                judge = checks.audited

                async def audited(v: AuditVerdict) -> None:
                    verdicts.append(v)
                    await judge(v)

                checks.audited = audited  # type: ignore[method-assign]

                async def one(i: int) -> None:
                    results.append(
                        await handle.coordinator.generate(PROMPTS[i], max_tokens=MAX_TOKENS)
                    )

                async with trio.open_nursery() as requests:
                    for i in range(len(PROMPTS)):
                        requests.start_soon(one, i)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(r.token_ids for r in results) == sorted(local_references(stored, "stored"))
    assert len(verdicts) > 20
    assert all(v.ok and v.method in ("sketch", "tokens") for v in verdicts), verdicts
    worst = max(1 - v.cosine for v in verdicts if v.cosine is not None)
    print(f"stored ring: {len(verdicts)} audits, worst 1 - cosine {worst:.1e}")
    assert worst <= 1e-15


async def test_a_stored_swarms_receipt_verifies_and_a_tampered_one_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run receipt of a 3-stage ring with weights = "stored" passes ``shard receipt
    verify`` (exit 0); the same file with the tail's first target token changed fails
    (exit 1, one line), as does one with a stage's output chain changed."""
    model_dir = stored_tiny(tmp_path, n_layers=4)
    spec = attrs.evolve(ring_spec(model_dir), weights="stored")
    receipt = await run_with_receipt(spec, model_dir, max_tokens=10)
    verify_run(receipt)
    first = receipt.verdicts[0]
    bad_token = attrs.evolve(
        receipt,
        verdicts=(
            attrs.evolve(first, target_ids=(first.target_ids[0] + 1, *first.target_ids[1:])),
            *receipt.verdicts[1:],
        ),
    )
    stage = receipt.stages[1]
    chain = ("0" if stage.output_chain[0] != "0" else "1") + stage.output_chain[1:]
    bad_chain = attrs.evolve(
        receipt,
        stages=(receipt.stages[0], attrs.evolve(stage, output_chain=chain), receipt.stages[2]),
    )
    files = {}
    for name, r in (("good", receipt), ("token", bad_token), ("chain", bad_chain)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(receipt_to_json(r))
    assert main(["receipt", "verify", str(files["good"])]) == 0
    capsys.readouterr()
    for name in ("token", "chain"):
        assert main(["receipt", "verify", str(files[name])]) == 1, name
        err = capsys.readouterr().err
        assert "INVALID" in err and err.count("\n") == 1, err
