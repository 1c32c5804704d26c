"""Batched stages in a whole ring: concurrent sessions, each with the output it gets alone.

Sessions share a ring in-process; their chunks meet at the stages and run in shared forwards
(the verdicts' hops say how many rows each forward ran). Where a batched forward's float
rounding differs from a lone one, any divergence must be a numerical tie of the reference
(``test_speculation_ring.ties_or_equal``), and the ties are reported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio

from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.reference import generate_reference
from shard.messages import RunStats
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.testing import make_tiny_checkpoint, scale_upper_layers
from shard.testing.faults import FaultPlan
from test_failover import DECODE, PROMPTS, failover_spec, run_scenario
from test_failover import MAX_TOKENS as FAILOVER_TOKENS
from test_speculation_ring import reference, spec_for, ties_or_equal, with_ring

SESSIONS = 8
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("batchring"), seed=11, n_layers=4)


@pytest.fixture(scope="module")
def agreeable(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scale_upper_layers(
        tiny, tmp_path_factory.mktemp("agree") / "m", from_layer=2, factor=0.05
    )


def _prompts(sessions: int = SESSIONS) -> list[list[int]]:
    return [[(5 * i + 3 * j) % 240 + 1 for j in range(3 + i % 5)] * 2 for i in range(sessions)]


def _batched_rows(stats: list[RunStats]) -> float:
    """The largest mean rows-per-forward any session saw at any stage."""
    return max(n.batch_rows for s in stats for n in s.nodes)


@pytest.mark.parametrize(
    ("model", "speculation"),
    [
        ("tiny", None),  # plain decoding: one-row steps
        ("agreeable", SpeculationConfig(k=3, depth=2)),  # speculative, pipelined
        ("tiny", SpeculationConfig(k=3, depth=1)),  # a draft that is often wrong: rejections
        ("smollm2", None),  # the real model, plain
        ("smollm2", SpeculationConfig(k=3, depth=2)),  # and speculative (its first 2 layers draft)
    ],
    ids=["plain", "speculative", "rejections", "smollm2-plain", "smollm2-speculative"],
)
async def test_concurrent_sessions_get_their_lone_output(
    request: pytest.FixtureRequest,
    model: str,
    speculation: SpeculationConfig | None,
    report: Callable[[str], None],
) -> None:
    """Eight sessions at once through a 3-stage ring: each gets the reference output (what it
    gets alone) or diverges only at a checked tie (SmolLM2, stored by default: exactly, plain
    or speculative); their chunks really shared forwards."""
    model_dir: Path = request.getfixturevalue("smollm2_dir" if model == "smollm2" else model)
    layers = ModelConfig.from_dir(model_dir).n_layers
    spec = spec_for(model_dir, "model" if speculation else "ngram", n_layers=layers)
    # SmolLM2 is ~100x the tiny model's compute: fewer sessions and tokens keep it short
    sessions, tokens = (4, 8) if model == "smollm2" else (SESSIONS, MAX_TOKENS)
    prompts = _prompts(sessions)
    refs = [reference(model_dir, p, tokens) for p in prompts]
    done: dict[int, Completion] = {}

    async def body(coordinator: Coordinator) -> None:
        async def one(i: int) -> None:
            done[i] = await coordinator.generate(
                prompts[i],
                max_tokens=tokens,
                speculation=speculation or SpeculationConfig(k=0, depth=1),
            )

        async with trio.open_nursery() as clients:
            for i in range(sessions):
                clients.start_soon(one, i)

    await with_ring(spec, model_dir, body)
    if model == "smollm2":  # stored weights (its default): the quantized kernels and a verify
        # chunk attended row by row give every row its lone decode's bits: no tie allowed
        assert [done[i].token_ids for i in range(sessions)] == [r.token_ids for r in refs]
        ties = 0
    else:
        ties = sum(ties_or_equal(done[i].token_ids, refs[i]) for i in range(sessions))
    stats = [done[i].stats for i in range(sessions)]
    rows = _batched_rows(stats)
    own = 1 + (speculation.k if speculation and speculation.k else 0)
    assert rows > own, f"no forward ran more than one chunk's {own} rows: {rows}"
    if model != "agreeable" and speculation:
        assert sum(s.accepted for s in stats) < sum(s.drafted for s in stats)  # rejections
    queued = max(n.queued_s for s in stats for n in s.nodes)
    report(
        f"batched ring ({model}, {speculation}): numerical ties {ties} of {sessions}, "
        f"mean rows per forward up to {rows:.1f}, most queueing {queued * 1e3:.1f} ms"
    )


def test_a_killed_stage_mid_batch_keeps_every_session_intact(tmp_path: Path) -> None:
    """Three concurrent sessions batched (a 5 ms gather window) while s1 is killed during
    decoding: a standby is spliced in, and every session's output equals the reference."""
    model_dir = make_tiny_checkpoint(tmp_path / "m", seed=11, n_layers=6)  # test_failover's
    config = ModelConfig.from_dir(model_dir)
    whole = load_stage(model_dir, 0, config.n_layers)
    refs = [
        generate_reference(
            whole,
            list(p),
            eos_ids=config.eos_token_ids,
            max_tokens=FAILOVER_TOKENS,
            prefill_chunk=4,
            max_len=96,
        ).token_ids
        for p in PROMPTS
    ]
    plan = FaultPlan.random(4242, kind="kill", node="s1", frames=DECODE)
    # Virtual time, compute inline: a chunk is computed the moment it arrives unless the stage
    # waits for company, so a short gather window makes the sessions' chunks meet.
    spec = failover_spec(model_dir)
    spec = attrs.evolve(spec, limits=attrs.evolve(spec.limits, gather_window_s=0.005))
    out = run_scenario(spec, model_dir, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    assert ("hot", "s1") in [(r.kind, r.lost) for r in out.recoveries], out.recoveries
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == refs[i], f"{plan}: request {i} output differs"
    rows = _batched_rows([r.stats for r in out.results if isinstance(r, Completion)])
    # One-row decode steps and prompt chunks of <= 4 rows: alone, a mean under 1.5 rows.
    assert rows > 2, f"{plan}: the sessions' chunks never shared a forward ({rows})"
