"""SpeculationController and RunLengths: K and D chosen from measured acceptance and timings."""

from __future__ import annotations

import random

import attrs
import pytest

from shard.decode.control import (
    LOOKUP,
    RunLengths,
    SpeculationConfig,
    SpeculationController,
    expected_tokens,
    pipeline_rate,
)


def test_expected_tokens_formula() -> None:
    """(1 - a^(k+1)) / (1 - a), and k + 1 at a = 1."""
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_controller_speculates_deeper_when_drafts_hold() -> None:
    """High α with a long lap picks long chunks and a deep pipeline; low α stays shallow."""
    good = SpeculationController(
        SpeculationConfig(), alpha=0.95, lap_s=0.1, draft_s=0.001, stage_s=0.01
    )
    k, d = good.choose()
    assert k >= 3 and d >= 3
    poor = SpeculationController(
        SpeculationConfig(), alpha=0.05, lap_s=0.1, draft_s=0.001, stage_s=0.01
    )
    k, d = poor.choose()
    assert d == 1 and k <= 2
    fixed = SpeculationController(SpeculationConfig(k=3, depth=2), alpha=0.05)
    assert fixed.choose() == (3, 2)


def test_pipeline_rate_only_pays_with_high_alpha() -> None:
    """The α law: extra chunks in flight add throughput only when α^K is high."""
    kw = {"lap_s": 0.1, "draft_s": 0.0, "stage_s": 0.005}
    assert pipeline_rate(0.9, 4, 4, **kw) > 2 * pipeline_rate(0.9, 4, 1, **kw)
    assert pipeline_rate(0.3, 4, 4, **kw) < 1.05 * pipeline_rate(0.3, 4, 1, **kw)


def _runs_source(
    seed: int, chunks: int, k: int, first: float = 0.6
) -> tuple[RunLengths, SpeculationController]:
    """Feed a controller chunks from a source whose guesses come in runs: the first guess
    after a miss holds ``first`` of the time (60 %), later ones 97 %."""
    rng = random.Random(seed)
    control = SpeculationController(SpeculationConfig(), runs=RunLengths())
    for _ in range(chunks):
        accepted = 0
        for j in range(k):
            p = first if control.run + j == 0 else 0.97
            if rng.random() >= p:
                break
            accepted += 1
        control.observe_chunk(k, accepted, rejected=accepted < k)
    assert control.runs is not None
    return control.runs, control


def test_run_lengths_learn_that_acceptance_comes_in_runs() -> None:
    runs, control = _runs_source(0, 400, 6)
    assert runs.p(0) == pytest.approx(0.6, abs=0.12)
    assert runs.p(6) > 0.9 and runs.p(20) > 0.9
    # Inside a run the expected tokens per chunk far exceed what the overall α predicts.
    assert runs.expected(10, 6) > expected_tokens(control.alpha, 6) + 1.0


def test_controller_pipelines_long_chunks_inside_a_run() -> None:
    """Inside a long run the run model goes long and deep where the i.i.d. model at the same
    overall α stays at one chunk; where misses come in bursts (the first guess after a miss
    holds 20 % of the time), the stale-chunk cost keeps it shallower right after a miss."""
    runs, control = _runs_source(1, 400, 6)
    timing = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.05}
    inside = SpeculationController(SpeculationConfig(), runs=runs, run=12, **timing)
    k_in, d_in = inside.choose()
    assert d_in >= 3 and k_in >= 5, (k_in, d_in)
    slower = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.1}
    iid = SpeculationController(SpeculationConfig(), alpha=control.alpha, **slower)
    inside = SpeculationController(SpeculationConfig(), runs=runs, run=12, **slower)
    assert iid.choose()[1] < inside.choose()[1], (iid.choose(), inside.choose())
    bursts, _ = _runs_source(1, 400, 6, first=0.2)
    slow = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.2}
    inside = SpeculationController(SpeculationConfig(), runs=bursts, run=12, **slow)
    after_miss = SpeculationController(SpeculationConfig(), runs=bursts, run=0, **slow)
    assert after_miss.choose()[1] < inside.choose()[1], (after_miss.choose(), inside.choose())


def test_stale_chunks_cost_stage_time() -> None:
    """Same acceptance, same lap: the slower the stages (the longer a stale chunk holds up
    the re-drafted one), the shallower the pipeline; with free stages it goes to depth_max."""
    depths = [
        SpeculationController(SpeculationConfig(), alpha=0.8, lap_s=0.3, stage_s=stage).choose()[1]
        for stage in (0.0, 0.05, 0.1, 0.2)
    ]
    assert depths[0] == SpeculationConfig().depth_max
    assert depths == sorted(depths, reverse=True) and depths[-1] == 1, depths


def test_carry_keeps_measurements_and_resets_the_run() -> None:
    runs, control = _runs_source(2, 50, 4)
    control.observe_lap(0.4, 0.05)
    nxt = control.carry(SpeculationConfig(k=2))
    assert nxt.shared is runs and nxt.runs is not runs
    assert nxt.lap_s == control.lap_s and nxt.run == 0
    assert nxt.choose()[0] == 2
    assert nxt.carry(SpeculationConfig()).shared is runs  # every request seeds from the same one


def test_a_session_follows_its_own_text_and_the_shared_model_keeps_the_history() -> None:
    """After long copy-like evidence, a request whose drafts almost never hold stops
    pipelining within a few chunks; the shared model still knows copied runs."""
    runs, control = _runs_source(3, 400, 6)
    timing = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.05}
    prose = attrs.evolve(control, **timing).carry(SpeculationConfig())
    assert prose.choose()[1] > 1  # from the shared history alone: pipeline
    for _ in range(4):
        k, _ = prose.choose()
        prose.observe_chunk(k, 0, rejected=True)
    assert prose.choose()[1] == 1, prose.choose()
    assert prose.runs is not None and prose.runs.p(0) < 0.3
    assert runs.p(12) > 0.9  # the shared model saw those 4 chunks too
    assert sum(runs.tried) > sum(prose.runs.tried)


def test_sessions_sharing_the_stages_keep_pipelines_shallow() -> None:
    """One session alone pipelines deep; eight in flight make the stages the limit, where a
    chunk that may go stale takes compute from the others: one chunk each."""
    control = SpeculationController(
        SpeculationConfig(), alpha=0.9, lap_s=0.3, draft_s=0.0, stage_s=0.07
    )
    assert control.choose(sessions=1)[1] == SpeculationConfig().depth_max
    assert control.choose(sessions=8)[1] == 1
    depths = [control.choose(sessions=n)[1] for n in (1, 2, 4, 8)]
    assert depths == sorted(depths, reverse=True), depths
    fixed = SpeculationController(
        SpeculationConfig(k=4, depth=3), alpha=0.9, lap_s=0.3, stage_s=0.07
    )
    assert fixed.choose(sessions=8) == (4, 3)  # fixed values still win


def _hybrid_control(**kw: float) -> SpeculationController:
    """A hybrid's controller after 200 chunks: its lookup's copies held 95 % of the time (in
    runs), its model's guesses 25 %, and the model costs 20 ms per drafted token."""
    rng = random.Random(4)
    control = SpeculationController(SpeculationConfig(), runs=RunLengths(), **kw)
    for i in range(200):
        sources = [LOOKUP] * 6 if i % 2 else ["head"] * 6
        p = 0.95 if i % 2 else 0.25
        accepted = next((j for j in range(6) if rng.random() >= p), 6)
        control.observe_chunk(6, accepted, rejected=accepted < 6, sources=sources)
        control.observe_draft(0.0 if i % 2 else 0.12, 6, sources)
    return control


def test_the_hybrids_two_drafts_are_priced_apart() -> None:
    """Lookup guesses feed the run model, the model's feed model_alpha; the model's time is
    its own price and the lookup's is ~free."""
    control = _hybrid_control()
    assert control.model_alpha == pytest.approx(0.25, abs=0.15)
    assert control.runs is not None and control.runs.p(6) > 0.85
    assert control.model_cost_s == pytest.approx(0.02, rel=0.01)
    assert control.lookup_cost_s == 0.0
    # A mixed chunk: two copied guesses held, the model's first guess failed.
    before = control.model_alpha
    tried = sum(control.runs.tried)
    control.observe_chunk(4, 2, rejected=True, sources=[LOOKUP, LOOKUP, "head", "head"])
    assert control.model_alpha < before  # one model guess judged, and it failed
    assert sum(control.runs.tried) == pytest.approx(tried * control.runs.decay + 2)


def test_a_long_lookup_span_pipelines_and_the_models_stretch_stays_short() -> None:
    """Priced per position: with a long copy span ahead the controller drafts long, deep
    chunks at no draft cost; with none (the model drafts every guess, weakly and at 20 ms a
    token) it stays at one short chunk. One pooled price could not tell them apart."""
    timing = {"lap_s": 0.3, "stage_s": 0.05}
    control = _hybrid_control(**timing)
    control.run = 12
    k_copy, d_copy = control.choose(lead=32)
    assert k_copy >= 5 and d_copy >= 2, (k_copy, d_copy)
    control.run = 0
    k_model, d_model = control.choose(lead=0)
    assert d_model == 1 and k_model <= 3, (k_model, d_model)
    short = control.choose(lead=2)
    assert short[0] * short[1] < k_copy * d_copy  # a short span: less in flight
    # Unpriced (lead None), the lookup-fed run model alone would send the model's stretch
    # as long and deep as a copy: 35 weak guesses at 20 ms each.
    assert control.choose() == (8, 4) != (k_model, d_model)
