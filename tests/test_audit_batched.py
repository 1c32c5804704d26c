"""Spot checks on a batching stage (the default): every cheat that changes what a stage sends
on — noise at 3e-2 of the output's std (enough to change greedy tokens), a skipped layer, the
input passed on, and at the tail the wrong token — is caught at the configured rate whether
the liar's forwards are batched or not, with the sketch threshold calibrated from measured
honest noise (``shard.audit.compare.calibrated_threshold``); an honest batched stage is never
accused. Seeds are fixed and printed; measured vs expected chunks until detection are
printed (``-s``)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from audit_fixtures import (  # one_thread: an autouse fixture
    BatchedDriver,
    accused_record,
    one_thread,  # noqa: F401
    run_audit,
    tiny_blocks,
)
from audit_tail_fixtures import TailDriver, tail_blocks, tail_record
from shard.audit.sampler import AuditSampler
from shard.messages import Sampling
from shard.messages.audit import AuditRequest
from shard.model.llama import StageModel
from shard.testing import make_tiny_checkpoint
from shard.testing.cheats import batched_lies, cheating

RATE = 0.25  # higher than the default 0.05 only to keep trials short; 1/RATE is expected
TAIL_RATE = 0.5  # the tail driver's KV holds ~24 verdicts: a higher rate keeps one in range
TRIALS = 12
SESSIONS = 4  # batched together on every step
NOISE = 3e-2  # the lie: changes greedy tokens from the first one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("audit-batched"), seed=5, n_layers=6)


@pytest.fixture(autouse=True)
def lying_batches() -> Iterator[None]:
    """A cheating block lies in batched forwards too (``batched_lies``)."""
    with batched_lies():
        yield


def _first_failures(
    blocks: tuple[StageModel, ...], kind: str, *, batched: bool, seed: int
) -> tuple[list[int], int]:
    """Per session of every trial, the chunks it sent until its first failed audit; and how
    many of the cheater's forwards lied."""
    head, honest = blocks
    rng = random.Random(seed)
    measured: list[int] = []
    lies = 0
    for trial in range(TRIALS):
        cheat = cheating(honest, kind, noise=NOISE, seed=trial)
        accused = accused_record(honest, batched=batched)
        sampler = AuditSampler(accused, seed=rng.randbytes(32), rate=RATE)
        sessions = [trial * SESSIONS + i + 1 for i in range(SESSIONS)]
        reqs = BatchedDriver(head, cheat, sampler, batched=batched).run(sessions, rng, chunks=48)
        measured += _until_caught(honest, reqs, sessions, f"seed {seed} trial {trial}: {kind}")
        lies += cheat.lies  # type: ignore[attr-defined]
    return measured, lies


def _until_caught(
    honest: StageModel, reqs: list[AuditRequest], sessions: list[int], what: str
) -> list[int]:
    """Per session, the chunks it sent until its first failed audit (audited in order)."""
    out = []
    for s in sessions:
        first = next((r for r in reqs if r.session == s and not run_audit(honest, r).ok), None)
        assert first is not None, f"{what} never caught in session {s}"
        out.append(first.index + 1)
    return out


def _report(what: str, measured: list[int], seed: int, rate: float = RATE) -> None:
    mean, se = statistics.fmean(measured), statistics.stdev(measured) / len(measured) ** 0.5
    print(
        f"{what}: chunks until the first failed audit at rate {rate}: measured {mean:.2f} "
        f"(+- {se:.2f}, {len(measured)} sessions, seed {seed}), expected {1 / rate:.2f}"
    )
    assert abs(mean - 1 / rate) <= 4 * se, (what, mean, se)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "lone"])
@pytest.mark.parametrize("kind", ["noise", "skip_layer", "identity"])
def test_each_stage_lie_is_caught_at_the_rate_batched_or_not(
    model_dir: Path, kind: str, batched: bool
) -> None:
    """A middle stage lying on every chunk — batched with three other sessions or alone — is
    caught on every audited chunk: the mean chunks until detection is 1/rate (within 4
    standard errors). Batched, its audits compare by sketch against the calibrated threshold
    (noise at 3e-2 is 1 - cosine ~3e-4, the float32 tolerance 4.9e-10); alone, bit-exactly."""
    blocks = tiny_blocks(model_dir)
    seed = 4000 + 10 * ["noise", "skip_layer", "identity"].index(kind) + batched
    measured, lies = _first_failures(blocks, kind, batched=batched, seed=seed)
    assert lies > 0
    _report(f"{kind} ({'batched' if batched else 'lone'})", measured, seed)


def test_an_honest_batched_stage_is_never_accused(model_dir: Path) -> None:
    """Every chunk of an honest stage batched four sessions at a time, audited by a lone
    recomputation against the calibrated threshold: no accusation."""
    head, honest = tiny_blocks(model_dir)
    rng = random.Random(4100)
    accused = accused_record(honest, batched=True)
    sampler = AuditSampler(accused, seed=rng.randbytes(32), rate=1.0)
    reqs = BatchedDriver(head, honest, sampler).run(list(range(1, 9)), rng, chunks=24)
    verdicts = [run_audit(honest, r) for r in reqs]
    worst = max(1 - (v.cosine or 1.0) for v in verdicts)
    print(f"honest batched stage: {len(verdicts)} audits by sketch, worst 1 - cosine {worst:.3e}")
    assert len(verdicts) == 8 * 24
    assert all(v.ok and v.method == "sketch" for v in verdicts)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "lone"])
def test_a_wrong_token_tail_is_caught_at_the_rate_batched_or_not(
    model_dir: Path, batched: bool
) -> None:
    """A tail choosing the wrong token, its forwards batched four sessions at a time or alone,
    is caught on every audited verdict: verdicts until detection 1/rate (4 standard errors)."""
    head, honest = tail_blocks(model_dir)
    seed = 4200 + batched
    rng = random.Random(seed)
    measured: list[int] = []
    for trial in range(TRIALS):
        cheat = cheating(honest, "wrong_token")
        sampler = AuditSampler(
            tail_record(honest, batched=batched), seed=rng.randbytes(32), rate=TAIL_RATE
        )
        sessions = [(trial * SESSIONS + i + 1, Sampling()) for i in range(SESSIONS)]
        reqs = TailDriver(head, cheat, sampler, batched=batched).run(sessions, rng, steps=24)
        names = [s for s, _ in sessions]
        measured += _until_caught(honest, reqs, names, f"seed {seed} trial {trial}: tail")
    _report(f"wrong_token tail ({'batched' if batched else 'lone'})", measured, seed, TAIL_RATE)


def test_noise_at_3e_2_changes_greedy_tokens(model_dir: Path) -> None:
    """The noise cheat the batched tests use is not harmless: it changes the tail's greedy
    choice on some of the chunks (so an audit that let it through would let wrong tokens
    out)."""
    from shard.model.loader import load_stage

    full_head, mid = tiny_blocks(model_dir)
    tail = load_stage(model_dir, 4, 6)
    rng = random.Random(4300)
    changed = total = 0
    for trial in range(20):
        cheat = cheating(mid, "noise", noise=NOISE, seed=trial)
        c = [m.new_cache(64) for m in (full_head, mid, mid, tail, tail)]
        ids = torch.tensor([[rng.randrange(full_head.config.vocab_size) for _ in range(12)]])
        with torch.inference_mode():
            h = full_head(ids, 0, c[0])
            honest = tail(mid(h, 0, c[1]), 0, c[3])[0].argmax(-1)  # [S]
            lied = tail(cheat(h, 0, c[2]), 0, c[4])[0].argmax(-1)  # type: ignore[arg-type]
        changed += int((honest != lied).sum())
        total += int(honest.numel())
    print(f"noise {NOISE}: {changed} of {total} greedy choices changed")
    assert changed > 0
