"""Receipts bind how the output ended (issue 29, item 4): whoever holds the coordinator's key
cannot cut the output — to a prefix, to 0 tokens, to a "length" short of the maximum, to a
"stop" where no stop id matched — and re-sign it: under a pinned authority every cut is
refused, and honest receipts of each finish reason still verify.

The attacker here holds the real coordinator's key and token (it re-signs with them), not the
stages' keys: the stages signed the job when the session opened, and the job id binds the
requested maximum and the stop ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
import trio

from receipt_fixtures import provision, resign, ring_spec, run_with_receipt, secure_spec
from shard.cli import main
from shard.decode.control import SpeculationConfig
from shard.messages import RunReceipt
from shard.nodes.compose import LocalTrust
from shard.testing import make_tiny_checkpoint
from shard.trust.identity import NodeIdentity
from shard.trust.receipt_check import ReceiptPins, receipt_from_json, receipt_to_json, verify_run
from shard.trust.receipts import ReceiptInvalid, hash_ids, job_id

MAX_TOKENS = 8
#: What seed 21's tiny model says after ``PROMPT`` (greedy): a stop at this id ends it early.
STOP_ID = 137


@attrs.frozen
class Run:
    receipt: RunReceipt
    keys: LocalTrust

    @property
    def pinned(self) -> ReceiptPins:
        return ReceiptPins(authority=self.keys.authority.public)

    def coordinator_key(self) -> NodeIdentity:
        return NodeIdentity.load(self.keys.key("coord"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> LocalTrust:
    return provision(tmp_path_factory.mktemp("keys") / "keys")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cuts"), seed=21, n_layers=4)


@pytest.fixture(scope="module")
def length(tiny: Path, keys: LocalTrust) -> Run:
    """A secure run that ends at its maximum."""
    receipt = trio.run(
        lambda: run_with_receipt(secure_spec(tiny, keys), tiny, max_tokens=MAX_TOKENS)
    )
    assert receipt.finish_reason == "length" and len(receipt.output_ids) == MAX_TOKENS
    return Run(receipt, keys)


def _with_stop(tiny: Path, model: Path) -> Path:
    """A copy of ``tiny`` whose config lists ``STOP_ID`` as an end-of-sequence id too."""
    shutil.copytree(tiny, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], STOP_ID]
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def stopped(tiny: Path, keys: LocalTrust, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same model with ``STOP_ID`` an end-of-sequence id too: the run stops on it."""
    model = _with_stop(tiny, tmp_path_factory.mktemp("stop") / "model")
    receipt = trio.run(
        lambda: run_with_receipt(secure_spec(model, keys), model, max_tokens=MAX_TOKENS)
    )
    assert receipt.finish_reason == "stop" and STOP_ID not in receipt.output_ids
    assert 0 < len(receipt.output_ids) < MAX_TOKENS and STOP_ID in receipt.stop_ids
    return Run(receipt, keys)


def _cut(run: Run, n: int, **changes: object) -> RunReceipt:
    """``run``'s receipt with its output cut to ``n`` tokens, re-signed by its own coordinator
    (key and token): what a holder of the coordinator's key can make."""
    out = run.receipt.output_ids[:n]
    return resign(
        run.receipt, run.coordinator_key(), output_ids=out, output_hash=hash_ids(out), **changes
    )


def test_honest_receipts_of_each_finish_reason_verify(length: Run, stopped: Run) -> None:
    """A "length" receipt (exactly max_tokens ids, no stop id) and a "stop" receipt (the tail
    chose a stop id right after the output: ``stop_at`` is the output's length) verify under
    the pinned authority."""
    for run in (length, stopped):
        assert verify_run(run.receipt, run.pinned).unpinned == ()
        assert verify_run(receipt_from_json(receipt_to_json(run.receipt)), run.pinned)
    assert length.receipt.stop_at == -1 and verify_run(length.receipt).stop_id is None
    assert stopped.receipt.stop_at == len(stopped.receipt.output_ids)
    assert verify_run(stopped.receipt).stop_id == STOP_ID


async def test_a_pipelined_speculative_stop_verifies(tiny: Path, tmp_path: Path) -> None:
    """With drafts and several chunks in flight (stale verdicts past the stop), a stopped
    run's receipt still recomputes its end from the tail's last words."""
    model = _with_stop(tiny, tmp_path / "model")
    receipt = await run_with_receipt(
        ring_spec(model, "auto"), model, max_tokens=MAX_TOKENS,
        speculation=SpeculationConfig(k=3, depth=3),
    )  # fmt: skip
    assert receipt.finish_reason == "stop"
    assert verify_run(receipt).stop_id == STOP_ID


@pytest.mark.parametrize(
    ("n", "changes", "reason"),
    [
        (5, {}, "after 5 tokens but the request asked for 8"),
        (0, {}, "after 0 tokens but the request asked for 8"),
        (5, {"finish_reason": "stop", "stop_at": 5}, "not a stop id .* cut, not stopped"),
        (0, {"finish_reason": "stop", "stop_at": 0}, "not a stop id .* cut, not stopped"),
        (8, {"finish_reason": "stop", "stop_at": 8}, "not a stop id .* cut, not stopped"),
        (8, {"finish_reason": "cancelled"}, 'ends with "stop" or "length"'),
        (8, {"stop_at": 3}, r"\(stop_at 3\)"),
    ],
    ids=["prefix", "zero", "prefix-as-stop", "zero-as-stop", "length-as-stop", "other", "at"],
)
def test_a_cut_length_receipt_is_refused_under_the_authority(
    length: Run, n: int, changes: dict[str, object], reason: str
) -> None:
    """Cut to a prefix, to 0 tokens, or relabelled as a stop that did not match, and re-signed
    by the real coordinator: refused, saying why."""
    with pytest.raises(ReceiptInvalid, match=reason):
        verify_run(_cut(length, n, **changes), length.pinned)


def test_a_lower_maximum_cannot_be_claimed_after_the_run(length: Run) -> None:
    """Claiming the cut's length as the maximum breaks the job id; recomputing the job id
    breaks every stage's signature (they signed the job with the real maximum)."""
    r = length.receipt
    with pytest.raises(ReceiptInvalid, match="end rules"):
        verify_run(_cut(length, 5, max_tokens=5), length.pinned)
    job = job_id(r.nonce, r.prompt_hash, max_tokens=5, stop_ids=r.stop_ids)
    with pytest.raises(ReceiptInvalid, match="signed another job"):
        verify_run(_cut(length, 5, max_tokens=5, job=job), length.pinned)
    # Claiming the token after the cut as a stop id: the job id again.
    stops = tuple(sorted({*r.stop_ids, r.output_ids[5]}))
    with pytest.raises(ReceiptInvalid, match="end rules"):
        verify_run(_cut(length, 5, finish_reason="stop", stop_at=5, stop_ids=stops), length.pinned)


def test_a_cut_stop_receipt_is_refused_under_the_authority(stopped: Run) -> None:
    """A stopped run cut before its stop (still claiming "stop", at the cut or at the old
    index), or relabelled "length" short of the maximum, is refused."""
    n = len(stopped.receipt.output_ids)
    for cut, changes, reason in (
        (n - 1, {"stop_at": n - 1}, "cut, not stopped"),
        (n - 1, {}, "cut, not stopped"),
        (0, {"stop_at": 0}, "cut, not stopped"),
        (n, {"finish_reason": "length", "stop_at": -1}, "the output was cut"),
    ):
        with pytest.raises(ReceiptInvalid, match=reason):
            verify_run(_cut(stopped, cut, **changes), stopped.pinned)


def test_a_version_2_receipt_is_refused_with_a_reason(length: Run) -> None:
    """A receipt without the end fields (version 2) is refused, saying it cannot show that
    its output was not cut."""
    data = json.loads(receipt_to_json(length.receipt))
    for key in ("finish_reason", "max_tokens", "stop_ids", "stop_at"):
        del data[key]
    old = json.dumps(data, indent=2, sort_keys=True) + "\n"
    with pytest.raises(ReceiptInvalid, match=r"version-2 receipt.*not cut"):
        receipt_from_json(old)


def test_cli_refuses_a_cut_and_says_how_a_run_ended(
    length: Run, stopped: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard receipt verify --authority` says how an honest run ended and exits 1 on a cut."""
    authority = str(length.keys.authority_pub)
    files = {
        "length": (length.receipt, 0, "8 tokens, ended at max_tokens 8"),
        "stop": (stopped.receipt, 0, f"stopped at stop id {STOP_ID} (max_tokens 8)"),
        "cut": (_cut(length, 3), 1, "receipt INVALID"),
    }
    for name, (receipt, code, said) in files.items():
        path = tmp_path / f"{name}.json"
        path.write_text(receipt_to_json(receipt))
        assert main(["receipt", "verify", str(path), "--authority", authority]) == code
        out = capsys.readouterr()
        assert said in (out.out if code == 0 else out.err)


def test_an_integer_past_int64_is_refused_not_a_crash(length: Run) -> None:
    """A signed receipt holding an id or a maximum past int64 is refused with a reason (the
    chains and hashes encode int64: hashing it would raise)."""
    coord = length.coordinator_key()
    for changes in ({"max_tokens": 2**64}, {"output_ids": (2**70,), "output_hash": "00" * 32}):
        with pytest.raises(ReceiptInvalid, match="past int64"):
            verify_run(resign(length.receipt, coord, **changes))
