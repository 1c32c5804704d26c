"""Quantized weights in a ring: the ring's greedy output equals the local run with the same
``weights``, token for token, batched or not, speculative or not. Speculative verification
runs a session's K+1 rows at once: the quantized kernels give a row the same bits alone as
among many, and a quantized block attends each row of a short chunk over exactly the keys that
row's decode sees (``Attention.rowwise``: row attention, ``shard.model.rowattn``), so a verify
chunk's rows are the decode's bits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
import trio

from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.reference import generate_reference
from shard.model.attention import Attention
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import kernel_dtype
from shard.spec.swarm import SwarmSpec
from test_speculation_ring import Ref, spec_for, with_ring

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(sessions: int) -> list[list[int]]:
    return [[(5 * i + 3 * j) % 240 + 1 for j in range(3 + i % 5)] * 2 for i in range(sessions)]


def _local(model_dir: Path, weights: str, prompts: list[list[int]], tokens: int) -> list[Ref]:
    """What ``shard generate --local --weights`` makes of each prompt (greedy), with the
    top-two logit gap at each step."""
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers, weights=weights)
    refs = []
    for p in prompts:
        gaps: list[float] = []
        out = generate_reference(
            model,
            p,
            max_tokens=tokens,
            eos_ids=config.eos_token_ids,
            max_len=160,
            prefill_chunk=8,
            gaps=gaps,
        )
        refs.append(Ref(out.token_ids, tuple(gaps)))
    return refs


async def _ring(
    spec: SwarmSpec, model_dir: Path, prompts: list[list[int]], tokens: int, k: int
) -> list[tuple[int, ...]]:
    """Every prompt at once through the ring (speculating ``k`` tokens a step when k > 0)."""
    done: dict[int, Completion] = {}

    async def body(coordinator: Coordinator) -> None:
        async def one(i: int) -> None:
            speculation = SpeculationConfig(k=k, depth=2) if k else SpeculationConfig(k=0, depth=1)
            done[i] = await coordinator.generate(
                prompts[i], max_tokens=tokens, speculation=speculation
            )

        async with trio.open_nursery() as clients:
            for i in range(len(prompts)):
                clients.start_soon(one, i)

    await with_ring(spec, model_dir, body)
    return [done[i].token_ids for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3], ids=["plain", "speculative"])
async def test_smollm2_stored_ring_equals_local(smollm2_dir: Path, k: int) -> None:
    """SmolLM2 with weights = "stored" (int4 layers, int8 embedding and tied head): 8
    concurrent sessions through a 3-stage ring each equal the local stored run exactly,
    plain and speculative (module docstring)."""
    if kernel_dtype(torch.device("cpu")) is not torch.bfloat16:
        # On a CPU without bf16 instructions the int4 kernel runs in fp32, ~10x slower than
        # bf16 (shard.model.quant): 8 SmolLM2 sessions then leave the ring silent past its
        # 60 s stall bound (RingError), before and after this test was written. The tiny
        # stored rings (test_quant_failover, test_quant_audit) still run here.
        pytest.skip("the int4 kernel runs in fp32 on this CPU: too slow for the ring's bound")
    spec = attrs.evolve(spec_for(smollm2_dir, "model", n_layers=30), weights="stored")
    prompts = _prompts(8)
    want = _local(smollm2_dir, "stored", prompts, 8)
    got = await _ring(spec, smollm2_dir, prompts, 8, k)
    assert got == [r.token_ids for r in want]


@pytest.mark.parametrize("weights", ["int8", "int4"])
async def test_float_checkpoint_quantized_at_load_ring_equals_local(
    tiny_checkpoint: object, weights: str
) -> None:
    """A float checkpoint quantized at load runs through a 3-stage ring exactly as locally,
    8 sessions at once, plain and speculative."""
    model_dir: Path = tiny_checkpoint(seed=11, n_layers=4)  # type: ignore[operator]
    spec = attrs.evolve(spec_for(model_dir, "model"), weights=weights)
    prompts = _prompts(8)
    want = [r.token_ids for r in _local(model_dir, weights, prompts, 16)]
    for k in (0, 3):
        assert await _ring(spec, model_dir, prompts, 16, k) == want, f"k={k}"


def test_a_stored_verify_chunk_is_its_decode_steps_bit_for_bit(
    smollm2_dir: Path, report: Callable[[str], None]
) -> None:
    """A stored SmolLM2 run over 9 tokens at once (a verify chunk) gives exactly the logits of
    decoding them one at a time: every row's attention sees what its decode sees."""
    config = ModelConfig.from_dir(smollm2_dir)
    model = load_stage(smollm2_dir, 0, config.n_layers, weights="stored")
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2495, 30, 378, 2063, 314]])
    chunk = torch.tensor([[12, 99, 5, 640, 77, 1001, 3, 45, 9]])
    start = prompt.shape[1]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            stepped, at_once = model.new_cache(32), model.new_cache(32)
            model(prompt, 0, stepped)
            model(prompt, 0, at_once)
            steps = [model(chunk[:, i : i + 1], start + i, stepped) for i in range(chunk.shape[1])]
            return torch.cat(steps, dim=1), model(chunk, start, at_once)

    one_by_one, verified = both()
    assert torch.equal(one_by_one, verified)
    for module in model.modules():  # what the chunk gives attended at once, for the record
        if isinstance(module, Attention):
            module.rowwise = False
    one_by_one, verified = both()
    gap = (one_by_one - verified).abs().max().item()
    report(f"stored verify chunk attended at once: max |logit diff| {gap:.3g}")
