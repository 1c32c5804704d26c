"""Batched stages across processes: concurrent sessions (SmolLM2 and a tiny random model)
through a swarm of stage processes each give the token ids they give alone, with speculation
off and on.

A session's greedy output must not depend on who shares its forwards (``shard.stage.batch``).
The lone runs and the crowd run go through the same swarm; ``NodeStat.batch_rows`` (the mean
rows of the forwards a request's chunks rode in) shows the crowd really was batched: a
request's own chunks are the same alone and in the crowd (greedy, same prompt), so a larger
mean at some stage means its chunks shared forwards with other sessions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from procs import LineReader, started_shard, write_spec
from shard.coordinator.client import request
from shard.messages import GenerateDone, GenerateRequest
from shard.nodes.compose import client_network
from shard.spec.swarm import SwarmSpec, load_spec
from shard.testing import make_tiny_checkpoint

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
MAX_TOKENS = 12
RUN_S = 240.0
# A short gather window makes chunks that arrive together share a forward even on a loaded
# machine (the default, 0, takes only what is already waiting).
LIMITS = {"connect_timeout_s": 5.0, "gather_window_s": 0.02, "max_len": 512}


@asynccontextmanager
async def swarm(spec_path: Path, model_dir: Path, log: Path) -> AsyncIterator[SwarmSpec]:
    args = ("swarm", "up", str(spec_path), "--model", str(model_dir))
    async with started_shard(*args, stderr_path=log) as launcher:
        with trio.fail_after(RUN_S):
            await LineReader(launcher.stdout).line_starting("SHARD SWARM UP")
        yield load_spec(spec_path)


async def run_one(spec: SwarmSpec, n: int, prompt: str, k: int) -> GenerateDone:
    network = client_network(spec)
    async with network:
        req = GenerateRequest(request=n, prompt=prompt, max_tokens=MAX_TOKENS, k=k, depth=1)
        done = await request(network, str(spec.coordinator.listen), req, swarm=spec.name)
    assert done.finish_reason != "error", done.error
    return done


async def crowd(spec: SwarmSpec, k: int) -> list[GenerateDone]:
    out: list[GenerateDone | None] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        out[i] = await run_one(spec, 100 + i, PROMPTS[i], k)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return [done for done in out if done is not None]


def rows(done: GenerateDone) -> dict[str, float]:
    return {stat.node: stat.batch_rows for stat in done.stats.nodes}


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
async def test_concurrent_sessions_in_a_swarm_give_their_lone_tokens(
    smollm2_dir: Path, tmp_path: Path, model: str
) -> None:
    """Four concurrent sessions over three stage processes, plain and speculative (n-gram,
    K = 3): each gives the token ids it gives alone, and the stages batched them."""
    if model == "smollm2":
        model_dir, blocks = smollm2_dir, [(0, 7), (7, 19), (19, 30)]
    else:
        model_dir = make_tiny_checkpoint(tmp_path / "tiny", seed=31, n_layers=4)
        blocks = [(0, 1), (1, 3), (3, 4)]
    spec_path = write_spec(
        tmp_path / "spec.toml", model_dir=model_dir, blocks=blocks, limits=LIMITS
    )
    with spec_path.open("a", encoding="utf-8") as f:
        f.write('\n[speculation]\ndraft = "ngram"\nk = 3\ndepth = 1\n')
    with trio.fail_after(3 * RUN_S):
        async with swarm(spec_path, model_dir, tmp_path / "swarm.log") as spec:
            for k in (0, 3):
                alone = [await run_one(spec, i, p, k) for i, p in enumerate(PROMPTS)]
                together = await crowd(spec, k)
                for lone, crowded in zip(alone, together, strict=True):
                    assert crowded.token_ids == lone.token_ids, (k, lone.text, crowded.text)
                shared = [
                    node
                    for lone, crowded in zip(alone, together, strict=True)
                    for node, mean in rows(crowded).items()
                    if mean > rows(lone).get(node, 0.0)
                ]
                print(
                    f"{model} k={k}: stages where a crowded request shared forwards: "
                    f"{sorted(shared)}"
                )
                assert shared, "no request ever shared a forward: the crowd was not batched"
