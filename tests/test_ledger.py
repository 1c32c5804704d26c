"""The metering ledger (``shard.trust.ledger``, ``shard ledger``): receipts of an in-process
swarm whose stage s1 is killed mid-request and spliced onto its standby are all counted, the
standby and the dead stage each credited for its part; forged, duplicated, replayed, unpinned
and hostile files are refused and named, never counted; the JSON and CSV shapes, the exit
codes and the one-line errors of the CLI."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import attrs
import pytest

from receipt_fixtures import resign
from shard.cli import main
from shard.messages import ResumeRecord, RunReceipt
from shard.testing.faults import FaultPlan
from shard.trust import ledger as ledger_module
from shard.trust.identity import NodeIdentity
from shard.trust.ledger import LedgerPins, build_ledger, credits, period_of
from shard.trust.receipt_check import receipt_to_json
from splice_receipts import receipts_of, spliced_receipts
from test_failover import model_dir as model_dir


@attrs.frozen
class Run:
    receipts: list[RunReceipt]
    coordinator: NodeIdentity
    pub: str  # the coordinator's public key, hex (for --coordinator)


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    key = tmp_path_factory.mktemp("coord") / "coord.key"
    coordinator = NodeIdentity.generate()
    coordinator.save(key)
    plan = FaultPlan.random(1030, kind="kill", node="s1", frames=(14, 40))
    results, injector = spliced_receipts(model_dir, plan, coordinator_key=key)
    assert injector.fired, f"{plan}: the fault never fired"
    return Run(receipts_of(results), coordinator, coordinator.public.hex())


def _folder(tmp_path: Path, receipts: list[RunReceipt]) -> Path:
    folder = tmp_path / "receipts"
    folder.mkdir()
    for i, r in enumerate(receipts):
        (folder / f"run{i}.json").write_text(receipt_to_json(r))
    return folder


def _files(folder: Path) -> list[tuple[str, bytes]]:
    return [(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]


def test_spliced_receipts_all_count_and_the_standby_is_credited(run: Run, tmp_path: Path) -> None:
    """Every receipt of the spliced run counts; per request the dead s1 and its standby split
    the block: chunks as s2 received them, output tokens at the splice."""
    pins = LedgerPins(coordinators=frozenset({run.coordinator.public}))
    book = build_ledger(_files(_folder(tmp_path, run.receipts)), pins, "all")
    assert book.refused == ()
    assert book.totals.receipts == 3
    assert book.totals.tokens == sum(len(r.output_ids) for r in run.receipts)
    rows = {r.node: r for r in book.rows}
    assert set(rows) == {"s0", "s1", "s1-standby", "s2"}
    assert rows["s1"].keys == () and len(rows["s1-standby"].keys) == 1
    assert rows["s1-standby"].chunks > 0 and rows["s1"].chunks > 0
    for receipt in run.receipts:
        by = {c.node: c for c in credits(receipt)}
        s2 = receipt.stages[2]
        assert by["s1"].chunks + by["s1-standby"].chunks == s2.chunks_in
        out = len(receipt.output_ids)
        assert by["s1"].decode_tokens + by["s1-standby"].decode_tokens == out
        assert by["s1"].decode_tokens == receipt.splices[0].at_token
        assert by["s0"].decode_tokens == out
    # layer-tokens: tokens x the two layers every block here holds
    assert all(r.layer_tokens == 2 * r.tokens for r in book.rows)
    assert book.totals.layer_tokens == sum(r.layer_tokens for r in book.rows)
    assert rows["s1"].tokens + rows["s1-standby"].tokens == rows["s0"].tokens


def test_forged_duplicated_replayed_unpinned_and_hostile_files_are_refused(
    run: Run, tmp_path: Path
) -> None:
    """Each bad file is refused with its name and a one-line reason, and counts for nothing:
    the totals are those of the three honest receipts (which sort, and so count, first)."""
    folder = _folder(tmp_path, run.receipts)
    honest = build_ledger(_files(folder), LedgerPins(coordinators={run.coordinator.public}), "all")
    first = run.receipts[0]
    text = receipt_to_json(first)
    token = str(first.output_ids[0])
    (folder / "x-forged.json").write_text(text.replace(f"\n    {token},", "\n    99,", 1))
    (folder / "x-copy.json").write_text(text)
    replay = resign(first, run.coordinator, signed_at=first.signed_at + 3600)
    (folder / "x-replayed.json").write_text(receipt_to_json(replay))
    other = NodeIdentity.generate()
    (folder / "x-unpinned.json").write_text(receipt_to_json(resign(first, other)))
    (folder / "x-nested.json").write_text("[" * 100_000)
    (folder / "x-types.json").write_text(json.dumps({"job": 5, "stages": "no"}))
    (folder / "x-binary.json").write_bytes(b"\xff\xfe\x00")
    book = build_ledger(_files(folder), LedgerPins(coordinators={run.coordinator.public}), "all")
    reasons = {r.file: r.reason for r in book.refused}
    assert set(reasons) == {
        "x-forged.json",
        "x-copy.json",
        "x-replayed.json",
        "x-unpinned.json",
        "x-nested.json",
        "x-types.json",
        "x-binary.json",
    }
    assert "bad signature" in reasons["x-forged.json"]
    assert reasons["x-copy.json"].startswith("duplicate: the same bytes as run0.json")
    assert reasons["x-replayed.json"].startswith(f"replayed: job {first.job}")
    assert "not a pinned coordinator" in reasons["x-unpinned.json"]
    assert "nested" in reasons["x-nested.json"]
    assert all("\n" not in why and len(why) < 400 for why in reasons.values())
    assert book.totals == attrs.evolve(honest.totals, refused=7)
    assert book.rows == honest.rows


def test_a_run_resuming_a_counted_request_is_refused(run: Run, tmp_path: Path) -> None:
    """A run that says it resumes a request already counted (``resumes``: that request's
    first job) is the same request: refused, so its tokens count once."""
    first, second = run.receipts[0], run.receipts[1]
    resumed = resign(second, run.coordinator, resumes=ResumeRecord("r1", first.job, 3))
    files = [
        ("a.json", receipt_to_json(first).encode()),
        ("b.json", receipt_to_json(resumed).encode()),
    ]
    book = build_ledger(files, LedgerPins(coordinators={run.coordinator.public}), "all")
    assert book.totals.receipts == 1 and book.totals.tokens == len(first.output_ids)
    (refused,) = book.refused
    assert refused.file == "b.json"
    assert refused.reason.startswith(f"replayed: request {first.job}")
    alone = build_ledger(files[1:], LedgerPins(coordinators={run.coordinator.public}), "all")
    assert alone.refused == () and alone.totals.tokens == len(second.output_ids)


def test_a_huge_file_is_refused_unparsed(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file past the size bound is refused by its size, before any parse."""
    monkeypatch.setattr(ledger_module, "MAX_RECEIPT_BYTES", 1 << 16)
    files = [("huge.json", b"[" * ((1 << 16) + 1))]
    book = build_ledger(files, LedgerPins(coordinators={run.coordinator.public}), "all")
    assert [(r.file, r.reason) for r in book.refused] == [
        ("huge.json", f"more than {1 << 16} bytes: larger than any receipt")
    ]


def test_without_a_pin_nothing_counts(run: Run) -> None:
    """The core refuses every receipt when nothing pins its signers."""
    files = [("a.json", receipt_to_json(run.receipts[0]).encode())]
    book = build_ledger(files, LedgerPins(), "all")
    assert book.totals.receipts == 0 and "no pin" in book.refused[0].reason


def test_periods_are_utc_hours_and_days() -> None:
    """Rows group by the UTC hour or day of the coordinator's signature."""
    t = 1_764_900_000  # 2025-12-05 02:00:00 UTC
    assert period_of(t, "hour") == "2025-12-05T02Z"
    assert period_of(t, "day") == "2025-12-05"
    assert period_of(t, "all") == "all"


def test_cli_json_csv_and_exit_codes(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json: period, rows, totals, refused; --csv: a header and one row per node; exit 0
    when all counted, 1 with a refused file (listed); --help explains."""
    folder = _folder(tmp_path, run.receipts)
    pin = ["--coordinator", run.pub]
    assert main(["ledger", str(folder), "--json", *pin]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"period", "rows", "totals", "refused"}
    assert data["refused"] == [] and data["totals"]["receipts"] == 3
    assert {row["node"] for row in data["rows"]} == {"s0", "s1", "s1-standby", "s2"}
    assert set(data["rows"][0]) == {
        "period", "node", "keys", "requests", "chunks", "prefill_tokens", "decode_tokens",
        "tokens", "layer_tokens", "compute_s",
    }  # fmt: skip
    assert main(["ledger", str(folder), "--csv", "--period", "day", *pin]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 4 and rows[0]["period"] != "all"
    assert set(rows[0]) >= {"node", "tokens", "layer_tokens", "keys"}
    (folder / "z-copy.json").write_bytes((folder / "run0.json").read_bytes())
    assert main(["ledger", str(folder), *pin]) == 1
    out, err = capsys.readouterr()
    assert "refused: z-copy.json: duplicate" in out
    assert err.strip() == "shard ledger: 1 of 4 files refused"
    with pytest.raises(SystemExit) as help_exit:
        main(["ledger", "--help"])
    assert help_exit.value.code == 0
    assert "layer-tokens" in capsys.readouterr().out


def test_cli_errors_are_one_line(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing folder, a file that cannot be read and a missing pin each give one line."""
    pin = ["--coordinator", run.pub]
    assert main(["ledger", str(tmp_path / "nowhere"), *pin]) == 1
    assert capsys.readouterr().err == f"shard: error: {tmp_path / 'nowhere'}: no such folder\n"
    folder = _folder(tmp_path, run.receipts[:1])
    (folder / "gone.json").symlink_to(tmp_path / "missing-target")
    assert main(["ledger", str(folder), *pin]) == 1
    out = capsys.readouterr().out
    assert "refused: gone.json: cannot read the file: No such file or directory" in out
    assert main(["ledger", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shard ledger: error: give --authority PUB") and "\n" not in err
