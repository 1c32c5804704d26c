"""A block's bytes predicted from its config alone equal what a loaded stage holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from family_fixtures import FAMILIES, family_checkpoint
from shard.model.config import ModelConfig
from shard.model.footprint import FootprintError, measured, predict
from shard.model.loader import load_stage
from shard.model.quant import kernel_dtype

__all__ = ["family_checkpoint"]  # the fixture, re-exported for pytest

FORMATS = ("float32", "bfloat16", "int8", "int4")


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_predicted_bytes_equal_the_loaded_stages(
    family_checkpoint: Callable[[str], Path], family: str, weights: str
) -> None:
    """For every family's tiny checkpoint and every format, each stage of a 3-way split (and
    the whole model on one stage) holds what ``predict`` says, within 5 % (the issue's
    bound; the two agree to the byte where every tensor's layout is known)."""
    path = family_checkpoint(family)
    config = ModelConfig.from_dir(path)
    dtype = "bfloat16" if weights == "bfloat16" else "float32"
    bf16 = kernel_dtype(torch.device("cpu")) is torch.bfloat16
    footprint = predict(config, weights, dtype=dtype, bf16_kernels=bf16)
    n = config.n_layers
    for first, last in ((0, 1), (1, n - 1), (n - 1, n), (0, n)):
        stage = load_stage(
            path, first, last, dtype=getattr(torch, dtype), config=config, weights=weights
        )
        got, want = measured(stage), footprint.stage(first, last)
        assert abs(got - want) <= 0.05 * got, f"{family} {weights} [{first},{last}): {got} {want}"


def test_stored_weights_are_not_guessed_from_a_config(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """``"stored"`` mixes formats tensor by tensor: a config alone cannot size it."""
    config = ModelConfig.from_dir(family_checkpoint("qwen3"))
    with pytest.raises(FootprintError, match="checkpoint"):
        predict(config, "stored")
