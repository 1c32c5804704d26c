"""The bundled SmolLM2-135M-Instruct: split bit-identity, agreement with transformers, and the
``shard generate --local`` command a user runs first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import QuantEmbedding
from shard.model.tokenizer import Tokenizer

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)
# Measured: max |logit difference| vs transformers 5.24 on these prompts is 0.0 to ~2e-5 (the
# same fp32 ops in a different order); 1e-3 leaves room for other BLAS builds.
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def whole(smollm2_dir: Path) -> torch.nn.Module:
    """The whole model as users run it: its quantized tensors as stored (the default)."""
    return load_stage(smollm2_dir, 0, 30)


def test_split_is_bit_identical(smollm2_dir: Path, whole: torch.nn.Module) -> None:
    """Blocks [0,7) [7,19) [19,30) run one after another give exactly the unsplit logits
    (stored weights, the default: the int4 kernel's rows do not depend on the split)."""
    assert isinstance(whole.embed_tokens, QuantEmbedding)
    blocks = [load_stage(smollm2_dir, a, b) for a, b in ((0, 7), (7, 19), (19, 30))]
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    ids = torch.tensor([tokenizer.encode(PROMPTS[2])])  # [1, S]
    caches = [b.new_cache(64) for b in blocks]
    full_cache = whole.new_cache(64)
    steps = [
        (ids, 0),
        (torch.tensor([[1234]]), ids.shape[1]),
        (torch.tensor([[99]]), ids.shape[1] + 1),
    ]
    with torch.inference_mode():
        for x, start in steps:
            want = whole(x, start, full_cache)
            h = x
            for block, cache in zip(blocks, caches, strict=True):
                h = block(h, start, cache)
            assert torch.equal(h, want)


def test_greedy_matches_transformers(smollm2_dir: Path, smollm2_float32_dir: Path) -> None:
    """32 greedy tokens agree with transformers (on the float32 conversion of the same GGUF:
    ours loads the cache's stored tensors dequantized, ``weights="float32"``) token for token;
    logits within LOGIT_ATOL."""
    transformers = pytest.importorskip("transformers")
    whole = load_stage(smollm2_dir, 0, 30, weights="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_float32_dir, dtype=torch.float32)
    hf.eval()
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = generate_reference(whole, ids, max_tokens=32, eos_ids=())
        assert len(ours.token_ids) == 32
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None
            )
            theirs = tuple(out[0, len(ids) :].tolist())
            assert ours.token_ids == theirs, prompt
            full = torch.tensor([ids + list(theirs)])  # [1, S]
            hf_logits = hf(full).logits[0]  # [S, V]
            our_logits = whole(full, 0, whole.new_cache(full.shape[1]))[0]
        assert torch.allclose(our_logits, hf_logits, atol=LOGIT_ATOL, rtol=0)


def _shard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shard", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_local_is_coherent(smollm2_dir: Path) -> None:
    """`shard generate --local` completes a factual prompt with the right answer."""
    run = _shard("generate", "--local", "--max-tokens", "12", "The capital of France is")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout


def test_generate_local_chat_json(smollm2_dir: Path) -> None:
    """--chat wraps the prompt in the model's template; --json gives ids, text and stats."""
    prompt = "What is the capital of France? Answer in one word."
    run = _shard("generate", "--local", "--chat", "--json", "--max-tokens", "16", prompt)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert set(record) >= {"token_ids", "text", "stats", "finish_reason"}
    assert "Paris" in record["text"]
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    assert record["text"] == tokenizer.decode(record["token_ids"])
    assert record["stats"]["tokens"] == len(record["token_ids"])
    # The chat template changes the conditioning: the plain prompt continues differently.
    config = ModelConfig.from_dir(smollm2_dir)
    plain = generate_reference(
        load_stage(smollm2_dir, 0, 30),
        tokenizer.encode(prompt),
        max_tokens=16,
        eos_ids=config.eos_token_ids,
    )
    assert list(plain.token_ids) != record["token_ids"]
