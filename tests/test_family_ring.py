"""Every family through a ring: packed rows, the in-process ring with 8 concurrent sessions
(speculation on and off, every frame through the wire codec), and a 3-stage ring of real
processes against ``generate --local``.

The ring of processes runs by default for Llama 3 and DeepSeek-V4 only (V4 is the one family
whose hop carries more than the hidden state: its ``hc_mult`` streams and the token ids);
for the others it is in the ``extended`` tier (``ops/test -m extended``, docs/testing.md):
what is theirs alone (their block, their messages' widths through the codec) is covered by
``test_eight_sessions_with_and_without_speculation``, and what processes add (the CLI,
WebSockets, a stage loading its block from the spec) is the same for every family.

A session's rows may share a batch with other sessions' rows (``shard.model.packed``). A
sparse layer routes each row alone and runs each expert over the rows that chose it, so rows
never interact; only the row count an expert's product sees changes with the batch, as for
the dense layers. So, as there, a batched row may differ from its lone run in the last bits
(measured and reported here) and a greedy choice may differ only at a numerical tie: the tie
rule of ``tests/test_batch.py`` and ``tests/test_speculation_ring.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import family_fixtures
from family_fixtures import FAMILIES
from procs import run_python, run_shard, write_spec
from shard.decode.control import SpeculationConfig
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.packed import Segment, forward_packed, segment_bounds
from shard.model.tokenizer import Tokenizer
from shard.nodes.coordinator import Coordinator
from shard.spec.swarm import SwarmSpec
from shard.transport import MemoryNetwork
from test_spec_swarm_cli import _LOCAL, check_same_or_tie
from test_speculation_ring import TIE, reference, ties_or_equal, with_ring

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture

CHUNKS = [(0, 7), (0, 1), (0, 5)]  # (start, rows): a prefill chunk, a decode step, a verify
#: Eight prompts, some repetitive (the n-gram drafter finds something to propose).
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(5)] + [
    [5, 17, 99, 3, 5, 17, 99, 3, 5, 17],
    [40, 41, 42, 43, 44, 40, 41, 42],
    [7, 7, 7, 7, 7, 7],
]
MAX_TOKENS = 16
#: The rings run every family and DeepSeek-V3 without ``q_lora_rank`` (a plain ``q_proj``).
RINGS = [*FAMILIES, "deepseek_v3_plain_q"]
#: The families whose ring of processes runs by default (see the module docstring).
PROCESS_RINGS = ("llama3", "deepseek_v4")
_IN_PROCESS = pytest.mark.extended(
    covered_by="test_family_ring.py::test_eight_sessions_with_and_without_speculation (the "
    "family, frames encoded) and test_process_ring_matches_local[llama3|deepseek_v4] (processes)"
)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_match_each_chunk_alone(
    family_checkpoint: Callable[[str], Path], family: str, report: Callable[[str], None]
) -> None:
    """Three sessions packed in one forward, then a step of each: every row within float noise
    of its lone run, every greedy choice equal unless a tie (bits measured and reported)."""
    model_dir = family_checkpoint(family)
    model = load_stage(model_dir, 0, ModelConfig.from_dir(model_dir).n_layers)
    alone = [model.new_cache(32) for _ in CHUNKS]
    packed = [model.new_cache(32) for _ in CHUNKS]
    worst, ties, chunks = 0.0, 0, list(CHUNKS)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        xs = [torch.randint(1, 260, (1, n), generator=gen) for _, n in chunks]
        want = [model(x, s, c) for (s, _), x, c in zip(chunks, xs, alone, strict=True)]
        segs = [Segment(s, n, c) for (s, n), c in zip(chunks, packed, strict=True)]
        got = forward_packed(model, torch.cat(xs, dim=1), segs)
        for (lo, hi), w in zip(segment_bounds(segs), want, strict=True):
            g = got[:, lo:hi]
            worst = max(worst, (g - w).abs().max().item())
            top2 = w.topk(2, dim=-1).values  # [1, S, 2]
            flipped = g.argmax(-1) != w.argmax(-1)
            gaps = (top2[..., 0] - top2[..., 1])[flipped]
            assert bool((gaps < TIE).all()), f"a greedy choice flipped at gap {gaps.tolist()}"
            ties += int(flipped.sum())
        chunks = [(start + n, 1 + i) for i, (start, n) in enumerate(chunks)]
    assert worst < 1e-3
    exact = "bit-identical" if worst == 0 else f"max |logit diff| {worst:.2g}"
    report(f"{family}: packed rows vs alone (fp32): {exact}, ties {ties}")


def ring_spec(model_dir: Path) -> SwarmSpec:
    """Three stages [0,1) [1,3) [3,4) with the n-gram drafter, on memory-network addresses."""
    data: dict[str, Any] = {
        "swarm": {"name": "family", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 160, "prefill_chunk": 8, "max_sessions": 16},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9200"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9201 + i}", "layers": list(b)}
            for i, b in enumerate([(0, 1), (1, 3), (3, 4)])
        ],
        "speculation": {"draft": "ngram"},
    }
    return SwarmSpec.from_dict(data, source="family.toml")


@pytest.mark.parametrize("family", RINGS)
async def test_eight_sessions_with_and_without_speculation(
    family_checkpoint: Callable[[str], Path], family: str, report: Callable[[str], None]
) -> None:
    """Eight concurrent sessions through a 3-stage ring, speculation off then on, every frame
    encoded and decoded by the wire codec: each equals the single-process reference (or
    diverges only at a checked tie)."""
    model_dir = family_checkpoint(family)
    refs = [reference(model_dir, p, MAX_TOKENS) for p in PROMPTS]
    outs: dict[tuple[int, int], tuple[int, ...]] = {}
    drafted = 0

    async def body(coordinator: Coordinator) -> None:
        nonlocal drafted
        for k in (0, 3):

            async def one(i: int, k: int = k) -> None:
                nonlocal drafted
                done = await coordinator.generate(
                    PROMPTS[i], max_tokens=MAX_TOKENS, speculation=SpeculationConfig(k=k, depth=2)
                )
                outs[(k, i)] = done.token_ids
                drafted += done.stats.drafted

            async with trio.open_nursery() as clients:
                for i in range(len(PROMPTS)):
                    clients.start_soon(one, i)

    await with_ring(
        ring_spec(model_dir), model_dir, body, network=MemoryNetwork(encode_frames=True)
    )
    ties = sum(ties_or_equal(outs[(k, i)], refs[i]) for k in (0, 3) for i in range(len(PROMPTS)))
    assert drafted > 0
    report(f"{family}: 8 sessions x speculation off/on: equal, ties {ties}, drafted {drafted}")


PROMPT = "in in in the the river river"


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [f if f in PROCESS_RINGS else pytest.param(f, marks=_IN_PROCESS) for f in RINGS]
)
async def test_process_ring_matches_local(
    family_checkpoint: Callable[[str], Path], family: str, tmp_path: Path
) -> None:
    """`shard swarm run` on 3 stages in separate processes gives `generate --local`'s tokens."""
    model_dir = family_checkpoint(family)
    spec = write_spec(
        tmp_path / "spec.toml", model_dir=model_dir, blocks=[(0, 1), (1, 3), (3, 4)],
        limits={"max_len": 256, "connect_timeout_s": 5.0},
    )  # fmt: skip
    local = await run_python(_LOCAL, str(model_dir), PROMPT, timeout_s=150)
    assert local.returncode == 0, local.describe()
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompt", PROMPT, "--max-tokens", "20",
        "--model", str(model_dir), timeout_s=150,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    [record], [ref] = done.json_records(), local.json_records()
    assert len(ref["token_ids"]) == 20
    prompt_ids = Tokenizer.from_dir(model_dir).encode(PROMPT)
    check_same_or_tie(model_dir, prompt_ids, record["token_ids"], ref["token_ids"])
