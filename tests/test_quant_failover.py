"""Failover on quantized blocks: a stage of a ring with weights = "stored" is killed mid-decode,
its hot standby (which holds the stage's block as stored) takes over, and every request's
output equals the local stored run — the harness of ``tests/test_failover.py`` (virtual time,
compute inline, three concurrent requests), on a tiny checkpoint in the stored layout."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from quant_fixtures import stored_tiny
from shard.coordinator.coordinator import Completion
from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import kernel_dtype
from shard.testing.faults import FaultPlan
from test_failover import DECODE, MAX_TOKENS, PROMPTS, failover_spec, run_scenario


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stored_tiny(tmp_path_factory.mktemp("quant-failover"))


def local_references(model_dir: Path, weights: str | None) -> list[tuple[int, ...]]:
    """``shard generate --local --weights`` of each of ``PROMPTS`` (as the harness runs them)."""
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers, weights=weights)
    return [
        generate_reference(
            model, list(p), eos_ids=config.eos_token_ids, max_tokens=MAX_TOKENS,
            prefill_chunk=4, max_len=96,
        ).token_ids
        for p in PROMPTS
    ]  # fmt: skip


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_a_killed_stored_stage_is_replaced_with_identical_output(
    stored: Path, speculate: bool
) -> None:
    """s1 of a stored ring is killed while decoding; its standby, holding the stored block,
    takes over hot, and each request's tokens equal the local stored run (which differ from
    the dense run's where the host's kernels run bf16: the ring really runs the quantized
    kernels; with fp32 kernels the two agree, and only the equality is shown)."""
    want = local_references(stored, "stored")
    if kernel_dtype(torch.device("cpu")) is torch.bfloat16:
        assert want != local_references(stored, "float32")
    spec = attrs.evolve(failover_spec(stored, speculate=speculate), weights="stored")
    plan = FaultPlan.random(1200 + speculate, kind="kill", node="s1", frames=DECODE)
    out = run_scenario(spec, stored, plan)
    assert out.injector.fired, f"{plan}: the fault never fired"
    assert [(r.kind, r.lost) for r in out.recoveries] == [("hot", "s1")], out.recoveries
    for i, result in enumerate(out.results):
        assert isinstance(result, Completion), f"{plan}: request {i} failed: {result}"
        assert result.token_ids == want[i], f"{plan}: request {i} output differs"
