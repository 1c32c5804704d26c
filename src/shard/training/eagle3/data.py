"""Target text for an EAGLE-3 head: the target's own continuations of varied prompts, with
the residual stream entering three of its layers at every position.

A batch of prompts (``prompts.prompt_texts``) is left-padded and continued by the target,
greedily or sampled at a low temperature, in one cached forward per token; at every
position the states entering the head's layers (``h[l]``, what a stage's pre-hook captures
in a ring: ``shard.decode.head.eagle3``) and the final normed hidden (whose product with the
tied head gives the target's logits, the training label) are kept. Rows are then moved to
start at position 0, as the ring sees a session.

Chunks of rows are written to a directory (``ChunkStore``), each renamed into place whole,
so an interrupted run loses at most the chunk it was making and a rerun adds to the rest.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from shard.model.kvcache import KVCache
from shard.model.llama import StageModel
from shard.model.tokenizer import Tokenizer
from shard.training.distill.data import _causal, _sample
from shard.training.eagle3.copy_prompts import copy_prompt_texts, natural_passages, reply_marks
from shard.training.eagle3.prompts import prompt_texts

__all__ = ["Batch", "ChunkStore", "sample_batch"]

_MANIFEST = "chunks.json"


@attrs.frozen
class Batch:
    """Rows from position 0: ids ``[B, S]``, states ``[B, S, 3 D]`` (entering the head's
    layers, concatenated in layer order), final normed hidden ``[B, S, D]``, and which
    positions are real text (prompt and continuation up to and including EOS) ``[B, S]``."""

    ids: Tensor
    states: Tensor
    final: Tensor
    valid: Tensor


def sample_batch(
    target: StageModel,
    prompts: list[list[int]],
    *,
    layers: tuple[int, ...],
    seq_len: int,
    temperature: float,
    stop_ids: tuple[int, ...],
    generator: torch.Generator,
) -> Batch:
    """Continue every prompt to ``seq_len`` tokens in one batch (``temperature`` 0: greedy)
    and keep the states entering ``layers`` and the final normed hidden at every position."""
    b, p = len(prompts), max(len(x) for x in prompts)
    if p >= seq_len:
        raise ValueError(f"prompts of {p} tokens leave no room in seq_len {seq_len}")
    d = target.config.hidden_size
    ids = torch.zeros(b, seq_len, dtype=torch.long)
    real = torch.zeros(b, seq_len, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, p - len(prompt) : p] = torch.tensor(prompt)
        real[r, p - len(prompt) :] = True
    causal = _causal(seq_len, target.config.sliding_window)
    mask = ((causal & real[:, None, :]) | torch.eye(seq_len, dtype=torch.bool))[:, None]
    states = torch.zeros(b, seq_len, len(layers) * d, dtype=torch.bfloat16)
    final = torch.zeros(b, seq_len, d, dtype=torch.bfloat16)
    cache = target.new_cache(seq_len, batch=b)
    assert target.lm_head is not None
    with torch.inference_mode():
        h = _step(target, ids[:, :p], 0, cache, mask[:, :, :p, :p], layers, states)
        final[:, :p] = h
        for t in range(p, seq_len):
            logits = target.lm_head(h[:, -1]).float()  # [B, V]
            if temperature > 0:
                ids[:, t] = _sample(logits / temperature, generator)
            else:
                ids[:, t] = logits.argmax(-1)
            h = _step(
                target, ids[:, t : t + 1], t, cache, mask[:, :, t : t + 1, : t + 1], layers, states
            )
            final[:, t] = h[:, 0]
    valid = real.clone()
    stops = torch.isin(ids[:, p:], torch.tensor(stop_ids))
    for r in range(b):
        hits = stops[r].nonzero()
        if len(hits):
            valid[r, p + int(hits[0]) + 1 :] = False  # the stop itself is text the head sees
    for r, prompt in enumerate(prompts):
        pad = p - len(prompt)
        ids[r], valid[r] = ids[r].roll(-pad), valid[r].roll(-pad)
        states[r], final[r] = states[r].roll(-pad, dims=0), final[r].roll(-pad, dims=0)
    return Batch(ids, states, final, valid)


def _step(
    model: StageModel,
    ids: Tensor,
    start: int,
    cache: KVCache,
    mask: Tensor,
    layers: tuple[int, ...],
    states: Tensor,
) -> Tensor:
    """One cached forward of ``ids`` ``[B, S]`` at ``start``: the final normed hidden, with
    the states entering ``layers`` written into ``states[:, start:start+S]``."""
    assert model.embed_tokens is not None and model.norm is not None
    s, d = ids.shape[1], model.config.hidden_size
    h = model.embed_tokens(ids)
    rope = (
        model.rope_cos[start : start + s].to(h.dtype),
        model.rope_sin[start : start + s].to(h.dtype),
    )
    for j, layer in enumerate(model.layers):
        if j in layers:
            i = layers.index(j)
            states[:, start : start + s, i * d : (i + 1) * d] = h
        h = layer(h, rope, mask, cache, j, start)
    out: Tensor = model.norm(h)
    return out


class ChunkStore:
    """Chunks of ``Batch`` rows under ``root``; ``chunks.json`` lists the complete ones."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            self.entries: list[dict[str, object]] = json.loads(
                (self.root / _MANIFEST).read_text(encoding="utf-8")
            )
        except (OSError, ValueError):
            self.entries = []

    @property
    def tokens(self) -> int:
        return sum(int(str(e["tokens"])) for e in self.entries)

    def add(self, batch: Batch, seconds: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"chunk-{len(self.entries):05d}.safetensors"
        tmp = self.root / f".{name}.tmp"
        save_file(
            {
                "ids": batch.ids.contiguous(),
                "states": batch.states.contiguous(),
                "final": batch.final.contiguous(),
                "valid": batch.valid.contiguous(),
            },
            str(tmp),
        )
        os.replace(tmp, self.root / name)
        tokens = int(batch.valid.sum())
        self.entries.append({"file": name, "tokens": tokens, "seconds": round(seconds, 2)})
        tmp = self.root / f".{_MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.entries, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.root / _MANIFEST)

    def texts(self, index: int, tokenizer: Tokenizer) -> list[str]:
        """Chunk ``index``'s rows as text (their real positions, decoded); reads the ids and
        the mask alone, not the chunk's states."""
        with safe_open(str(self.root / str(self.entries[index]["file"])), "pt") as part:
            ids, valid = part.get_tensor("ids"), part.get_tensor("valid")
        return [tokenizer.decode(i[v].tolist()) for i, v in zip(ids, valid, strict=True)]

    def load(self) -> Batch:
        parts = [load_file(str(self.root / str(e["file"]))) for e in self.entries]
        if not parts:
            raise ValueError(f"no chunks under {self.root}")
        return Batch(
            *(torch.cat([t[k] for t in parts]) for k in ("ids", "states", "final", "valid"))
        )


def fill(
    store: ChunkStore,
    target: StageModel,
    tokenizer: Tokenizer,
    words: list[str],
    *,
    layers: tuple[int, ...],
    tokens: int,
    rows: int,
    seq_len: int,
    prompt_len: int,
    temperatures: tuple[float, ...],
    seed: int,
    copy_every: int = 0,
    copy_prompt_len: int = 112,
) -> None:
    """Add chunks of ``rows`` rows until ``store`` holds ``tokens`` real positions. Chunk
    ``i`` uses seed ``seed + i``: its prompts and draws do not depend on what came before.
    Every ``copy_every``-th chunk (0: none) holds copy tasks (``copy_prompts``), their
    prompts cut to ``copy_prompt_len`` tokens, most of their passages taken from the text of
    the chunk before."""
    while store.tokens < tokens:
        i = len(store.entries)
        rng = random.Random(seed * 1_000_003 + i)
        began = time.perf_counter()
        if copy_every and i % copy_every == copy_every - 1:
            natural = None
            if store.entries:
                natural = natural_passages(store.texts(-1, tokenizer), marks=reply_marks(tokenizer))
            texts = copy_prompt_texts(
                tokenizer, words, rows, rng, natural=natural, max_len=copy_prompt_len
            )
            cut = copy_prompt_len
        else:
            texts, cut = prompt_texts(tokenizer, words, rows, rng), prompt_len
        prompts = [x[-cut:] for x in texts]
        batch = sample_batch(
            target,
            prompts,
            layers=layers,
            seq_len=seq_len,
            temperature=temperatures[i % len(temperatures)],
            stop_ids=tokenizer.eos_ids,
            generator=torch.Generator().manual_seed(seed * 1_000_003 + i),
        )
        store.add(batch, time.perf_counter() - began)
        print(f"chunk {i}: {store.tokens} tokens, {time.perf_counter() - began:.1f} s", flush=True)
