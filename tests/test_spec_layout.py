"""``shard.spec.layout`` and ``swarm up``'s use of it: the layout `swarm up|run` run is the
plan `shard plan SPEC` prints, a spec whose file order is bad under its `[links]` gets the
planner's order, ties and explicit blocks keep the spec as written, standbys swap in only
where nothing pins the nodes, and ``--layout`` round-trips. No model is loaded: the model is
a directory holding only ``config.json``; no process is started (the multi-process run is
in ``test_spec_layout_procs``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from shard.cli import main
from shard.cli.plan import model_facts
from shard.cli.swarm import planned
from shard.placement import plan
from shard.spec.layout import Layout, apply_layout, decide, problem_of
from shard.spec.swarm import SpecError, SwarmSpec, load_spec
from test_plan_cli import CONFIG

SPECS = Path(__file__).resolve().parents[1] / "specs"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A 6-layer model as the planner sees it: its config.json alone."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    return model


def write(tmp_path: Path, model_dir: Path, body: str, name: str = "swarm.toml") -> Path:
    """A spec: swarm ``t`` on ``model_dir``, coordinator ``coord``, then ``body``."""
    path = tmp_path / name
    path.write_text(
        f'[swarm]\nname = "t"\nmodel = "{model_dir}"\ninsecure = true\n'
        f'[coordinator]\nlisten = "127.0.0.1:7900"\n{body}'
    )
    return path


def stages(*names: str, layers: str = '"auto"', port: int = 7901) -> str:
    return "".join(
        f'[[stage]]\nname = "{n}"\nlisten = "127.0.0.1:{port + i}"\nlayers = {layers}\n'
        for i, n in enumerate(names)
    )


#: File order coord -> s0 -> s1 -> s2 -> coord pays 20 ms on its first two hops; every pair
#: the spec does not name has the 1 ms default, so other orders avoid both.
BAD_ORDER = (
    stages("s0", "s1", "s2")
    + "[links]\nlatency_ms = 1.0\n"
    + '[[links.edge]]\nfrom = "coord"\nto = "s0"\nlatency_ms = 20.0\n'
    + '[[links.edge]]\nfrom = "s0"\nto = "s1"\nlatency_ms = 20.0\n'
)


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"rtt": None, "as_written": False, **kw})


def blocks_of(spec: SwarmSpec) -> list[tuple[str, tuple[int, int]]]:
    found = spec.blocks(CONFIG["num_hidden_layers"])
    return [(s.name, b) for s, b in zip(spec.stages, found, strict=True)]


def test_swarm_up_runs_what_shard_plan_prints(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`swarm up`'s layout function prints `shard plan SPEC`'s text (with --verbose; else
    only its last line, the plan changing the ring) and runs its ring and blocks: the same
    planner, the same problem."""
    path = write(tmp_path, model_dir, BAD_ORDER)
    assert main(["plan", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert main(["plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert planned(load_spec(path), model_dir, args())[1] is not None
    assert capsys.readouterr().err == text.splitlines(keepends=True)[-1]
    spec, layout = planned(load_spec(path), model_dir, args(verbose=True))
    assert capsys.readouterr().err == text
    assert layout is not None and str(layout) == shown["swarm_up"]["layout"]
    assert spec.ring() == tuple(shown["ring"])
    assert blocks_of(spec) == [(s["node"], (s["first"], s["last"])) for s in shown["stages"]]


def test_a_bad_file_order_gets_the_planners_order(tmp_path: Path, model_dir: Path) -> None:
    """Both 20 ms hops are left out of the ring swarm up runs, its blocks still tile the
    model, and the launcher keeps only the link overrides that are still hops."""
    written = load_spec(write(tmp_path, model_dir, BAD_ORDER))
    spec, layout = planned(written, model_dir, args())
    assert layout is not None
    hops = list(zip(spec.ring(), spec.ring()[1:], strict=False))
    assert ("coord", "s0") not in hops and ("s0", "s1") not in hops
    assert sorted(s.name for s in spec.stages) == ["s0", "s1", "s2"]
    assert [b for _, b in blocks_of(spec)] == [(0, 2), (2, 4), (4, 6)]
    assert spec.edges == ()
    assert sum(e.latency_ms for e in spec.hops()) == 4.0  # four hops at the 1 ms default
    assert sum(e.latency_ms for e in written.hops()) == 42.0


def test_explicit_blocks_are_never_changed(tmp_path: Path, model_dir: Path) -> None:
    """The same bad order with explicit blocks runs exactly as written."""
    body = BAD_ORDER.replace('"auto"', "[0, 2]", 1)
    body = body.replace('"auto"', "[2, 4]", 1).replace('"auto"', "[4, 6]", 1)
    written = load_spec(write(tmp_path, model_dir, body))
    spec, layout = planned(written, model_dir, args())
    assert layout is None and spec == written
    problem, _ = problem_of(written, model_facts(str(model_dir), written))
    decision = decide(written, problem, plan(problem))
    assert decision.layout is None and "explicit blocks" in decision.why


def test_as_written_opts_out(tmp_path: Path, model_dir: Path) -> None:
    """--as-written runs the bad order as written and plans nothing."""
    written = load_spec(write(tmp_path, model_dir, BAD_ORDER))
    assert planned(written, model_dir, args(as_written=True)) == (written, None)


def test_uniform_links_tie_and_keep_the_file_order(tmp_path: Path, model_dir: Path) -> None:
    """Every order of a uniform-latency ring has the same lap: the spec runs as written,
    though a ring of fewer stages would be shorter (its stage count is kept)."""
    written = load_spec(
        write(tmp_path, model_dir, stages("s0", "s1", "s2") + "[links]\nlatency_ms = 25.0\n")
    )
    spec, layout = planned(written, model_dir, args())
    assert layout is None and spec == written


@pytest.mark.parametrize(
    "name", ["local.toml", "local-secure.toml", "wan-sim.toml", "failover.toml"]
)
def test_the_checked_in_specs_run_as_they_always_did(name: str) -> None:
    """Every checked-in spec with a written ring runs as written: file order, "auto" blocks."""
    from shard.convert.bundled import ModelNotFound, resolve_model

    spec = load_spec(SPECS / name)
    try:
        model_dir = resolve_model(spec.model, progress=False)
    except ModelNotFound as exc:
        pytest.skip(f"bundled model not installed: {exc}")
    assert planned(spec, model_dir, args()) == (spec, None)


def geography(tmp_path: Path, far: set[str], names: list[str]) -> Path:
    """An RTT-only geography (no node profiles): nodes in ``far`` are 100 ms from all."""
    ms = [[0 if a == b else (100 if {a, b} & far else 2) for b in names] for a in names]
    path = tmp_path / "geo.json"
    path.write_text(json.dumps({"rtt": {"nodes": names, "ms": ms}}))
    return path


SWAP = (
    stages("s0", "s1")
    + '[[standby]]\nname = "sb"\nlisten = "127.0.0.1:7911"\n'
    + '[[standby]]\nname = "hot"\nlisten = "127.0.0.1:7912"\nlayers_of = "s0"\n'
)


def test_a_standby_swaps_in_for_a_far_stage(tmp_path: Path, model_dir: Path) -> None:
    """With --rtt, a far stage stands by and a near standby holds layers; the hot standby of
    the far stage becomes a spare; the launcher's hops get the geography's latencies."""
    written = load_spec(write(tmp_path, model_dir, SWAP))
    rtt = geography(tmp_path, {"s0", "hot"}, ["coord", "s0", "s1", "sb", "hot"])
    spec, layout = planned(written, model_dir, args(rtt=str(rtt)))
    assert layout is not None and set(layout.names()) == {"s1", "sb"}
    assert [s.name for s in spec.standbys] == ["s0", "hot"]
    assert all(s.layers_of is None for s in spec.standbys)
    assert [e.latency_ms for e in spec.hops()] == [1.0, 1.0, 1.0]  # half the 2 ms round trip


def test_a_node_an_auditor_names_is_not_moved(tmp_path: Path, model_dir: Path) -> None:
    """The same swap is not made when an auditor audits the far stage: the spec runs as
    written and the decision says why; --layout refuses the move too."""
    body = SWAP + '[[standby]]\nname = "aud"\nlisten = "127.0.0.1:7913"\nrole = "auditor"\n'
    written = load_spec(write(tmp_path, model_dir, body + 'layers_of = "s0"\n'))
    rtt = geography(tmp_path, {"s0", "hot"}, ["coord", "s0", "s1", "sb", "hot", "aud"])
    spec, layout = planned(written, model_dir, args(rtt=str(rtt)))
    assert layout is None and spec.stages == written.stages
    with pytest.raises(SpecError, match="auditor aud audits it"):
        apply_layout(written, Layout.parse("s1=0:3,sb=3:6"))


def test_layout_text_round_trips_and_bad_layouts_are_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    """`--layout` text parses back to the same layout; an unknown node, a gap, a malformed
    entry are one clear error each."""
    layout = Layout.parse("s2=0:1,s0=1:4,s1=4:6")
    assert str(layout) == "s2=0:1,s0=1:4,s1=4:6"
    written = load_spec(write(tmp_path, model_dir, BAD_ORDER))
    spec = apply_layout(written, layout)
    assert spec.ring() == ("coord", "s2", "s0", "s1", "coord")
    assert blocks_of(spec) == list(layout.stages)
    with pytest.raises(ValueError, match="NAME=FIRST:LAST"):
        Layout.parse("s0=0-3")
    with pytest.raises(SpecError, match="not a stage or standby"):
        apply_layout(written, Layout.parse("s9=0:6"))
    with pytest.raises(SpecError, match="starts at layer 1"):
        apply_layout(written, Layout.parse("s0=1:6"))


def test_a_spec_past_the_exact_search_is_chained_and_runs_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Thirteen "auto" stages are more than the exact search takes with the stage count
    kept: the planner chains them (``heuristic.chain``); on uniform links that ties the ring
    as written, which runs, as any such spec does. (Before the chain there was no plan at
    all, and the line said so.)"""
    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 14}))
    names = [f"s{i}" for i in range(13)]
    written = load_spec(write(tmp_path, model, stages(*names) + "[links]\nlatency_ms = 5.0\n"))
    assert planned(written, model, args()) == (written, None)
    assert "no plan" not in capsys.readouterr().err


def test_shard_up_with_a_bad_layout_is_one_line(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard up --layout` that is malformed, or names no such node, fails in one error line
    before anything starts."""
    path = str(write(tmp_path, model_dir, BAD_ORDER))
    for layout, says in (("s0:0:6", "NAME=FIRST:LAST"), ("s9=0:6", "not a stage or standby")):
        argv = ["up", "--role", "stage", "--spec", path, "--node", "s0", "--layout", layout]
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shard: error: ") and says in err[0], err
