"""Receipts that prove what they say: every forgery `shard receipt verify` once accepted is
rejected under a pinned authority (or coordinator key), and an honest receipt from a real run
still verifies, with and without a pin — and without one says its signers were not pinned.

The forgeries (issue 13): re-signed with attacker keys; a secure run's output replaced and
re-signed by its own coordinator; signatures in uppercase or with spaces; duplicate JSON keys;
a fabricated receipt for a run that never happened.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import trio

from receipt_fixtures import (
    PROMPT,
    attacker_tokens,
    fabricate,
    provision,
    resign,
    ring_data,
    run_with_receipt,
    secure_spec,
)
from shard.cli import main
from shard.messages import GenerateDone, RunReceipt, RunStats
from shard.nodes.compose import LocalTrust
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint
from shard.trust.identity import NodeIdentity
from shard.trust.receipt_check import ReceiptPins, receipt_from_json, receipt_to_json, verify_run
from shard.trust.receipts import ReceiptInvalid, hash_ids, sign_run
from shard.wire import decode, encode


@attrs.frozen
class SecureRun:
    receipt: RunReceipt
    keys: LocalTrust

    @property
    def authority(self) -> bytes:
        return self.keys.authority.public

    @property
    def pinned(self) -> ReceiptPins:
        return ReceiptPins(authority=self.authority)

    def coordinator_key(self) -> NodeIdentity:
        return NodeIdentity.load(self.keys.key("coord"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("forgery"), seed=21, n_layers=4)


@pytest.fixture(scope="module")
def secure(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> SecureRun:
    """One real run of a secure spec's ring (keys and tokens from a fresh authority)."""
    keys = provision(tmp_path_factory.mktemp("keys") / "keys")
    receipt = trio.run(lambda: run_with_receipt(secure_spec(tiny, keys), tiny, max_tokens=8))
    return SecureRun(receipt, keys)


def attackers(n: int = 3) -> tuple[NodeIdentity, list[NodeIdentity]]:
    return NodeIdentity.generate(), [NodeIdentity.generate() for _ in range(n)]


def test_honest_secure_receipt_verifies_with_and_without_pins(secure: SecureRun) -> None:
    """A real secure run's receipt verifies unpinned (naming every signer as not pinned),
    pinned to the authority (nothing unpinned), to the coordinator key, and to both."""
    receipt = secure.receipt
    assert receipt.coordinator_token and all(s.token for s in receipt.stages)
    assert verify_run(receipt).unpinned == ("coordinator coord", "stage s0", "stage s1", "stage s2")
    assert verify_run(receipt, secure.pinned).unpinned == ()
    coord = secure.coordinator_key().public
    assert verify_run(receipt, ReceiptPins(coordinator=coord)).unpinned == (
        "stage s0",
        "stage s1",
        "stage s2",
    )
    both = ReceiptPins(authority=secure.authority, coordinator=coord)
    assert verify_run(receipt_from_json(receipt_to_json(receipt)), both).unpinned == ()


def test_receipts_cross_the_wire_typed(secure: SecureRun) -> None:
    """A run receipt inside ``GenerateDone`` survives the one wire codec and still verifies."""
    stats = RunStats(tokens=8, seconds=1.0, tok_s=8.0, prefill_s=0.1, laps=8, mean_lap_s=0.1)
    done = GenerateDone(1, secure.receipt.output_ids, "", "length", stats, receipt=secure.receipt)
    back = decode(encode(done))
    assert back == done
    assert isinstance(back, GenerateDone) and back.receipt is not None
    verify_run(back.receipt, secure.pinned)


def test_resigned_with_attacker_keys_rejected_under_pins(secure: SecureRun) -> None:
    """Re-signed end to end with attacker keys, a receipt is consistent (it passes unpinned,
    and says nothing is pinned) but the authority or the coordinator pin rejects it — also with
    tokens from the attacker's own authority, or with the real tokens attached to other keys."""
    coord, stages = attackers()
    forged = resign(secure.receipt, coord, stages)
    assert len(verify_run(forged).unpinned) == 4
    with pytest.raises(ReceiptInvalid, match="no admission token"):
        verify_run(forged, secure.pinned)
    with pytest.raises(ReceiptInvalid, match="not the pinned"):
        verify_run(forged, ReceiptPins(coordinator=secure.coordinator_key().public))
    own = attacker_tokens(NodeIdentity.generate(), secure.receipt.swarm, coord, stages)
    with pytest.raises(ReceiptInvalid, match="foreign-authority"):
        verify_run(resign(secure.receipt, coord, stages, tokens=own), secure.pinned)
    stolen = {k.public: s.token for k, s in zip(stages, secure.receipt.stages, strict=True)}
    stolen[coord.public] = secure.receipt.coordinator_token
    with pytest.raises(ReceiptInvalid, match="wrong-identity"):
        verify_run(resign(secure.receipt, coord, stages, tokens=stolen), secure.pinned)
    # Only the coordinator replaced: the real stages still vouch, the coordinator does not.
    with pytest.raises(ReceiptInvalid, match="coordinator coord"):
        verify_run(resign(secure.receipt, coord), secure.pinned)


def test_secure_output_replaced_and_resigned_is_rejected(secure: SecureRun) -> None:
    """The real coordinator re-signing another output fails: the output is bound to the tail's
    signed verdicts — and so does replacing the verdicts, or the received chain with them."""
    receipt, coord = secure.receipt, secure.coordinator_key()
    other = tuple((t + 1) % 256 for t in receipt.output_ids)
    replaced = resign(receipt, coord, output_ids=other, output_hash=hash_ids(other))
    for pins in (secure.pinned, ReceiptPins()):
        with pytest.raises(ReceiptInvalid, match="not what the tail chose"):
            verify_run(replaced, pins)
    verdicts = tuple(
        attrs.evolve(v, target_ids=other[v.at - len(PROMPT) :][: len(v.target_ids)])
        for v in receipt.verdicts
    )
    with pytest.raises(ReceiptInvalid, match="not the ones the tail's chain commits to"):
        verify_run(resign(replaced, coord, verdicts=verdicts), secure.pinned)
    from shard.trust.receipts import Chain, verdict_chunk_record

    chain = Chain()
    for v in verdicts:
        chain.add(verdict_chunk_record(v))
    rechained = resign(replaced, coord, verdicts=verdicts, received_chain=chain.value)
    with pytest.raises(ReceiptInvalid, match="other verdicts than s2 sent"):
        verify_run(rechained, secure.pinned)


def _spaced(hex_text: str) -> str:
    return " ".join(hex_text[i : i + 2] for i in range(0, len(hex_text), 2))


@pytest.mark.parametrize("spell", [str.upper, _spaced], ids=["uppercase", "spaces"])
def test_signatures_in_another_spelling_are_rejected(secure: SecureRun, spell: object) -> None:
    """A signature in uppercase hex or with spaces (the same bytes to ``bytes.fromhex``) is
    rejected: the run's own signature, and a stage's under a re-signed run."""
    assert callable(spell)
    receipt = secure.receipt
    run_sig = attrs.evolve(receipt, signature=spell(receipt.signature))
    stages = list(receipt.stages)
    stages[1] = attrs.evolve(stages[1], signature=spell(stages[1].signature))
    stage_sig = sign_run(attrs.evolve(receipt, stages=tuple(stages)), secure.coordinator_key())
    for bad in (run_sig, stage_sig):
        for pins in (secure.pinned, ReceiptPins()):
            with pytest.raises(ReceiptInvalid, match="lowercase hex"):
                verify_run(bad, pins)
        # The same through the file: it parses, and verification refuses the spelling.
        with pytest.raises(ReceiptInvalid, match="lowercase hex"):
            verify_run(receipt_from_json(receipt_to_json(bad)), secure.pinned)


def test_duplicate_json_keys_and_other_spellings_are_rejected(secure: SecureRun) -> None:
    """A receipt file with a key twice (where JSON readers keep the last) is refused, at the
    top level and inside a stage; so is the same JSON spelled any other way."""
    text = receipt_to_json(secure.receipt)
    top = text.replace("{\n", '{\n  "output_ids": [1, 2, 3],\n', 1)
    with pytest.raises(ReceiptInvalid, match="duplicate JSON key 'output_ids'"):
        receipt_from_json(top)
    nested = text.replace('"chunks_in": ', '"compute_s": 0.0,\n      "chunks_in": ', 1)
    with pytest.raises(ReceiptInvalid, match="duplicate JSON key 'compute_s'"):
        receipt_from_json(nested)
    tok_s = f'"tok_s": {json.loads(text)["tok_s"]!r}'
    others = (
        json.dumps(json.loads(text)),  # other spacing and order
        text.rstrip("\n"),
        text.replace(tok_s, tok_s + "0"),  # the same float, spelled with a trailing zero
        text.replace('"swarm": "receipts"', '"swarm": "\\u0072eceipts"'),  # an escaped letter
    )
    for other in others:
        assert other != text
        with pytest.raises(ReceiptInvalid, match="canonical"):
            receipt_from_json(other)
    with pytest.raises(ReceiptInvalid, match="NaN"):
        receipt_from_json(text.replace('"tok_s": ', '"tok_s": NaN, "x": ', 1))


def test_fabricated_receipt_for_a_run_that_never_happened(secure: SecureRun) -> None:
    """A receipt made from nothing passes every self-consistency check, but not a pinned
    authority: neither with keys of its own, nor with its own authority's tokens, nor signed by
    the real coordinator (its stages are not admitted)."""
    coord, stages = attackers(2)
    made = fabricate(coord, stages)
    assert len(verify_run(made).unpinned) == 3
    with pytest.raises(ReceiptInvalid, match="no admission token"):
        verify_run(made, secure.pinned)
    own = attacker_tokens(NodeIdentity.generate(), "receipts", coord, stages)
    with pytest.raises(ReceiptInvalid, match="foreign-authority"):
        verify_run(fabricate(coord, stages, tokens=own), secure.pinned)
    real = secure.coordinator_key()
    tokens = {real.public: secure.receipt.coordinator_token}
    by_real = fabricate(real, stages, tokens=tokens)
    verify_run(by_real, ReceiptPins(coordinator=real.public))  # a coordinator key vouches...
    with pytest.raises(ReceiptInvalid, match=r"stage s0 .* no admission token"):
        verify_run(by_real, secure.pinned)  # ...but under the authority every stage must too


async def test_insecure_run_pins_its_coordinator_key(tiny: Path, tmp_path: Path) -> None:
    """In an insecure swarm a coordinator with a key signs with it: `--coordinator` pins it
    (the stages stay unpinned and are named), another key or `--authority` is refused."""
    coord = NodeIdentity.generate()
    coord.save(tmp_path / "coord.key")
    data = ring_data(tiny)
    data["coordinator"]["key"] = str(tmp_path / "coord.key")
    receipt = await run_with_receipt(SwarmSpec.from_dict(data, source="t.toml"), tiny, max_tokens=6)
    assert receipt.coordinator_key == coord.public.hex() and receipt.coordinator_token == ""
    pinned = verify_run(receipt, ReceiptPins(coordinator=coord.public))
    assert pinned.unpinned == ("stage s0", "stage s1", "stage s2")
    with pytest.raises(ReceiptInvalid, match="not the pinned"):
        verify_run(receipt, ReceiptPins(coordinator=NodeIdentity.generate().public))
    with pytest.raises(ReceiptInvalid, match="insecure swarm"):
        verify_run(receipt, ReceiptPins(authority=NodeIdentity.generate().public))


def test_cli_says_what_was_pinned(
    secure: SecureRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard receipt verify` says NOT pinned without a pin, names the authority with one,
    and exits 1 with INVALID for a forgery under the pin."""
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(receipt_to_json(secure.receipt))
    coord, stages = attackers()
    bad.write_text(receipt_to_json(resign(secure.receipt, coord, stages)))
    assert main(["receipt", "verify", str(good)]) == 0
    out = capsys.readouterr().out
    assert "receipt OK (signers NOT pinned: coordinator coord, stage s0" in out
    authority = str(secure.keys.authority_pub)
    assert main(["receipt", "verify", str(good), "--authority", authority]) == 0
    assert (
        "every signer admitted to swarm 'receipts' by authority ed25519:" in capsys.readouterr().out
    )
    assert main(["receipt", "verify", str(bad), "--authority", authority]) == 1
    assert "receipt INVALID" in capsys.readouterr().err
    assert main(["receipt", "verify", str(bad)]) == 0  # consistent, but says so:
    assert "NOT pinned" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000, "[" * 65 + "]" * 65],
    ids=["lists-100000", "objects-100000", "lists-65"],
)
def test_deeply_nested_receipt_is_refused_in_one_line(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A receipt file nested past the parser's reach or past 64 levels is a one-line
    ReceiptInvalid (exit 1), never a RecursionError traceback."""
    with pytest.raises(ReceiptInvalid, match="nested"):
        receipt_from_json(text)
    path = tmp_path / "deep.json"
    path.write_text(text)
    assert main(["receipt", "verify", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "nested" in err and len(err.splitlines()) == 1 and "Traceback" not in err
