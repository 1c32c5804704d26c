"""The ring in one process: stages and coordinator wired over memory channels (optionally with
emulated per-edge latency), compared token for token with the single-process reference."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from shard.coordinator.coordinator import RingError
from shard.decode.reference import generate_reference
from shard.decode.state import RequestTooLong
from shard.messages import Sampling
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint

PROMPTS = ([5, 17, 99, 3], [200, 31, 7, 7, 7, 64, 12, 1, 150, 9, 44], [42])
DEADLINE_S = 60.0


def tiny_spec(
    model_dir: Path,
    blocks: list[tuple[int, int]],
    *,
    latency_ms: float = 0.0,
    prefill_chunk: int = 4,
    max_len: int = 128,
) -> SwarmSpec:
    """A spec whose stages hold ``blocks``, on made-up loopback addresses (memory network)."""
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": max_len, "prefill_chunk": prefill_chunk, "max_sessions": 16},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": list(block)}
            for i, block in enumerate(blocks)
        ],
        "links": {"latency_ms": latency_ms},
    }
    return SwarmSpec.from_dict(data, source="test.toml")


def reference(model_dir: Path, prompt: list[int], **kw: Any) -> tuple[int, ...]:
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    return generate_reference(model, prompt, eos_ids=config.eos_token_ids, **kw).token_ids


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=3, n_layers=4)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen"), seed=4, arch="qwen2", n_layers=5)


async def _ring_outputs(
    spec: SwarmSpec, model_dir: Path, prompts: Any, **kw: Any
) -> list[tuple[int, ...]]:
    outputs = []
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=model_dir, task_status=task_status)
            )
            for prompt in prompts:
                done = await handle.coordinator.generate(prompt, **kw)
                outputs.append(done.token_ids)
            nursery.cancel_scope.cancel()
    return outputs


@pytest.mark.parametrize(
    "blocks",
    [
        [(0, 4)],
        [(0, 1), (1, 2), (2, 3), (3, 4)],
        [(0, 3), (3, 4)],
        [(0, 1), (1, 4)],
    ],
)
async def test_greedy_ring_matches_reference(
    llama_dir: Path, blocks: list[tuple[int, int]]
) -> None:
    """Greedy output through any split of the ring equals the whole model on one machine."""
    spec = tiny_spec(llama_dir, blocks)
    got = await _ring_outputs(spec, llama_dir, PROMPTS, max_tokens=24)
    want = [reference(llama_dir, p, max_tokens=24, max_len=128, prefill_chunk=4) for p in PROMPTS]
    assert got == want
    assert all(len(out) > 0 for out in got)


async def test_bfloat16_ring_matches_bfloat16_reference(llama_dir: Path) -> None:
    """A ring in bf16 (the GPU dtype) chooses in fp32 at the tail and equals the whole model
    run in bf16 on one machine."""
    spec = attrs.evolve(tiny_spec(llama_dir, [(0, 2), (2, 4)]), dtype="bfloat16")
    got = await _ring_outputs(spec, llama_dir, PROMPTS[:2], max_tokens=12)
    config = ModelConfig.from_dir(llama_dir)
    model = load_stage(llama_dir, 0, config.n_layers, dtype=torch.bfloat16)
    want = [
        generate_reference(
            model, p, eos_ids=config.eos_token_ids, max_tokens=12, max_len=128, prefill_chunk=4
        ).token_ids
        for p in PROMPTS[:2]
    ]
    assert got == want


async def test_bfloat16_stages_on_a_cpu_without_bf16_instructions_warn(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each bf16 stage on a CPU that lacks bf16 instructions logs one line saying its products
    are emulated, and still serves; an fp32 ring there logs no such line."""
    monkeypatch.setattr("shard.model.device.cpu_has_bf16", lambda *_: False)
    caplog.set_level(logging.WARNING)
    fp32 = tiny_spec(llama_dir, [(0, 2), (2, 4)])
    assert await _ring_outputs(fp32, llama_dir, PROMPTS[:1], max_tokens=4)
    assert not [r for r in caplog.records if "without bf16" in r.getMessage()]
    bf16 = attrs.evolve(fp32, dtype="bfloat16")
    got = await _ring_outputs(bf16, llama_dir, PROMPTS[:1], max_tokens=4)
    notes = [r for r in caplog.records if "without bf16" in r.getMessage()]
    assert sorted(r.getMessage().partition(":")[0] for r in notes) == ["s0", "s1"]
    assert all(r.levelno == logging.WARNING for r in notes)
    assert len(got[0]) > 0


async def test_graphs_on_a_cpu_stage_keep_the_output(llama_dir: Path) -> None:
    """``graphs = "warm"`` / ``"lazy"`` on a CPU stage falls back to eager: output unchanged."""
    spec = tiny_spec(llama_dir, [(0, 2), (2, 4)])
    spec = spec.with_runtime("s0", graphs="warm").with_runtime("s1", graphs="lazy")
    got = await _ring_outputs(spec, llama_dir, PROMPTS[:2], max_tokens=12)
    want = [
        reference(llama_dir, p, max_tokens=12, max_len=128, prefill_chunk=4) for p in PROMPTS[:2]
    ]
    assert got == want


async def test_qwen2_uneven_split_matches_reference(qwen_dir: Path) -> None:
    """A Qwen2-style model (q/k/v biases) split unevenly gives the reference's tokens."""
    spec = tiny_spec(qwen_dir, [(0, 1), (1, 4), (4, 5)])
    got = await _ring_outputs(spec, qwen_dir, PROMPTS, max_tokens=20)
    want = [reference(qwen_dir, p, max_tokens=20, max_len=128, prefill_chunk=4) for p in PROMPTS]
    assert got == want


async def test_seeded_sampling_matches_reference(llama_dir: Path) -> None:
    """Sampled output with a seed is reproducible and equal to the reference's draws."""
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    spec = tiny_spec(llama_dir, [(0, 2), (2, 4)])
    got = await _ring_outputs(spec, llama_dir, PROMPTS, max_tokens=24, sampling=sampling)
    want = [
        reference(llama_dir, p, max_tokens=24, max_len=128, prefill_chunk=4, sampling=sampling)
        for p in PROMPTS
    ]
    assert got == want
    greedy = [reference(llama_dir, p, max_tokens=24, max_len=128, prefill_chunk=4) for p in PROMPTS]
    assert got != greedy  # the draws really sampled


async def test_emulated_latency_keeps_output(llama_dir: Path) -> None:
    """With emulated per-edge latency the ring is slower but its tokens are unchanged."""
    spec = tiny_spec(llama_dir, [(0, 2), (2, 3), (3, 4)], latency_ms=5.0)
    prompt = PROMPTS[1]
    began = trio.current_time()
    got = await _ring_outputs(spec, llama_dir, [prompt], max_tokens=10)
    elapsed = trio.current_time() - began
    assert got == [reference(llama_dir, prompt, max_tokens=10, max_len=128, prefill_chunk=4)]
    # Every token costs at least one lap of 4 edges x 5 ms: proof the delay was applied.
    assert elapsed >= len(got[0]) * 4 * 0.005


async def test_eight_concurrent_sessions(llama_dir: Path) -> None:
    """Eight sessions interleave through one ring, each with its own KV and correct output."""
    spec = tiny_spec(llama_dir, [(0, 1), (1, 3), (3, 4)])
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(8)]
    results: dict[int, tuple[int, ...]] = {}
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=llama_dir, task_status=task_status)
            )

            async def one(i: int) -> None:
                done = await handle.coordinator.generate(prompts[i], max_tokens=16)
                results[i] = done.token_ids

            async with trio.open_nursery() as clients:
                for i in range(8):
                    clients.start_soon(one, i)
            stats = handle.coordinator.statistics()
            nursery.cancel_scope.cancel()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference(
            llama_dir, prompt, max_tokens=16, max_len=128, prefill_chunk=4
        )
    assert stats.requests_done == 8
    assert stats.sessions_open == 0


async def test_stage_fault_fails_only_that_request(llama_dir: Path) -> None:
    """A chunk a stage cannot compute ends that request with RingError; others still finish."""
    spec = tiny_spec(llama_dir, [(0, 2), (2, 4)])
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=llama_dir, task_status=task_status)
            )
            vocab = ModelConfig.from_dir(llama_dir).vocab_size
            with pytest.raises(RingError, match="out of range"):
                await handle.coordinator.generate([1, vocab + 5], max_tokens=4)
            ok = await handle.coordinator.generate(PROMPTS[0], max_tokens=8)
            nursery.cancel_scope.cancel()
    assert ok.token_ids == reference(
        llama_dir, PROMPTS[0], max_tokens=8, max_len=128, prefill_chunk=4
    )


async def test_request_longer_than_kv_is_refused(llama_dir: Path) -> None:
    """A prompt plus max_tokens beyond the session length is refused before touching the ring."""
    spec = tiny_spec(llama_dir, [(0, 4)], max_len=16)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=llama_dir, task_status=task_status)
            )
            with pytest.raises(RequestTooLong, match=r"limits\.max_len"):
                await handle.coordinator.generate(list(range(1, 12)), max_tokens=8)
            nursery.cancel_scope.cancel()


async def test_run_stats_account_for_every_hop(llama_dir: Path) -> None:
    """Run statistics name every stage and every ring edge, and count one lap per token."""
    spec = tiny_spec(llama_dir, [(0, 1), (1, 2), (2, 4)])
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=llama_dir, task_status=task_status)
            )
            done = await handle.coordinator.generate(PROMPTS[1], max_tokens=6)
            nursery.cancel_scope.cancel()
    stats = done.stats
    assert [n.node for n in stats.nodes] == ["s0", "s1", "s2"]
    assert {(e.src, e.dst) for e in stats.edges} == {
        ("coord", "s0"),
        ("s0", "s1"),
        ("s1", "s2"),
        ("s2", "coord"),
    }
    assert stats.laps == len(done.token_ids) + (done.finish_reason == "stop")
    assert stats.tokens == len(done.token_ids)
