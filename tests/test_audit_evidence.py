"""Evidence of a failed audit: it verifies offline (the accused's own receipt signs what it
claimed), ``shard receipt verify --evidence`` says so, and every forgery is refused."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from audit_fixtures import ACCUSED_KEY, AUDITOR_KEY, Driver, accused_record, tiny_blocks
from shard.audit.auditor import audit_chunk
from shard.audit.compare import blob_of, commit
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
from shard.messages import NodeName, SessionId
from shard.messages.audit import Evidence
from shard.spec.audit import AuditSpec
from shard.testing import cheating, make_tiny_checkpoint
from shard.trust.identity import NodeIdentity
from shard.trust.receipts import ReceiptSigner, sign_stage


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Evidence:
    """A noise cheat's failed audit, after its receipt: bound to the accused's signature."""
    head, honest = tiny_blocks(make_tiny_checkpoint(tmp_path_factory.mktemp("ev"), n_layers=6))
    signer = ReceiptSigner(
        ACCUSED_KEY, node="s1", address="127.0.0.1:1", first=2, last=4, device="cpu"
    )
    sampler = AuditSampler(accused_record(honest), seed=random.Random(4).randbytes(32), rate=0.3)
    cheat = cheating(honest, "noise")
    Driver(head, cheat, sampler, signer).session(1, random.Random(5), chunks=12)
    receipt = signer.close(SessionId(1))
    assert receipt is not None
    requests = sampler.after_receipt(SessionId(1), receipt)
    assert requests, "seed 4 audits none of 12 chunks at rate 0.3"
    verdict = audit_chunk(
        honest,
        requests[-1],
        node=NodeName("aud"),
        identity=AUDITOR_KEY,
        device_class="cpu",
        policy=AuditSpec(rate=0.3),
        now=1_700_000_000,
    )
    assert not verdict.ok and verdict.evidence is not None
    return verdict.evidence


def test_evidence_verifies_offline_bound_to_the_receipt(evidence: Evidence) -> None:
    """The evidence checks out, pinned to the auditor, and the accused's receipt backs it."""
    checked = verify_evidence(evidence, EvidencePins(auditor=AUDITOR_KEY.public))
    assert checked.bound and checked.unpinned == ("accused s1",)
    assert evidence_from_json(evidence_to_json(evidence)) == evidence


def _resigned(ev: Evidence, **changes: object) -> Evidence:
    return sign_evidence(attrs.evolve(ev, **changes), AUDITOR_KEY)


FORGERIES = {
    "altered, not re-signed": lambda ev: attrs.evolve(ev, index=ev.index + 1),
    "claimed set to the truth": lambda ev: _resigned(ev, claimed=ev.recomputed),
    "recomputed set to the claim": lambda ev: _resigned(ev, recomputed=ev.claimed),
    "another seed": lambda ev: _resigned(ev, seed="00" * 32),
    "seed and commitment both swapped after the job": lambda ev: _resigned(
        ev, seed="11" * 32, commitment=commit(bytes([0x11] * 32))
    ),
    "a different audited input": lambda ev: _resigned(
        ev, chunk=attrs.evolve(ev.chunk, start=ev.chunk.start + 1)
    ),
    "a made-up claimed output": lambda ev: _resigned(ev, claimed=blob_of(torch.zeros(1, 1, 64))),
    "receipt of another key": lambda ev: _resigned(
        ev,
        receipt=sign_stage(
            attrs.evolve(ev.receipt, public_key=NodeIdentity.from_seed(b"\x09" * 32).public.hex()),
            NodeIdentity.from_seed(b"\x09" * 32),
        ),
    ),
    "receipt altered": lambda ev: _resigned(
        ev, receipt=attrs.evolve(ev.receipt, chunks_out=ev.receipt.chunks_out + 1)
    ),
    "signed by someone else": lambda ev: sign_evidence(
        attrs.evolve(ev, auditor_key=NodeIdentity.from_seed(b"\x07" * 32).public.hex()),
        NodeIdentity.from_seed(b"\x07" * 32),
    ),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_evidence_is_refused(evidence: Evidence, name: str) -> None:
    """Each forgery fails offline verification (pinned to the real auditor's key)."""
    forged = FORGERIES[name](evidence)
    with pytest.raises(EvidenceInvalid) as info:
        verify_evidence(forged, EvidencePins(auditor=AUDITOR_KEY.public))
    print(f"{name}: {info.value}")


def test_non_canonical_file_is_refused(evidence: Evidence) -> None:
    """A file that is not exactly what was written (respaced) is refused."""
    text = evidence_to_json(evidence).replace('  "accused"', '   "accused"')
    with pytest.raises(EvidenceInvalid, match="canonical"):
        evidence_from_json(text)


def test_cli_verifies_evidence_and_refuses_a_forgery(
    evidence: Evidence, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shard receipt verify --evidence`` exits 0 with one OK line, 1 for a forgery."""
    good, bad = tmp_path / "ev.json", tmp_path / "forged.json"
    good.write_text(evidence_to_json(evidence))
    bad.write_text(evidence_to_json(FORGERIES["claimed set to the truth"](evidence)))
    pub = AUDITOR_KEY.public.hex()
    assert main(["receipt", "verify", "--evidence", str(good), "--auditor", pub]) == 0
    out = capsys.readouterr().out
    assert out.startswith("evidence OK") and "s1" in out and out.count("\n") == 1
    assert main(["receipt", "verify", "--evidence", str(bad), "--auditor", pub]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shard: evidence INVALID") and err.count("\n") == 1
