"""Evidence leaves the coordinator (issue 29, item 3): in an auditing swarm with a cheating
stage, each strike's signed evidence is written to a file in ``[audit] evidence_dir``, its
path is logged once and reaches the status feed (an event and ``AuditCounts.evidence``), and
``shard receipt verify --evidence FILE`` accepts the file offline and refuses a tampered copy.
The feed then drops the evicted node from the ring line, and so does the monitor.

One in-process swarm (virtual time, compute inline, like ``tests/test_audit_swarm.py``): s1
adds noise of 1e-4 to what it sends, every chunk is audited bit-exactly (batching off), two
strikes evict it and its standby takes its slot. A monitor is dialled on the coordinator's
address as a real one would.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from textual.widgets import DataTable, Static

from shard.audit.evidence import evidence_from_json, verify_evidence
from shard.audit.evidence_files import EvidenceShelf, write_evidence
from shard.cli import main
from shard.compute.offload import inline_compute
from shard.messages import Hello, NodeName, StatusSnapshot
from shard.model.llama import StageModel
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.observe.tui.app import MonitorApp
from shard.spec.audit import AuditSpec
from shard.testing import cheating
from shard.transport import MemoryNetwork
from shard.transport.links import dial_peer
from test_failover import MAX_TOKENS, PROMPTS, failover_spec
from test_failover import model_dir as model_dir

SEED = 18


@attrs.frozen
class Evicted:
    """What one run of the swarm left: the evidence directory, the scheduler's log lines,
    the events the coordinator published, and the first snapshot after the eviction."""

    directory: Path
    logged: tuple[str, ...]
    snapshot: StatusSnapshot


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def evicted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Evicted:
    """Run every prompt through the swarm with s1 cheating; then read the monitor feed until
    a snapshot shows the eviction and its evidence."""
    directory = tmp_path_factory.mktemp("run") / "evidence"
    policy = AuditSpec(enabled=True, rate=1.0, strikes=2, evidence_dir=str(directory))
    spec = attrs.evolve(failover_spec(model_dir), audit=policy)
    spec = attrs.evolve(spec, limits=attrs.evolve(spec.limits, max_batch_rows=1))
    network = MemoryNetwork(encode_frames=True)
    hello = Hello(node=NodeName("monitor"), role="monitor", swarm=spec.name)
    seen: list[StatusSnapshot] = []

    def wrap_block(name: str, model: StageModel) -> StageModel:
        return cheating(model, "noise", noise=1e-4, seed=SEED) if name == "s1" else model

    async def run() -> None:
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                handle: CoordinatorHandle = await nursery.start(
                    partial(
                        run_swarm, spec, model_dir=model_dir, network=network,
                        wrap_block=wrap_block,
                    )
                )  # fmt: skip
                conn = await dial_peer(network, handle.address, hello, timeout_s=5)
                async with trio.open_nursery() as requests:
                    for prompt in PROMPTS:
                        requests.start_soon(
                            partial(handle.coordinator.generate, prompt, max_tokens=MAX_TOKENS)
                        )
                while not seen or not seen[-1].audit.evicted or "s1" in seen[-1].ring:
                    snap = await conn.receive()
                    assert isinstance(snap, StatusSnapshot)
                    seen.append(snap)
                await conn.aclose()
                nursery.cancel_scope.cancel()

    lines = _Lines()
    logger = logging.getLogger("shard.failover.scheduler")
    logger.addHandler(lines)
    try:
        trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        logger.removeHandler(lines)
    return Evicted(directory, tuple(lines.lines), seen[-1])


def test_each_strike_writes_a_file_whose_path_is_logged_once_and_on_the_feed(
    evicted: Evicted,
) -> None:
    """One file per strike (s1's, nobody else's), whole (no temporary left), its path in
    exactly one scheduler log line, in a published event, and in ``AuditCounts.evidence``."""
    files = sorted(evicted.directory.iterdir())
    snap = evicted.snapshot
    print(f"files {[f.name for f in files]}; audit {snap.audit}")
    assert files and all(f.name.startswith("s1-session") for f in files)
    assert all(f.suffix == ".json" and not f.name.startswith(".") for f in files)
    assert len(files) >= snap.audit.strikes >= 2
    for f in files:
        assert sum(str(f) in line for line in evicted.logged) == 1
    events = [e.detail for e in snap.events if e.kind == "audit"]
    assert {str(f) for f in files} <= {d.split("; evidence in ")[-1] for d in events}
    assert snap.audit.evidence and set(snap.audit.evidence) <= {str(f) for f in files}
    assert snap.audit.evicted == ("s1",)


def test_an_evidence_file_verifies_offline_and_a_tampered_copy_does_not(
    evicted: Evicted, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard receipt verify --evidence FILE` accepts every written file (exit 0, s1 named)
    and refuses a copy with one claimed byte changed (exit 1, INVALID)."""
    files = sorted(evicted.directory.iterdir())
    for f in files:
        assert main(["receipt", "verify", "--evidence", str(f)]) == 0
        assert "evidence OK: s1 [" in capsys.readouterr().out
        assert verify_evidence(evidence_from_json(f.read_text())).evidence.accused == "s1"
    text = files[0].read_text()
    data_at = text.index('"claimed": {\n    "b64": "') + len('"claimed": {\n    "b64": "')
    flipped = "B" if text[data_at] != "B" else "C"
    tampered = tmp_path / "tampered.json"
    tampered.write_text(text[:data_at] + flipped + text[data_at + 1 :])
    assert main(["receipt", "verify", "--evidence", str(tampered)]) == 1
    assert "evidence INVALID" in capsys.readouterr().err


def test_a_write_that_fails_costs_the_file_not_the_coordinator(
    evicted: Evicted, tmp_path: Path
) -> None:
    """A directory that cannot be made (a file is in the way): ``keep`` notes why and returns;
    the same evidence written again is the same file, atomically replaced."""
    evidence = evidence_from_json(next(evicted.directory.iterdir()).read_text())
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    shelf = EvidenceShelf(blocked / "evidence")
    note = trio.run(shelf.keep, evidence)
    assert note.startswith("; evidence NOT written (") and shelf.recent == ()
    first = write_evidence(tmp_path / "ok", evidence)
    assert write_evidence(tmp_path / "ok", evidence) == first
    assert [p.name for p in (tmp_path / "ok").iterdir()] == [first.name]


def test_the_feed_and_the_monitor_drop_the_evicted_node_from_the_ring(evicted: Evicted) -> None:
    """After the splice the feed's ring, edges and stages hold s1's standby and not s1; the
    monitor fed that snapshot draws no s1 on the ring line or in the stage table, and says
    which node was evicted and where its newest evidence is."""
    snap = evicted.snapshot
    assert "s1-standby" in snap.ring
    assert all("s1" not in (e.src, e.dst) for e in snap.edges)
    assert "s1" not in [s.node for s in snap.stages]
    app = MonitorApp(address="memory", clock=lambda: snap.at, tz=UTC)
    shown: dict[str, str | list[str]] = {}

    async def scenario() -> None:
        async with app.run_test(size=(120, 32)) as pilot:
            app.show(snap)
            await pilot.pause()
            shown["ring"] = str(app.query_one("#ring", Static).content)
            shown["summary"] = str(app.query_one("#summary", Static).content)
            table = app.query_one("#stages", DataTable)
            shown["stages"] = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]

    asyncio.run(scenario())
    ring = str(shown["ring"]).split()
    assert "s1-standby" in ring and "s1" not in ring
    assert "s1" not in shown["stages"] and "s1-standby" in shown["stages"]
    assert "evictions 1 (s1)" in shown["summary"]
    assert f"evidence {snap.audit.evidence[-1]}" in shown["summary"]


def test_evidence_dir_resolves_against_the_spec_and_defaults_to_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[audit] evidence_dir``: a relative path resolves against the spec's directory, an
    absent one leaves the default (``$XDG_CACHE_HOME/shard/evidence``) to the shelf."""
    from shard.spec.audit import AUDIT_KEYS, read_audit
    from shard.spec.validate import Table

    def read(values: dict[str, object]) -> AuditSpec:
        return read_audit(Table.open("t.toml", "audit", values, AUDIT_KEYS), tmp_path)

    assert read({"evidence_dir": "ev"}).evidence_dir == str(tmp_path / "ev")
    assert read({"evidence_dir": "/srv/ev"}).evidence_dir == "/srv/ev"
    assert read({}).evidence_dir is None
    monkeypatch.undo()  # conftest points the default into tmp_path for every other test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert EvidenceShelf(None).directory == tmp_path / "cache" / "shard" / "evidence"
