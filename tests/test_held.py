"""K-quant weights held dequantized (``shard.model.held``): a stage that holds them gives
the same bytes as one that dequantizes them per call (prefill, decode steps, a verify
chunk), a layer holds all of its such weights or none by what they add, and the bytes a
stage adds are what ``hold_cost`` says. The real Gemma 3 270M's nine Q6_K weights
are held by default, and ``tests/test_gemma_real.py`` checks the plan's bytes per stage
against the loaded stages to the byte (``footprint.stored`` prices the same rule)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from quant_fixtures import stored_tiny
from shard.model import quant
from shard.model.footprint import measured
from shard.model.held import HOLD_LAYER_BYTES, hold_small_groups, holds
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear, quantize_int4

pytestmark = pytest.mark.usefixtures("one_thread")

N_LAYERS = 4


def test_a_layer_holds_when_its_weights_add_at_most_the_limit() -> None:
    assert not holds(0)  # nothing to hold
    assert holds(1) and holds(HOLD_LAYER_BYTES)
    assert not holds(HOLD_LAYER_BYTES + 1)


def _k_quant_stage(root: Path, dense: torch.dtype) -> StageModel:
    """The tiny stored model with each layer's o_proj and down_proj in int4 groups of 16 (as
    GGUF's Q2_K and Q3_K are kept; Q6_K's int8 groups of 16 run on the q8 kernel instead):
    dequantized per call and multiplied in ``dense`` (``quant.dense_dtype`` set to it,
    whatever this CPU)."""
    model_dir: Path = stored_tiny(root, n_layers=N_LAYERS, seed=3)
    stage = load_stage(model_dir, 0, N_LAYERS, weights="stored", join=False)
    gen = torch.Generator().manual_seed(4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant, "dense_dtype", lambda _device: dense)
        for block in stage.blocks():
            for parent, name, quantize in (
                (block.self_attn, "o_proj", quantize_int4),
                (block.mlp, "down_proj", quantize_int4),
            ):
                old = getattr(parent, name)
                w = torch.randn(old.out_features, old.in_features, generator=gen) * 0.3
                setattr(parent, name, QuantLinear(quantize(w, group=16)))
    return stage


@pytest.fixture(scope="module")
def per_call(tmp_path_factory: pytest.TempPathFactory) -> StageModel:
    """``_k_quant_stage`` in bf16, as a CPU with bf16 instructions (and CUDA) multiplies."""
    stage = _k_quant_stage(tmp_path_factory.mktemp("held"), torch.bfloat16)
    assert all(m.holdable for m in _k_quant(stage))
    return stage


def test_weights_multiplied_in_float32_are_not_held(tmp_path: Path) -> None:
    """Where the call multiplies in float32 (a CPU without bf16), nothing is held: the plan
    prices bf16, and a float32 copy would be twice what it priced."""
    stage = _k_quant_stage(tmp_path, torch.float32)
    assert _k_quant(stage) and not any(m.holdable for m in _k_quant(stage))
    assert hold_small_groups(list(stage.layers)) == 0


def _k_quant(stage: StageModel) -> list[QuantLinear]:
    """The layers' weights dequantized per call."""
    return [
        m
        for block in stage.blocks()
        for m in block.modules()
        if isinstance(m, QuantLinear) and m.q is not None
    ]


def _run(stage: StageModel) -> list[torch.Tensor]:
    """Logits of a prefill, three decode steps and a 5-row verify chunk."""
    cache = stage.new_cache(64)
    out = [stage(torch.tensor([[5, 17, 9, 3, 5, 17, 9, 3]]), 0, cache)]
    for pos, tok in enumerate((7, 11, 13), start=8):
        out.append(stage(torch.tensor([[tok]]), pos, cache))
    out.append(stage(torch.tensor([[2, 4, 6, 8, 10]]), 11, cache))
    return out


def test_held_weights_give_the_bytes_of_per_call_dequantization(per_call: StageModel) -> None:
    held = copy.deepcopy(per_call)
    added = hold_small_groups(list(held.layers))
    paths = [m.path for m in held.modules() if isinstance(m, QuantLinear)]
    assert paths.count("held") == 2 * N_LAYERS and "dequantize" not in paths
    assert added > 0
    assert measured(held) - measured(per_call) == added
    with torch.inference_mode():
        for got, want in zip(_run(held), _run(per_call), strict=True):
            assert torch.equal(got, want)


def test_a_layer_past_the_limit_keeps_its_codes(
    per_call: StageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer is judged alone: with the limit between the tiny layers' cost and twice it,
    every layer holds; below their cost, none does (and every weight keeps its codes)."""
    import shard.model.held as held_module

    cost = sum(m.hold_cost() for m in _k_quant(per_call)) // N_LAYERS  # layers are alike
    for limit, held_each in ((cost, 2), (2 * cost - 1, 2), (cost - 1, 0)):
        monkeypatch.setattr(held_module, "HOLD_LAYER_BYTES", limit)
        stage = copy.deepcopy(per_call)
        assert hold_small_groups(list(stage.layers)) == (N_LAYERS * cost if held_each else 0)
        held = [
            sum(isinstance(m, QuantLinear) and m.path == "held" for m in block.modules())
            for block in stage.blocks()
        ]
        assert held == [held_each] * N_LAYERS
