"""The benchmark driver's pure parts: the analytical bound, derived ring specs, prompt files,
the summary. (Benchmarks themselves are not tests: nothing here runs a ring or times one.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from shard.cli.benchmark.bound import Measured, bound, expected_tokens
from shard.cli.benchmark.options import OptionsError, load_prompts
from shard.cli.benchmark.report import summarize
from shard.cli.benchmark.ringspec import policy, ring_toml
from shard.spec.swarm import load_spec

REPO = Path(__file__).resolve().parent.parent


def measured(**kw: object) -> Measured:
    base: dict[str, object] = {
        "tokens": 40,
        "chunks": 40,
        "drafted": 0,
        "accepted": 0,
        "stage_chunk_s": (0.01, 0.01, 0.02),
        "latency_s": 0.1,
        "wire_s": 0.01,
        "draft_token_s": 0.0,
        "depth": 1,
    }
    base.update(kw)
    return Measured(**base)  # type: ignore[arg-type]


def test_plain_bound_is_one_token_per_unloaded_lap() -> None:
    """Plain: lap0 = latency + compute + wire, one token per lap."""
    b = bound(measured())
    assert b is not None
    assert b.lap0_s == pytest.approx(0.15)
    assert b.steady_tok_s == pytest.approx(1 / 0.15)
    assert b.request_tok_s == pytest.approx(b.steady_tok_s)
    assert b.alpha is None and b.k == 0


def test_speculative_bound_uses_measured_tokens_per_chunk_and_draft_cost() -> None:
    """D = 1: E / (lap0 + K · t_d); E(α, K) is reported beside the measured E."""
    b = bound(measured(tokens=40, chunks=10, drafted=40, accepted=30, draft_token_s=0.005))
    assert b is not None
    assert b.e == 4 and b.k == 4 and b.alpha == 0.75
    assert b.lap0_s == pytest.approx(0.15 + 4 * 0.005)
    assert b.steady_tok_s == pytest.approx(4 / 0.17)
    assert b.e_alpha == pytest.approx(expected_tokens(0.75, 4))


def test_pipelined_bound_takes_the_tightest_limit() -> None:
    """D > 1: min(D·E/lap0, E/slowest stage, E/(K·t_d)); the stage binds here."""
    slow_tail = (0.01, 0.01, 0.1)
    b = bound(
        measured(tokens=90, chunks=10, drafted=80, accepted=80, depth=4, stage_chunk_s=slow_tail)
    )
    assert b is not None
    assert b.latency_rate == pytest.approx(4 * 9 / 0.23)
    assert b.stage_rate == pytest.approx(9 / 0.1)
    assert b.limited_by == "stage" and b.steady_tok_s == b.stage_rate


def test_pipelined_stages_sharing_cores_are_bounded_by_the_cores() -> None:
    """With P cores for the stages, a chunk takes at least C / P of machine time."""
    even = (0.05, 0.05, 0.05)
    b = bound(
        measured(
            tokens=90, chunks=10, drafted=80, accepted=80, depth=4, stage_chunk_s=even, cores=2
        )
    )
    assert b is not None
    assert b.stage_rate == pytest.approx(9 / 0.075)
    assert b.limited_by == "stage"


def test_pipelined_lap_uses_compute_alone_and_the_stage_its_service_time() -> None:
    """lap0 from the chunks computed alone; the bottleneck from the run's own service time."""
    b = bound(
        measured(
            tokens=90, chunks=10, drafted=80, accepted=80, depth=4,
            stage_chunk_s=(0.04, 0.04, 0.08), alone_chunk_s=(0.02, 0.02, 0.04),
        )
    )  # fmt: skip
    assert b is not None
    assert b.lap0_s == pytest.approx(0.1 + 0.08 + 0.01)
    assert b.stage_rate == pytest.approx(9 / 0.08)
    assert b.contention == pytest.approx(2.0)


def test_request_bound_counts_fill_and_drain() -> None:
    """A request of n chunks needs ⌈n/D⌉ laps at least: short requests cannot reach steady."""
    b = bound(measured(tokens=45, chunks=5, drafted=40, accepted=40, depth=4))
    assert b is not None
    assert b.request_s == pytest.approx(2 * 0.15)  # two waves of lap0
    assert b.request_tok_s < b.steady_tok_s


def test_no_bound_without_decode_chunks() -> None:
    """A run that stopped at its first token has nothing to bound."""
    assert bound(measured(tokens=0, chunks=0)) is None


def test_expected_tokens_at_alpha_one_is_k_plus_one() -> None:
    """(1 − α^(K+1)) / (1 − α) → K + 1 as α → 1."""
    assert expected_tokens(1.0, 8) == 9
    assert expected_tokens(0.999999, 8) == pytest.approx(9, rel=1e-4)
    assert expected_tokens(0.0, 8) == 1


def test_ring_spec_round_trips_through_the_spec_loader(tmp_path: Path) -> None:
    """A derived ring keeps stages and limits, gets the latency, ports and draft asked for."""
    base = load_spec(REPO / "specs/local.toml")
    text = ring_toml(
        base,
        name="bench-x",
        ports=[41000, 41001, 41002, 41003],
        latency_ms=25,
        speculation={"draft": "ngram", **policy(base)},
    )
    path = tmp_path / "ring.toml"
    path.write_text(text)
    spec = load_spec(path)
    assert [s.name for s in spec.stages] == [s.name for s in base.stages]
    assert spec.limits == base.limits
    assert {e.latency_ms for e in spec.hops()} == {25.0}
    assert spec.coordinator.listen.port == 41000
    assert spec.speculation.draft == "ngram" and spec.speculation.policy.k is None


def test_prompt_file_filters_by_set_and_caps_per_set(tmp_path: Path) -> None:
    """--sets and --per-set select prompts in file order."""
    path = tmp_path / "p.toml"
    rows = [("a", "x1"), ("a", "x2"), ("b", "y1")]
    path.write_text(
        "".join(f'[[prompt]]\nset = "{s}"\nname = "{n}"\ntext = "t"\n' for s, n in rows)
    )
    assert [p.name for p in load_prompts(path, per_set=1)] == ["x1", "y1"]
    assert [p.name for p in load_prompts(path, sets="b")] == ["y1"]
    with pytest.raises(OptionsError, match="no set"):
        load_prompts(path, sets="c")


def test_shipped_prompt_file_has_the_four_sets() -> None:
    """copy, code, prose and chat, as the benchmark's issue asks."""
    sets = {p.set for p in load_prompts(REPO / "bench/prompts/spec_ring.toml")}
    assert sets == {"copy", "code", "prose", "chat"}


def test_summary_divides_by_plain_at_the_same_set_and_latency() -> None:
    """Ratios compare medians within one set and latency."""

    def run(mode: str, draft: str | None, rate: float, s: str = "copy") -> dict[str, object]:
        return {
            "set": s, "latency_ms": 25.0, "mode": mode, "draft": draft, "decode_tok_s": rate,
            "tok_s": rate, "alpha": None, "tokens_per_chunk": 1.0, "mean_lap_s": 0.1,
            "max_depth": 1, "stale_dropped": 0, "bound": None, "identical": True,
        }  # fmt: skip

    rows = summarize([run("plain", None, 4.0), run("spec", "ngram", 20.0)])
    spec = next(r for r in rows if r["mode"] == "spec" and r["set"] == "copy")
    assert spec["ratio_decode_tok_s"] == 5.0
    assert [r["set"] for r in rows] == ["copy", "copy", "all", "all"]


def test_default_output_is_new_and_committed_results_are_kept() -> None:
    """By default `shard bench` writes a new timestamped JSON (and PNG) under bench/results;
    an existing --json or --plot (committed results) is refused unless --force."""
    import datetime

    from shard.cli.bench import parse

    now = datetime.datetime(2031, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
    opts = parse([], root=REPO, prog="shard bench", now=now)
    assert opts.json_out == REPO / "bench/results/spec_ring-20310203T040506Z.json"
    assert opts.plot_out == REPO / "bench/results/spec_ring-20310203T040506Z.png"
    assert not opts.json_out.exists() and not opts.ignore_eos
    committed = REPO / "bench/results/spec_ring.json"
    assert committed.exists()
    with pytest.raises(OptionsError, match=r"spec_ring.json exists .*--force to replace it"):
        parse(["--json", str(committed)], root=REPO, prog="shard bench", now=now)
    plot = REPO / "bench/results/spec_ring.png"
    with pytest.raises(OptionsError, match=r"spec_ring.png exists"):
        parse(["--plot", str(plot)], root=REPO, prog="shard bench", now=now)
    forced = parse(["--json", str(committed), "--force", "--ignore-eos"], root=REPO, prog="x")
    assert (forced.json_out, forced.plot_out, forced.ignore_eos) == (committed, plot, True)


def test_head_drafts_are_opt_in_and_need_a_built_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default a bench run compares n-gram, best and oracle; asking for the head or the
    hybrid without a built head is one clear line, before any reference is computed."""
    from shard.cli.bench import bench_main, parse

    opts = parse(["--json", str(tmp_path / "o.json")], root=REPO, prog="shard bench")
    assert opts.drafts == ("ngram", "best", "oracle") and opts.head is None
    opts = parse(
        ["--drafts", "head,hybrid", "--head", "x", "--json", str(tmp_path / "o.json")],
        root=REPO,
        prog="shard bench",
    )
    assert opts.drafts == ("head", "hybrid") and opts.head == "x"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    argv = ["--drafts", "ngram,head", "--head", str(tmp_path / "none")]
    code = bench_main([*argv, "--json", str(tmp_path / "o.json")], root=REPO)
    err = capsys.readouterr().err
    assert code == 1 and "--drafts head/hybrid" in err and "not a head directory" in err
