"""Speculative decoding through the in-process ring: drafts, one-lap verification, pipelining,
early cancellation, lossless sampling — compared with the single-process reference."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.reference import generate_reference
from shard.messages import Sampling
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint, scale_upper_layers

DEADLINE_S = 120.0
TIE = 1e-4  # a divergence is acceptable only where the reference's top-two gap is below this
# Repetitive prompts give the n-gram proposer something to find.
PROMPTS = (
    [5, 17, 99, 3, 5, 17, 99, 3, 5, 17],
    [40, 41, 42, 43, 44, 40, 41, 42],
    [7, 7, 7, 7, 7, 7],
)
#: Every K in 1..8 with every D in 1..4 (the extended tier runs it).
K_DEPTH_GRID = tuple((k, d) for k in range(1, 9) for d in range(1, 5))
#: The default run's 10 of those 32: every K, every D at least twice, and the four corners
#: (the grid's combinations repeat what these cover; docs/testing.md).
K_DEPTH_COVER = (*((k, (k - 1) % 4 + 1) for k in range(1, 9)), (1, 4), (8, 1))


def k_depth_params(covered_by: str) -> list[Any]:
    """``pairs`` parameters for a K x D test: ``cover`` by default, ``grid`` in the extended
    tier, which names ``covered_by`` beside the same test's ``cover``."""
    return [
        pytest.param(K_DEPTH_COVER, id="cover"),
        pytest.param(
            K_DEPTH_GRID,
            id="grid",
            marks=pytest.mark.extended(covered_by=f"this test's [cover] pairs; {covered_by}"),
        ),
    ]


def spec_for(model_dir: Path, draft: str, *, draft_layers: int = 2, n_layers: int = 4) -> SwarmSpec:
    """A 3-stage tiny ring with the given draft kind (memory network addresses)."""
    blocks = [(0, 1), (1, n_layers - 1), (n_layers - 1, n_layers)]
    speculation: dict[str, Any] = {"draft": draft}
    if draft in ("model", "auto"):
        speculation["draft_layers"] = draft_layers
    data: dict[str, Any] = {
        "swarm": {"name": "spec", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 160, "prefill_chunk": 8, "max_sessions": 16},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9101 + i}", "layers": list(b)}
            for i, b in enumerate(blocks)
        ],
        "speculation": speculation,
    }
    return SwarmSpec.from_dict(data, source="spec.toml")


@attrs.frozen
class Ref:
    """The reference's output and the top-two logit gap at each of its steps."""

    token_ids: tuple[int, ...]
    gaps: tuple[float, ...]


def reference(model_dir: Path, prompt: list[int], max_tokens: int, **kw: Any) -> Ref:
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    gaps: list[float] = []
    result = generate_reference(
        model,
        prompt,
        max_tokens=max_tokens,
        eos_ids=config.eos_token_ids,
        max_len=160,
        prefill_chunk=8,
        gaps=gaps,
        **kw,
    )
    return Ref(result.token_ids, tuple(gaps))


def ties_or_equal(got: tuple[int, ...], want: Ref) -> int:
    """0 if identical; 1 if they diverge only at a numerical tie of the reference (checked)."""
    if got == want.token_ids:
        return 0
    i = next(
        (j for j, (a, b) in enumerate(zip(got, want.token_ids, strict=False)) if a != b),
        min(len(got), len(want.token_ids)),
    )
    assert i < len(want.gaps), f"outputs differ in length only: {got} vs {want.token_ids}"
    assert want.gaps[i] < TIE, (
        f"divergence at token {i} where the reference's top-two gap is {want.gaps[i]:.3g} "
        f"(>= {TIE}): not a numerical tie\n got {got}\nwant {want.token_ids}"
    )
    return 1


async def with_ring(spec: SwarmSpec, model_dir: Path, body: Any, **swarm: Any) -> Any:
    """``body(coordinator)`` against an in-process swarm of ``spec`` (``swarm``: more
    ``run_swarm`` options, such as its network)."""
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(
                    spec, model_dir=model_dir, task_status=task_status, **swarm
                )
            )
            result = await body(handle.coordinator)
            nursery.cancel_scope.cancel()
    return result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), seed=11, n_layers=4)


@pytest.fixture(scope="module")
def agreeable(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers >= 2 add little: the 2-layer draft agrees often (high α)."""
    return scale_upper_layers(
        tiny, tmp_path_factory.mktemp("agree") / "m", from_layer=2, factor=0.05
    )


@pytest.mark.parametrize("pairs", k_depth_params("the ring's lossless verify at every K and D"))
@pytest.mark.parametrize("draft", ["ngram", "model"])
async def test_greedy_identical_for_every_k_and_depth(
    tiny: Path, agreeable: Path, draft: str, pairs: tuple[tuple[int, int], ...]
) -> None:
    """For each (K, D) of ``pairs`` (K in 1..8, D in 1..4), greedy output equals the
    reference (or a checked tie)."""
    model_dir = agreeable if draft == "model" else tiny
    ties, _, accepted = await greedy_sweep(spec_for(model_dir, draft), model_dir, pairs)
    print(f"draft={draft}: numerical ties {ties} of {len(pairs) * len(PROMPTS)} runs")
    assert accepted > 0  # drafts were really verified and accepted


async def greedy_sweep(
    spec: SwarmSpec, model_dir: Path, pairs: tuple[tuple[int, int], ...]
) -> tuple[int, int, int]:
    """Each prompt of ``PROMPTS`` at each (K, D) of ``pairs`` through a ring of ``spec``, its
    greedy output checked against the reference (``ties_or_equal``): the checked ties, the
    tokens drafted and those accepted, over all runs."""
    refs = [reference(model_dir, p, 24) for p in PROMPTS]
    ties = drafted = accepted = 0

    async def body(coordinator: Coordinator) -> None:
        nonlocal ties, drafted, accepted
        for k, depth in pairs:
            for prompt, ref in zip(PROMPTS, refs, strict=True):
                done = await coordinator.generate(
                    prompt, max_tokens=24, speculation=SpeculationConfig(k=k, depth=depth)
                )
                ties += ties_or_equal(done.token_ids, ref)
                drafted += done.stats.drafted
                accepted += done.stats.accepted

    await with_ring(spec, model_dir, body)
    return ties, drafted, accepted


async def test_adaptive_auto_draft_identical(agreeable: Path) -> None:
    """The adaptive K/D with the auto (n-gram + model) draft keeps greedy output identical."""
    spec = spec_for(agreeable, "auto")
    refs = [reference(agreeable, p, 32) for p in PROMPTS]

    async def body(coordinator: Coordinator) -> list[Completion]:
        return [await coordinator.generate(p, max_tokens=32) for p in PROMPTS]

    runs = await with_ring(spec, agreeable, body)
    for run, ref in zip(runs, refs, strict=True):
        ties_or_equal(run.token_ids, ref)
    stats = [r.stats for r in runs]
    assert sum(s.accepted for s in stats) > 0
    assert max(s.tokens_per_lap for s in stats) > 1.0


async def test_pipelining_rejections_fence_stale_chunks(tiny: Path, agreeable: Path) -> None:
    """With a middling draft and deep pipelines, rejections happen, stale verdicts are dropped
    or skipped by stages, and the output is still the reference's."""
    spec = spec_for(tiny, "model")  # the untuned model: the 2-layer draft is often wrong
    refs = [reference(tiny, p, 24) for p in PROMPTS]

    async def body(coordinator: Coordinator) -> list[Completion]:
        return [
            await coordinator.generate(
                p, max_tokens=24, speculation=SpeculationConfig(k=3, depth=4)
            )
            for p in PROMPTS
        ]

    runs = await with_ring(spec, tiny, body)
    for run, ref in zip(runs, refs, strict=True):
        ties_or_equal(run.token_ids, ref)
    drafted = sum(r.stats.drafted for r in runs)
    accepted = sum(r.stats.accepted for r in runs)
    assert accepted < drafted  # rejections happened
    assert max(r.stats.max_depth for r in runs) > 1


async def test_concurrent_speculative_sessions(agreeable: Path) -> None:
    """Eight speculative, pipelined sessions interleave and each gets the reference output."""
    spec = spec_for(agreeable, "auto")
    prompts = [[(3 * i + j) % 200 + 1 for j in range(4 + i)] * 2 for i in range(8)]
    refs = [reference(agreeable, p, 16) for p in prompts]
    results: dict[int, tuple[int, ...]] = {}

    async def body(coordinator: Coordinator) -> None:
        async def one(i: int) -> None:
            done = await coordinator.generate(
                prompts[i], max_tokens=16, speculation=SpeculationConfig(k=4, depth=2)
            )
            results[i] = done.token_ids

        async with trio.open_nursery() as clients:
            for i in range(8):
                clients.start_soon(one, i)

    await with_ring(spec, agreeable, body)
    for i, ref in enumerate(refs):
        ties_or_equal(results[i], ref)


async def test_seeded_sampling_is_mode_invariant(agreeable: Path) -> None:
    """The same seed gives the same sampled output twice, and with or without speculation."""
    spec = spec_for(agreeable, "auto")
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=99)
    ref = reference(agreeable, PROMPTS[0], 24, sampling=sampling)

    async def body(coordinator: Coordinator) -> list[tuple[int, ...]]:
        outs = []
        for cfg in (
            SpeculationConfig(k=0),
            SpeculationConfig(k=4, depth=1),
            SpeculationConfig(k=4, depth=3),
            None,
        ):
            for _ in range(2):
                done = await coordinator.generate(
                    PROMPTS[0], max_tokens=24, sampling=sampling, speculation=cfg
                )
                outs.append(done.token_ids)
        return outs

    outs = await with_ring(spec, agreeable, body)
    assert all(out == ref.token_ids for out in outs)


async def test_sampled_distribution_matches_the_target(agreeable: Path) -> None:
    """2,000 seeded runs through the speculative ring, 8 in flight: the first token's
    frequencies pass a chi-square test against the target model's own probabilities."""
    spec = spec_for(agreeable, "auto")
    prompt = PROMPTS[1]
    sampling_t = 1.0
    n_runs = 2000
    seed0 = random.Random(2024).randrange(1 << 30)
    print(f"sampling seed base {seed0}")

    async def body(coordinator: Coordinator) -> list[tuple[int, ...]]:
        speculation = SpeculationConfig(k=2, depth=2)
        return await seeded_runs(coordinator, prompt, n_runs, seed0, sampling_t, speculation)

    outs = await with_ring(spec, agreeable, body)
    firsts = [o[0] for o in outs if o]
    # Target probabilities of the first token, straight from the model.
    config = ModelConfig.from_dir(agreeable)
    model = load_stage(agreeable, 0, config.n_layers)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), 0, model.new_cache(64))[0, -1]
    probs = torch.softmax(logits / sampling_t, dim=-1)
    stat, dof = chi_square(firsts, probs, len(outs))
    # Threshold: the 99.9th percentile of chi-square with `dof` degrees of freedom
    # (Wilson-Hilferty approximation); a correct sampler fails this 1 time in 1000.
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    print(f"chi-square {stat:.1f} on {dof} dof, limit {limit:.1f}")
    assert stat < limit


async def seeded_runs(
    coordinator: Coordinator,
    prompt: list[int],
    n_runs: int,
    seed0: int,
    temperature: float,
    speculation: SpeculationConfig,
    at_once: int = 8,
) -> list[tuple[int, ...]]:
    """The tokens of ``n_runs`` 2-token requests sampled at ``temperature`` with seeds
    ``seed0``, ``seed0 + 1``, ..., ``at_once`` of them in flight (the stages batch their rows:
    one at a time took ~30 s here, and a batched row is sampled by the same rule)."""
    outs: list[tuple[int, ...]] = []

    async def one(i: int) -> None:
        done = await coordinator.generate(
            prompt,
            max_tokens=2,
            sampling=Sampling(temperature=temperature, seed=seed0 + i),
            speculation=speculation,
        )
        outs.append(done.token_ids)

    for first in range(0, n_runs, at_once):
        async with trio.open_nursery() as nursery:
            for i in range(first, min(first + at_once, n_runs)):
                nursery.start_soon(one, i)
    return outs


def chi_square(draws: list[int], probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic over tokens with expected count >= 5 (the rest pooled)."""
    counts = torch.bincount(torch.tensor(draws), minlength=probs.shape[0]).double()
    expected = probs.double() * n
    big = expected >= 5
    cells_obs = [*counts[big].tolist(), float(counts[~big].sum())]
    cells_exp = [*expected[big].tolist(), float(expected[~big].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_obs, cells_exp, strict=True) if e > 0)
    return stat, len(cells_obs) - 1


def test_a_bf16_draft_model_on_a_cpu_without_bf16_instructions_warns(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's draft model in bf16 on a CPU lacking bf16 instructions logs the
    emulation line, named for the coordinator; in fp32 it logs none."""
    from shard.nodes.drafter import make_drafter

    monkeypatch.setattr("shard.model.device.cpu_has_bf16", lambda *_: False)
    caplog.set_level(logging.WARNING)
    spec = spec_for(tiny, "model")
    assert make_drafter(spec, tiny) is not None
    assert not [r for r in caplog.records if "without bf16" in r.getMessage()]
    assert make_drafter(spec.with_runtime("coord", dtype="bfloat16"), tiny) is not None
    notes = [r.getMessage() for r in caplog.records if "without bf16" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("coord: dtype bfloat16")
