"""Pipeline splits are bit-identical to the unsplit model (torch.equal, not allclose)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import load_stage

PROMPTS = ([5, 77, 101, 260, 33, 8, 199, 42, 42, 7, 3], [9, 1, 250, 66, 12, 180, 97, 4, 4, 120, 31])
DECODE_STEPS = 4
MAX_LEN = 32

CHECKPOINTS = {
    "llama-tied": {"arch": "llama"},
    "llama-untied": {"arch": "llama", "tie_word_embeddings": False},
    "qwen2-5layers": {"arch": "qwen2", "n_layers": 5, "seed": 1},
}


def bounds_for(n_layers: int) -> list[list[int]]:
    """Several splits of ``[0, n_layers)``: one-layer blocks, uneven blocks, two blocks."""
    return [
        list(range(n_layers + 1)),
        [0, 1, n_layers - 1, n_layers],
        [0, 2, n_layers],
        [0, n_layers - 1, n_layers],
        [0, 1, n_layers],
    ]


def run_ring(
    stages: Sequence[StageModel], tokens: torch.Tensor, n_prompt: int
) -> list[torch.Tensor]:
    """Prefill ``tokens[:, :n_prompt]`` then feed the rest one position at a time, as a ring does.

    Returns the tail's logits for each step (the prefill chunk, then each decode position).
    """
    caches = [s.new_cache(MAX_LEN, batch=tokens.shape[0]) for s in stages]
    chunks = [(0, n_prompt)] + [(p, p + 1) for p in range(n_prompt, tokens.shape[1])]
    out = []
    for start, end in chunks:
        x = tokens[:, start:end]
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, start, cache)
        out.append(x)
    return out


def greedy_tokens(model: StageModel, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The prompt followed by ``steps`` greedy tokens of the unsplit model, ``[B, P+steps]``."""
    cache = model.new_cache(MAX_LEN, batch=prompt.shape[0])
    tokens, start = prompt, 0
    for _ in range(steps):
        logits = model(tokens[:, start:], start, cache)
        start = tokens.shape[1]
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("batch", [1, 2])
def test_every_split_gives_identical_logits(
    tiny_checkpoint: Callable[..., Path], name: str, batch: int
) -> None:
    """Running blocks [0,a),[a,b),...,[z,L) in turn equals the full model bit for bit."""
    model_dir = tiny_checkpoint(**CHECKPOINTS[name])
    n_layers = ModelConfig.from_dir(model_dir).n_layers
    full = load_stage(model_dir, 0, n_layers)
    prompt = torch.tensor(PROMPTS[:batch])
    tokens = greedy_tokens(full, prompt, DECODE_STEPS)
    expected = run_ring([full], tokens, prompt.shape[1])
    for bounds in bounds_for(n_layers):
        stages = [load_stage(model_dir, a, b) for a, b in itertools.pairwise(bounds)]
        got = run_ring(stages, tokens, prompt.shape[1])
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g.dtype == torch.float32
            assert torch.equal(g, e), f"split {bounds} differs at step {step}"


def test_split_of_shared_weights_is_identical(tiny_checkpoint: Callable[..., Path]) -> None:
    """Stages built directly from one full model's state dict also match it exactly."""
    model_dir = tiny_checkpoint(arch="llama", tie_word_embeddings=False)
    full = load_stage(model_dir, 0, 4)
    weights = full.state_dict()
    stages = []
    for a, b in ((0, 1), (1, 3), (3, 4)):
        stage = StageModel(full.config, a, b)
        stage.load_state_dict(_slice_state(weights, a, b, stage))
        stages.append(stage)
    tokens = greedy_tokens(full, torch.tensor(PROMPTS[:1]), DECODE_STEPS)
    for g, e in zip(run_ring(stages, tokens, 11), run_ring([full], tokens, 11), strict=True):
        assert torch.equal(g, e)


def _slice_state(
    weights: dict[str, torch.Tensor], first: int, last: int, stage: StageModel
) -> dict[str, torch.Tensor]:
    """The entries of a full model's state dict that block ``[first, last)`` owns, renumbered."""
    out = {}
    for name in stage.state_dict():
        if name.startswith("layers."):
            _, j, rest = name.split(".", 2)
            out[name] = weights[f"layers.{first + int(j)}.{rest}"]
        else:
            out[name] = weights[name]
    return out
