"""Greedy generation agrees with transformers, token for token, on tiny random checkpoints.

transformers is the independent reference: it loads the same directory (config.json,
safetensors, tokenizer) with its own code. Measured on these checkpoints (torch 2.13 CPU,
transformers 5.24): llama and qwen2 logits are bit-identical (max |diff| 0.0), mistral with a
sliding window differs by ~3e-5 (transformers trims its cache to the window, so the attention
shapes differ). ``ATOL`` leaves room for kernel differences without hiding a real bug: a wrong
rope, norm or window moves logits by 1e-1 to 10.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import load_stage

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 36
PROMPTS = (
    "Hello, the world",
    "Once upon a time there was a tiny model",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
)

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama-tied": {"arch": "llama"},
    "llama-untied": {"arch": "llama", "tie_word_embeddings": False, "seed": 1},
    "llama3-rope": {"arch": "llama", "rope_scaling": True, "seed": 2},
    "llama3-rope-untied-sharded": {
        "arch": "llama",
        "rope_scaling": True,
        "tie_word_embeddings": False,
        "sharded": True,
        "seed": 3,
    },
    "qwen2-biases": {"arch": "qwen2", "seed": 4},
    "qwen2-untied-sharded": {"arch": "qwen2", "tie_word_embeddings": False, "sharded": True},
    "mistral-window8": {"arch": "mistral", "sliding_window": 8, "seed": 5},
}


def shard_greedy(model: StageModel, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then ``n`` one-token steps on a static cache; the new ids and their logits."""
    cache = model.new_cache(len(ids) + n)
    logits = model(torch.tensor([ids]), 0, cache)[0, -1]
    out, steps = [], []
    for pos in range(len(ids), len(ids) + n):
        steps.append(logits)
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), pos, cache)[0, -1]
    return out, torch.stack(steps)


def hf_greedy(hf: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The same loop on transformers with its own KV cache (``use_cache=True``)."""
    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns).
    cache_arg = (
        "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    )
    x, past = torch.tensor([ids]), None
    out, steps = [], []
    with torch.no_grad():
        for _ in range(n):
            res = hf(input_ids=x, use_cache=True, **{cache_arg: past})
            past, logits = res.past_key_values, res.logits[0, -1].float()
            steps.append(logits)
            out.append(int(logits.argmax()))
            x = torch.tensor([[out[-1]]])
    return out, torch.stack(steps)


def load_hf(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers(tiny_checkpoint: Callable[..., Path], name: str) -> None:
    """Every prompt's greedy continuation is token-identical to transformers; logits within ATOL."""
    model_dir = tiny_checkpoint(**CHECKPOINTS[name])
    config = ModelConfig.from_dir(model_dir)
    ours = load_stage(model_dir, 0, config.n_layers)
    hf = load_hf(model_dir)
    assert type(hf).__name__ == config.architecture
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        our_ids, our_logits = shard_greedy(ours, ids, NEW_TOKENS)
        hf_ids, hf_logits = hf_greedy(hf, ids, NEW_TOKENS)
        assert our_ids == hf_ids, f"{name}: {prompt!r}"
        torch.testing.assert_close(our_logits, hf_logits, rtol=0, atol=ATOL)
        assert len(set(our_ids)) > NEW_TOKENS // 4, "greedy output degenerated into a loop"


def test_prefill_logits_match_transformers_at_every_position(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """A whole-prompt forward matches transformers' logits at each position, not just the last."""
    model_dir = tiny_checkpoint(arch="qwen2", seed=4)
    ours = load_stage(model_dir, 0, 4)
    ids = torch.arange(3, 60).reshape(1, -1) * 4  # [1, 57], ids spread over the vocab
    with torch.no_grad():
        expected = load_hf(model_dir)(input_ids=ids).logits
    got = ours(ids, 0, ours.new_cache(ids.shape[1]))
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_greedy_matches_transformers_generate(tiny_checkpoint: Callable[..., Path]) -> None:
    """transformers' own ``generate(do_sample=False)`` produces our greedy continuation.

    ``generate`` stops at the checkpoint's eos, so it may return a prefix ending in eos.
    """
    model_dir = tiny_checkpoint(arch="llama", rope_scaling=True, seed=2)
    ours = load_stage(model_dir, 0, 4)
    hf = load_hf(model_dir)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPTS[1]).ids
    x = torch.tensor([ids])
    generated = hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    assert generated == shard_greedy(ours, ids, NEW_TOKENS)[0][: len(generated)]
    assert len(generated) == NEW_TOKENS or generated[-1] in ours.config.eos_token_ids
