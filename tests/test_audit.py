"""Spot checks, the pure core: commitments, choosing chunks, comparing honestly different
results, catching every cheat at the rate the audits run, and evidence anyone can check.

Seeds are fixed and printed; measured numbers (cosines, chunks until detection) are printed
beside what they are compared with (run with ``-s`` to read them).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import attrs
import pytest
import torch

from audit_fixtures import (  # one_thread: an autouse fixture
    RATE,
    Driver,
    accused_record,
    one_thread,  # noqa: F401
    run_audit,
    tiny_blocks,
)
from shard.audit.auditor import dtype_name
from shard.audit.compare import calibrated_threshold, commit, is_audited, pick
from shard.audit.sampler import AuditSampler
from shard.messages.audit import AuditVerdict
from shard.model.llama import StageModel
from shard.testing import cheating, make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("audit"), seed=5, n_layers=6)


@pytest.fixture(scope="module")
def blocks(model_dir: Path) -> tuple[StageModel, ...]:
    return tiny_blocks(model_dir)


def test_commitment_hides_and_binds_the_seed() -> None:
    """The commitment is a fixed-length hash that changes with the seed."""
    a, b = bytes(32), bytes([1]) + bytes(31)
    assert len(commit(a)) == 64 and commit(a) != commit(b) and commit(a) == commit(a)


def test_choice_is_uniform_and_follows_the_rate() -> None:
    """Over many chains the chosen fraction matches the rate; the seed changes the choice."""
    rng = random.Random(3)
    seed, other = rng.randbytes(32), rng.randbytes(32)
    chains = [rng.randbytes(32).hex() for _ in range(20000)]
    chosen = [is_audited(seed, c, 0.05) for c in chains]
    print(f"chosen fraction {sum(chosen) / len(chains):.4f} at rate 0.05")
    assert abs(sum(chosen) / len(chains) - 0.05) < 0.006
    assert sum(a != is_audited(other, c, 0.05) for a, c in zip(chosen, chains, strict=True)) > 0
    assert all(0.0 <= pick(seed, c) < 1.0 for c in chains[:100])


def _honest_audits(
    blocks: tuple[StageModel, ...], auditor: StageModel, *, sessions: int, seed: int
) -> list[AuditVerdict]:
    head, accused = blocks
    rng = random.Random(seed)
    sampler = AuditSampler(accused_record(accused), seed=rng.randbytes(32), rate=1.0)
    driver = Driver(head, accused, sampler)
    verdicts = []
    for s in range(sessions):
        for req in driver.session(s + 1, rng, chunks=11):
            verdicts.append(run_audit(auditor, req))
    return verdicts


def test_no_false_accusation_in_1100_exact_audits(blocks: tuple[StageModel, ...]) -> None:
    """Same device class and dtype: 1,050 audits of an honest stage all match bit for bit."""
    verdicts = _honest_audits(blocks, blocks[1], sessions=100, seed=11)
    print(f"exact: {len(verdicts)} honest audits, {sum(not v.ok for v in verdicts)} accusations")
    assert len(verdicts) >= 1000
    assert all(v.ok and v.method == "exact" for v in verdicts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_no_false_accusation_in_1100_sketch_audits(
    model_dir: Path, blocks: tuple[StageModel, ...], dtype: torch.dtype
) -> None:
    """Another kernel order (the auditor in float64, or bfloat16): 1,050 honest audits by
    sketch, none below the calibrated threshold; the margin is printed for docs/security.md."""
    auditor = tiny_blocks(model_dir, dtype)[1]
    verdicts = _honest_audits(blocks, auditor, sessions=100, seed=12)
    cosines = [v.cosine for v in verdicts if v.cosine is not None]
    low = min(cosines)
    threshold = calibrated_threshold("float32", dtype_name(auditor))
    print(
        f"sketch ({dtype_name(auditor)} auditor vs float32 stage): {len(verdicts)} honest "
        f"audits, 1 - min cosine = {1 - low:.3e}, calibrated tolerance 1 - threshold = "
        f"{1 - threshold:.3e} ({(1 - threshold) / max(1 - low, 1e-300):.0f}x the worst)"
    )
    assert len(cosines) >= 1000
    assert all(v.ok and v.method == "sketch" for v in verdicts)


def _expected_when_unaudited(rate: float, window: int) -> float:
    """Mean chunks until a stage that lies only when unaudited for ``window`` chunks is
    caught: value iteration over chunks-since-the-last-audit (capped at the window)."""
    e = [0.0] * (window + 1)
    for _ in range(20000):
        new = []
        for s in range(window + 1):
            nxt = e[min(s + 1, window)]
            if s >= window:  # lying: caught if audited
                new.append(1 + (1 - rate) * nxt)
            else:  # honest: an audit resets the count
                new.append(1 + rate * e[0] + (1 - rate) * nxt)
        e = new
    return e[window]


CHEAT_CASES = {
    # kind: (options, expected chunks until the first failed audit at RATE)
    "skip_layer": ({}, 1 / RATE),
    "noise": ({}, 1 / RATE),
    "identity": ({}, 1 / RATE),
    # the first two chunks cannot be replayed stale (nothing before, then another shape)
    "stale": ({}, 2 + 1 / RATE),
    "one_in_n": ({"every": 3}, 3 / RATE),
    "when_unaudited": ({"window": 8}, _expected_when_unaudited(RATE, 8)),
}


@pytest.mark.parametrize("kind", list(CHEAT_CASES))
def test_each_cheat_is_caught_at_the_rate(blocks: tuple[StageModel, ...], kind: str) -> None:
    """Every cheat kind is caught, exactly; the mean number of chunks until the first failed
    audit matches its expected value at the configured rate (within 4 standard errors)."""
    head, honest = blocks
    options, expected = CHEAT_CASES[kind]
    trials, seed = 60, 1000 + list(CHEAT_CASES).index(kind)
    rng = random.Random(seed)
    measured = []
    for trial in range(trials):
        cheat = cheating(honest, kind, seed=trial, **options)
        sampler = AuditSampler(accused_record(honest), seed=rng.randbytes(32), rate=RATE)
        caught = [
            r
            for r in Driver(head, cheat, sampler, audited=cheat.audited).session(
                trial + 1, rng, chunks=400, stop=lambda r: not run_audit(honest, r).ok
            )
            if not run_audit(honest, r).ok
        ]
        assert caught, f"seed {seed} trial {trial}: {kind} never caught in 400 chunks"
        measured.append(caught[0].index + 1)
    mean, sd = statistics.fmean(measured), statistics.stdev(measured)
    se = sd / trials**0.5
    print(
        f"{kind}: chunks until detection at rate {RATE}: measured {mean:.2f} "
        f"(+- {se:.2f}, {trials} trials, seed {seed}), expected {expected:.2f}"
    )
    assert abs(mean - expected) <= 4 * se, (kind, mean, expected, se)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_lie_is_caught_by_sketch_only_above_the_rounding_noise(
    model_dir: Path, blocks: tuple[StageModel, ...], dtype: torch.dtype
) -> None:
    """On the sketch path, with the threshold calibrated to the two ends' dtypes, gross lies
    fail it on every chunk. Noise at 1e-3 of the output's std fails it too where both ends
    compute in float32 or finer (a float64 auditor: the tolerance is rounding-level); against
    a bfloat16 auditor it passes (below what mixed precision honestly differs by)."""
    head, honest = blocks
    auditor = tiny_blocks(model_dir, dtype)[1]
    rng = random.Random(7)
    found: dict[str, float] = {}
    for kind in ("skip_layer", "identity", "noise"):
        cheat = cheating(honest, kind)
        sampler = AuditSampler(accused_record(honest), seed=rng.randbytes(32), rate=1.0)
        reqs = Driver(head, cheat, sampler).session(1, rng, chunks=6)
        verdicts = [run_audit(auditor, r) for r in reqs]
        found[kind] = 1 - max(v.cosine or 1.0 for v in verdicts)
        assert all(v.method == "sketch" for v in verdicts)
        if kind != "noise" or dtype == torch.float64:
            assert not any(v.ok for v in verdicts), kind
        else:
            assert all(v.ok for v in verdicts), kind
    tolerance = 1 - calibrated_threshold("float32", dtype_name(auditor))
    print(
        f"{dtype_name(auditor)} auditor: 1 - cosine of each lie (least on any chunk):",
        {k: f"{v:.3e}" for k, v in found.items()},
        f"tolerance {tolerance:.3e}",
    )


def test_auditor_refuses_another_block(blocks: tuple[StageModel, ...]) -> None:
    """A request for layers the auditor does not hold is an error, not a verdict."""
    from shard.audit.auditor import AuditFailed

    head, accused = blocks
    sampler = AuditSampler(accused_record(accused), seed=bytes(32), rate=1.0)
    (req, *_) = Driver(head, accused, sampler).session(1, random.Random(1), chunks=2)
    with pytest.raises(AuditFailed, match="holds layers"):
        run_audit(head, attrs.evolve(req))


def test_audited_chunks_the_block_cannot_run_are_an_error_not_a_crash(
    blocks: tuple[StageModel, ...],
) -> None:
    """A request whose chunk the auditor's block cannot run (hidden states of another
    width: a malformed or hostile request) is ``AuditFailed`` — an error verdict that accuses
    nobody — never an exception out of the auditor."""
    from shard.audit.auditor import AuditFailed
    from shard.audit.compare import blob_of

    head, accused = blocks
    sampler = AuditSampler(accused_record(accused), seed=bytes(32), rate=1.0)
    (req, *_) = Driver(head, accused, sampler).session(1, random.Random(1), chunks=2)
    assert req.chunk.hidden is not None
    wrong = blob_of(torch.zeros(1, 2, 7))  # not the model's width
    with pytest.raises(AuditFailed, match="do not run on this block"):
        run_audit(accused, attrs.evolve(req, chunk=attrs.evolve(req.chunk, hidden=wrong)))
