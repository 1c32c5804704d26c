"""Spot checks at the tail: its verdicts are recomputed and compared token for token, honest
tails are never accused (bit-exact, batched, and with an auditor of another dtype, greedy and
sampled), a tail that lies is caught at the rate, and its evidence verifies offline while
forgeries do not.

Seeds are fixed and printed; measured numbers (logit differences against the margin, ties,
chunks until detection) are printed beside what they are compared with (``-s``).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import attrs
import pytest
import torch

from audit_fixtures import (  # one_thread: an autouse fixture
    ACCUSED_KEY,
    AUDITOR_KEY,
    POLICY,
    RATE,
    one_thread,  # noqa: F401
    run_audit,
)
from audit_tail_fixtures import SAMPLED, TailDriver, tail_blocks, tail_record
from shard.audit.auditor import recompute
from shard.audit.compare import blob_of, compare_tokens, verdict_blob
from shard.audit.evidence import (
    EvidenceInvalid,
    EvidencePins,
    evidence_from_json,
    evidence_to_json,
    sign_evidence,
    verify_evidence,
)
from shard.audit.sampler import AuditSampler
from shard.cli import main
from shard.messages import Sampling, SessionId
from shard.messages.audit import AuditVerdict, Evidence
from shard.model.llama import StageModel
from shard.spec.audit import AuditSpec
from shard.testing import cheating, make_tiny_checkpoint
from shard.trust.receipts import ReceiptSigner

GREEDY = Sampling()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tail"), seed=5, n_layers=6)


@pytest.fixture(scope="module")
def blocks(model_dir: Path) -> tuple[StageModel, ...]:
    return tail_blocks(model_dir)


def _sessions(first: int) -> list[tuple[int, Sampling]]:
    """Four sessions at once: two greedy, two sampled (seeded)."""
    return [(first + i, GREEDY if i % 2 == 0 else attrs.evolve(SAMPLED, seed=first + i))
            for i in range(4)]  # fmt: skip


@pytest.mark.parametrize(
    ("batched", "auditor_dtype"),
    [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)],
    ids=["exact", "batched", "bfloat16-auditor"],
)
def test_no_false_accusation_of_an_honest_tail_in_1000_audits(
    model_dir: Path,
    blocks: tuple[StageModel, ...],
    batched: bool,
    auditor_dtype: torch.dtype,
) -> None:
    """An honest tail passes every one of >= 1,000 audits: bit-exact replay (no margin), a
    tail batching four sessions per forward, and an auditor in bfloat16 (a different but
    honest kernel order); the largest logit difference between the two ends (every 4th audit
    of the bfloat16 auditor's) is printed against the margin, with the near-ties the margin
    absorbed."""
    head, tail = blocks
    auditor = tail if auditor_dtype == torch.float32 else tail_blocks(model_dir, auditor_dtype)[1]
    seed = 21 + batched + 2 * (auditor_dtype != torch.float32)
    rng = random.Random(seed)
    verdicts: list[AuditVerdict] = []
    worst = 0.0
    compared = 0
    for round_ in range(24):
        sampler = AuditSampler(tail_record(tail, batched=batched), seed=rng.randbytes(32), rate=1.0)
        driver = TailDriver(head, tail, sampler, batched=batched)
        for req in driver.run(_sessions(10 * round_), rng, steps=13):
            verdicts.append(run_audit(auditor, req))
            # The two ends' logits (same dtype: identical), on every 4th audit (~250 pairs:
            # two more recomputations each, which had doubled this test's time).
            if auditor_dtype != torch.float32 and len(verdicts) % 4 == 0:
                mine = recompute(auditor, req.prior, req.chunk)[0].float()
                theirs = recompute(tail, req.prior, req.chunk)[0].float()
                worst = max(worst, float((mine - theirs).abs().max()))
                compared += 1
    ties = sum(v.tie for v in verdicts)
    margin = 0.0 if not batched else POLICY.token_margin
    print(
        f"seed {seed}: {len(verdicts)} honest tail audits ({'batched' if batched else 'lone'}, "
        f"{auditor_dtype} auditor): {sum(not v.ok for v in verdicts)} accusations, {ties} "
        f"near-ties; largest |logit difference| of lone recomputations {worst:.3e} (of "
        f"{compared}), margin "
        f"{margin} (covers differences up to {margin / 2})"
    )
    assert len(verdicts) >= 1000
    assert all(v.ok and v.method == "tokens" for v in verdicts)
    if not batched:
        assert ties == 0  # bit-exact: the same logits, the same choice
    if auditor_dtype == torch.float32:
        assert worst == 0.0  # a lone recomputation is bit-exact on the same device and dtype
    assert worst < POLICY.token_margin / 2
    assert compared >= (250 if auditor_dtype != torch.float32 else 0)


def test_each_tail_lie_is_caught(blocks: tuple[StageModel, ...]) -> None:
    """A tail choosing the wrong token is caught on every audited verdict: the mean number of
    verdicts until the first failed audit matches 1/rate (within 4 standard errors); a tail
    skipping its last layer is caught too (only where it changes a token)."""
    head, honest = blocks
    trials, seed = 40, 31
    rng = random.Random(seed)
    measured = []
    for trial in range(trials):
        cheat = cheating(honest, "wrong_token")
        sampler = AuditSampler(tail_record(honest), seed=rng.randbytes(32), rate=RATE)
        reqs = TailDriver(head, cheat, sampler).run(
            [(trial + 1, GREEDY)], rng, steps=200, stop=lambda r: not run_audit(honest, r).ok
        )
        failed = [r for r in reqs if not run_audit(honest, r).ok]
        assert failed, f"seed {seed} trial {trial}: wrong_token never caught"
        measured.append(failed[0].index + 1)
    mean, se = statistics.fmean(measured), statistics.stdev(measured) / trials**0.5
    print(
        f"wrong_token: verdicts until detection at rate {RATE}: measured {mean:.2f} "
        f"(+- {se:.2f}, {trials} trials, seed {seed}), expected {1 / RATE:.2f}"
    )
    assert abs(mean - 1 / RATE) <= 4 * se
    sampler = AuditSampler(tail_record(honest), seed=rng.randbytes(32), rate=1.0)
    reqs = TailDriver(head, cheating(honest, "skip_layer"), sampler).run(_sessions(1), rng, steps=8)
    verdicts = [run_audit(honest, r) for r in reqs]
    print(f"skip_layer at the tail: {sum(not v.ok for v in verdicts)} of {len(verdicts)} failed")
    assert any(not v.ok for v in verdicts)
    assert all(v.evidence is not None for v in verdicts if not v.ok)


def test_a_near_tie_is_not_a_strike_and_a_lie_past_the_margin_is() -> None:
    """The comparison, on made-up logits: a claimed token a hair below the auditor's is a tie
    (not a strike), one past the margin fails, and so does a verdict whose tokens agree but
    whose accepted count does not — whatever the margin."""
    from shard.messages.audit import AuditedChunk

    logits = torch.zeros(2, 8)
    logits[0, 3], logits[0, 5] = 2.0, 1.9  # row 0: 3 beats 5 by 0.1
    logits[1, 1] = 4.0
    chunk = AuditedChunk(0, 1, 10, hidden=blob_of(torch.zeros(1, 2, 4)), verify=True, draft=(3,))
    assert compare_tokens(verdict_blob((3, 1), 1), logits, chunk, GREEDY, margin=0.0).ok
    tie = compare_tokens(verdict_blob((5,), 0), logits, chunk, GREEDY, margin=0.5)
    assert tie.ok and tie.tie
    assert not compare_tokens(verdict_blob((5,), 0), logits, chunk, GREEDY, margin=0.0).ok
    assert not compare_tokens(verdict_blob((6,), 0), logits, chunk, GREEDY, margin=0.5).ok
    assert not compare_tokens(verdict_blob((3, 1), 0), logits, chunk, GREEDY, margin=50).ok


@pytest.fixture(scope="module")
def evidence(blocks: tuple[StageModel, ...]) -> Evidence:
    """A wrong-token tail's failed audit, after its receipt: bound to the accused's signature."""
    head, honest = blocks
    signer = ReceiptSigner(
        ACCUSED_KEY, node="s2", address="127.0.0.1:1", first=4, last=6, device="cpu"
    )
    sampler = AuditSampler(tail_record(honest), seed=random.Random(4).randbytes(32), rate=0.3)
    TailDriver(head, cheating(honest, "wrong_token"), sampler, signer).run(
        [(1, SAMPLED)], random.Random(5), steps=12
    )
    receipt = signer.close(SessionId(1))
    assert receipt is not None
    requests = sampler.after_receipt(SessionId(1), receipt)
    assert requests, "seed 4 audits none of 11 verdicts at rate 0.3"
    verdict = run_audit(honest, requests[-1])
    assert not verdict.ok and verdict.evidence is not None and verdict.method == "tokens"
    return verdict.evidence


def test_tail_evidence_verifies_offline_bound_to_the_receipt(
    evidence: Evidence, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tail's evidence checks out offline, backed by its receipt, and through the CLI."""
    checked = verify_evidence(evidence, EvidencePins(auditor=AUDITOR_KEY.public))
    assert checked.bound and evidence.sampling == SAMPLED
    assert evidence_from_json(evidence_to_json(evidence)) == evidence
    path = tmp_path / "tail.json"
    path.write_text(evidence_to_json(evidence))
    assert main(["receipt", "verify", "--evidence", str(path)]) == 0
    assert capsys.readouterr().out.startswith("evidence OK")


def _resigned(ev: Evidence, **changes: object) -> Evidence:
    return sign_evidence(attrs.evolve(ev, **changes), AUDITOR_KEY)


def _honest_claim(ev: Evidence) -> object:
    from shard.audit.compare import tail_choice, tensor_of

    ids, accepted = tail_choice(tensor_of(ev.recomputed), ev.chunk, ev.sampling)
    return verdict_blob(ids, accepted)


TAIL_FORGERIES = {
    "claimed set to the auditor's choice": lambda ev: _resigned(ev, claimed=_honest_claim(ev)),
    "a margin wide enough to excuse it": lambda ev: _resigned(ev, margin=100.0),
    "logits of another shape": lambda ev: _resigned(ev, recomputed=blob_of(torch.zeros(9, 3))),
    "a claim that is not a verdict": lambda ev: _resigned(ev, claimed=blob_of(torch.zeros(2))),
    "another position": lambda ev: _resigned(
        ev, chunk=attrs.evolve(ev.chunk, start=ev.chunk.start + 1)
    ),
}


@pytest.mark.parametrize("name", list(TAIL_FORGERIES))
def test_forged_tail_evidence_is_refused(evidence: Evidence, name: str) -> None:
    """Each forgery of a tail's evidence fails offline verification."""
    with pytest.raises(EvidenceInvalid) as info:
        verify_evidence(TAIL_FORGERIES[name](evidence), EvidencePins(auditor=AUDITOR_KEY.public))
    print(f"{name}: {info.value}")


def test_token_margin_is_a_spec_key_with_its_bounds() -> None:
    """``[audit] token_margin`` reads as a number of logits in [0, 100]; 1.0 by default."""
    from shard.spec.audit import AUDIT_KEYS, read_audit
    from shard.spec.validate import SpecError, Table

    def read(value: object) -> AuditSpec:
        return read_audit(Table.open("t.toml", "audit", {"token_margin": value}, AUDIT_KEYS))

    assert AuditSpec().token_margin == 1.0 and read(0.25).token_margin == 0.25
    for bad in (-0.1, 101.0, float("nan")):
        with pytest.raises(SpecError, match="token_margin"):
            read(bad)
