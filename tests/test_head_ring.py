"""The draft head through the in-process ring: the target's features come back with each
verdict, the head (alone, or in the hybrid) drafts from them, and the output stays the
reference's for every K and depth; a sampled request drafts from the head's q and still
follows the target's distribution."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.messages import Sampling
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.spec.swarm import SwarmSpec
from test_speculation_ring import (
    PROMPTS,
    chi_square,
    greedy_sweep,
    k_depth_params,
    reference,
    ties_or_equal,
    with_ring,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def agreeable(agreeable_head: tuple[Path, Path]) -> Path:
    """The shared tiny target (``tests/head_fixtures.py``)."""
    return agreeable_head[0]


@pytest.fixture(scope="module")
def head_dir(agreeable_head: tuple[Path, Path]) -> Path:
    """A head trained for seconds on the target (weak: the ring must be right anyway)."""
    return agreeable_head[1]


def spec_for(model_dir: Path, draft: str, head: Path) -> SwarmSpec:
    """A 3-stage tiny ring drafting with the head (memory network addresses)."""
    blocks = [(0, 1), (1, 3), (3, 4)]
    data: dict[str, Any] = {
        "swarm": {"name": "head", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 160, "prefill_chunk": 8, "max_sessions": 16},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9200"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9201 + i}", "layers": list(b)}
            for i, b in enumerate(blocks)
        ],
        "speculation": {"draft": draft, "draft_head": str(head)},
    }
    return SwarmSpec.from_dict(data, source="spec.toml")


@pytest.mark.parametrize("pairs", k_depth_params("the head's drafts at every K and D"))
@pytest.mark.parametrize("draft", ["head", "hybrid"])
async def test_greedy_identical_for_every_k_and_depth(
    agreeable: Path, head_dir: Path, draft: str, pairs: tuple[tuple[int, int], ...]
) -> None:
    """For each (K, D) of ``pairs`` (K in 1..8, D in 1..4), greedy output equals the
    reference (or a checked tie), the head drafting from the features each verdict brings
    (and the n-gram in the hybrid)."""
    spec = spec_for(agreeable, draft, head_dir)
    ties, drafted, accepted = await greedy_sweep(spec, agreeable, pairs)
    runs = len(pairs) * len(PROMPTS)
    print(f"draft={draft}: {accepted} of {drafted} drafts accepted; ties {ties} of {runs} runs")
    assert drafted > 0 and accepted > 0


async def test_adaptive_head_and_concurrent_sessions_identical(
    agreeable: Path, head_dir: Path
) -> None:
    """The adaptive K/D with the hybrid, and eight sessions at once (batched stages): each
    output is the reference's."""
    spec = spec_for(agreeable, "hybrid", head_dir)
    prompts = [[(3 * i + j) % 200 + 1 for j in range(4 + i)] * 2 for i in range(8)]
    refs = [reference(agreeable, p, 16) for p in prompts]
    results: dict[int, Completion] = {}

    async def body(coordinator: Coordinator) -> None:
        async def one(i: int) -> None:
            results[i] = await coordinator.generate(prompts[i], max_tokens=16)

        async with trio.open_nursery() as clients:
            for i in range(8):
                clients.start_soon(one, i)

    await with_ring(spec, agreeable, body)
    for i, ref in enumerate(refs):
        ties_or_equal(results[i].token_ids, ref)
    assert sum(r.stats.drafted for r in results.values()) > 0


async def test_sampling_with_the_heads_q_follows_the_target(
    agreeable: Path, head_dir: Path
) -> None:
    """1,500 seeded runs at temperature 0.7, the head drafting from its own q (sent with each
    chunk, judged by the general rule): the first token passes a chi-square test against the
    target's probabilities; the same seed gives the same text twice."""
    spec = spec_for(agreeable, "head", head_dir)
    prompt = PROMPTS[1]
    temperature, n_runs = 0.7, 1500

    async def body(coordinator: Coordinator) -> tuple[list[tuple[int, ...]], list[Completion]]:
        outs = []
        for i in range(n_runs):
            done = await coordinator.generate(
                prompt,
                max_tokens=2,
                sampling=Sampling(temperature=temperature, seed=7000 + i),
                speculation=SpeculationConfig(k=3, depth=1),
            )
            outs.append(done.token_ids)
        again = [
            await coordinator.generate(
                prompt,
                max_tokens=12,
                sampling=Sampling(temperature=temperature, seed=5),
                speculation=SpeculationConfig(k=3, depth=1),
            )
            for _ in range(2)
        ]
        return outs, again

    outs, again = await with_ring(spec, agreeable, body)
    assert again[0].token_ids == again[1].token_ids
    assert again[0].stats.drafted > 0
    config = ModelConfig.from_dir(agreeable)
    model = load_stage(agreeable, 0, config.n_layers)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), 0, model.new_cache(64))[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1)
    stat, dof = chi_square([o[0] for o in outs if o], probs, len(outs))
    z = 3.09  # the 99.9th percentile (Wilson-Hilferty), as in test_speculation_ring
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    print(f"chi-square {stat:.1f} on {dof} dof, limit {limit:.1f}")
    assert stat < limit


def test_spec_reads_the_head_draft(tmp_path: Path, head_dir: Path) -> None:
    """draft_head: a directory, or a head name; the default is <model>-head for a bundled
    model; a model by path needs a directory; other drafts refuse the key."""
    from shard.spec.validate import SpecError

    def spec(speculation: dict[str, Any], model: str = "smollm2") -> SwarmSpec:
        data: dict[str, Any] = {
            "swarm": {"name": "h", "model": model, "insecure": True},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9300"},
            "stage": [{"name": "s0", "listen": "127.0.0.1:9301"}],
            "speculation": speculation,
        }
        return SwarmSpec.from_dict(data, source="spec.toml")

    assert spec({"draft": "head"}).speculation.draft_head == "smollm2-head"
    assert spec({"draft": "hybrid", "draft_head": "smollm2-head"}).speculation.uses_head
    got = spec({"draft": "head", "draft_head": str(head_dir)}, model=str(tmp_path))
    assert got.speculation.draft_head == str(head_dir.resolve())
    for bad, model, why in [
        ({"draft": "head"}, str(tmp_path), "needs draft_head"),
        ({"draft": "head", "draft_head": "no/such/dir"}, "smollm2", "neither a head directory"),
        ({"draft": "ngram", "draft_head": "smollm2-head"}, "smollm2", "only meaningful"),
    ]:
        with pytest.raises(SpecError, match=why):
            spec(bad, model=model)
