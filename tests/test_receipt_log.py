"""The coordinator's receipt log (``[ledger] receipts``, ``shard.coordinator.receipt_log``):
with it, every request is signed whether or not its client asked, its run receipt is kept as a
file, and ``shard ledger`` over the folder counts exactly what the clients received — here on a
ring whose s1 is killed mid-request and spliced onto its standby, which the log credits. A log
that cannot be written fails no request."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import pytest
import trio

from shard.cli import main
from shard.coordinator.coordinator import Completion
from shard.coordinator.receipt_log import ReceiptLog
from shard.coordinator.receipts import kept
from shard.messages import RunStats
from shard.testing.faults import FaultPlan
from shard.trust.identity import NodeIdentity
from shard.trust.receipt_check import receipt_from_json
from splice_receipts import spliced_receipts
from test_failover import model_dir as model_dir


@attrs.frozen
class Logged:
    results: list[Completion]
    folder: Path
    pub: str


@pytest.fixture(scope="module")
def logged(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Logged:
    base = tmp_path_factory.mktemp("log")
    coordinator = NodeIdentity.generate()
    coordinator.save(base / "coord.key")
    folder = base / "receipts"  # made by the first write
    plan = FaultPlan.random(1030, kind="kill", node="s1", frames=(14, 40))
    results, injector = spliced_receipts(
        model_dir, plan, coordinator_key=base / "coord.key", receipt_log=folder, asked=False
    )
    assert injector.fired, f"{plan}: the fault never fired"
    done = [r for r in results if isinstance(r, Completion)]
    assert len(done) == len(results), results
    return Logged(done, folder, coordinator.public.hex())


def test_every_request_is_kept_and_the_ledger_counts_what_clients_received(
    logged: Logged, capsys: pytest.CaptureFixture[str]
) -> None:
    """No client asked for a receipt and none got one, yet each request's signed receipt is
    in the log: one file per request, whose output is the client's; `shard ledger` over the
    folder counts them all, its token total equal to the clients', the standby credited."""
    assert all(r.receipt is None for r in logged.results)
    files = sorted(logged.folder.iterdir())
    assert [p.suffixes for p in files] == [[".receipt", ".json"]] * len(logged.results)
    outputs = sorted(receipt_from_json(p.read_text()).output_ids for p in files)
    assert outputs == sorted(tuple(r.token_ids) for r in logged.results)
    assert main(["ledger", str(logged.folder), "--coordinator", logged.pub, "--json"]) == 0
    book = json.loads(capsys.readouterr().out)
    assert book["refused"] == []
    assert book["totals"]["receipts"] == len(logged.results)
    assert book["totals"]["tokens"] == sum(len(r.token_ids) for r in logged.results)
    assert "s1-standby" in {row["node"] for row in book["rows"]}


def test_a_log_that_cannot_be_written_fails_no_request(
    logged: Logged, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The folder is a file: the write fails, is logged at error naming the receipt's job,
    and the request's completion comes back whole (without the receipt it did not ask for;
    with it when it did)."""
    receipt = receipt_from_json(next(logged.folder.iterdir()).read_text())
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    done = Completion(receipt.output_ids, "length", RunStats(0, 0.0, 0.0, 0.0, 0, 0.0), receipt)
    log = ReceiptLog(blocked)
    caplog.set_level(logging.ERROR, logger="shard.coordinator.receipt_log")

    async def both() -> tuple[Completion, Completion]:
        return await kept(done, log, wanted=False), await kept(done, log, wanted=True)

    unasked, asked = trio.run(both)
    assert unasked == attrs.evolve(done, receipt=None) and asked == done
    assert log.written == 0
    assert [r.levelname for r in caplog.records] == ["ERROR", "ERROR"]
    assert receipt.job in caplog.records[0].getMessage()
