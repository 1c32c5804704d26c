"""``build_eagle3``: an EAGLE-3 head for a target, end to end (``shard draft eagle3``).

    text      ``data.fill``: the target (a bf16 copy where the CPU multiplies bf16, else
              fp32) continues varied prompts, greedily or at a low temperature, keeping the
              states entering the head's layers; chunks cached under
              ``<cache>/drafts/eagle3-data/<target>-<key>/`` and reused by later runs
    train     ``build.train``: the training-time test (three unrolled steps) for a budget
              of minutes, the readout scored against the target's distribution
    measure   chained acceptance (``shard.training.head.measure``) along the target's
              greedy continuations of the held-out prompts (``HELD_OUT``), through
              ``HeadProposer``
    publish   ``build.save_head``: SpecForge's layout, with ``train.json`` beside it

The shipped ``smollm2-eagle3`` head (``shard.decode.head.shipped``) was made by this, with
the arguments its ``train.json`` records.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from shard.convert.bundled import cache_dir
from shard.decode.head.eagle3 import target_embedding
from shard.decode.head.eagle3_files import default_layers
from shard.decode.head.proposer import HeadProposer
from shard.model.config import ModelConfig
from shard.model.device import cpu_has_bf16
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT
from shard.training.eagle3.build import draft_vocabulary, head_config, new_head, save_head, train
from shard.training.eagle3.data import ChunkStore, fill, sample_batch
from shard.training.eagle3.prompts import vocabulary_words
from shard.training.eagle3.train import Eagle3Recipe
from shard.training.head.measure import chained_acceptance

__all__ = ["DataPlan", "build_eagle3", "data_dir"]

DATA_VERSION = 1


@attrs.frozen
class DataPlan:
    """The training text: ``tokens`` real positions in rows of ``seq_len`` (prompts cut to
    their last ``prompt_len`` tokens), ``rows`` a chunk, temperatures taken in turn (0:
    greedy); every ``copy_every``-th chunk copy tasks (0: none), prompts cut to
    ``copy_prompt_len``."""

    tokens: int = 900_000
    rows: int = 256
    seq_len: int = 160
    prompt_len: int = 64
    temperatures: tuple[float, ...] = (0.0, 0.5, 0.0, 0.8)
    seed: int = 0
    copy_every: int = 0
    copy_prompt_len: int = 112


def data_dir(target_dir: Path, plan: DataPlan, dtype: torch.dtype) -> Path:
    """Where a target's text for ``plan`` is cached (the token count is not in the key: a
    larger plan extends a smaller one's chunks)."""
    key = json.dumps(
        [
            DATA_VERSION,
            Path(target_dir).name,
            plan.rows,
            plan.seq_len,
            plan.prompt_len,
            list(plan.temperatures),
            plan.seed,
            str(dtype),
        ]
        # copy chunks (``copy_every``) make other text: keyed apart; none keeps the old key
        + ([plan.copy_every, plan.copy_prompt_len] if plan.copy_every else [])
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "drafts" / "eagle3-data" / f"{Path(target_dir).name}-{digest}"


def build_eagle3(
    target_dir: Path,
    out: Path,
    *,
    plan: DataPlan,
    recipe: Eagle3Recipe,
    minutes: float,
    data: Path | None = None,
) -> dict[str, Any]:
    """Make (or reuse) the text, train for ``minutes``, measure, and publish to ``out``;
    returns the report written to ``train.json``."""
    began = time.perf_counter()
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it or choose another directory")
    config = ModelConfig.from_dir(target_dir)
    n = config.n_layers
    layers = default_layers(n)
    tok = Tokenizer.from_dir(target_dir)
    dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
    sampler = load_stage(target_dir, 0, n, dtype=dtype, weights=str(dtype).removeprefix("torch."))
    store = ChunkStore(data or data_dir(target_dir, plan, dtype))
    fill(
        store,
        sampler,
        tok,
        vocabulary_words(target_dir),
        layers=layers,
        tokens=plan.tokens,
        rows=plan.rows,
        seq_len=plan.seq_len,
        prompt_len=plan.prompt_len,
        temperatures=plan.temperatures,
        seed=plan.seed,
        copy_every=plan.copy_every,
        copy_prompt_len=plan.copy_prompt_len,
    )
    refs = _held_out(sampler, tok, layers)
    data_s = time.perf_counter() - began
    del sampler
    emb, rows_w, norm_w = _target_tables(target_dir, n)
    batch = store.load()
    vocab = draft_vocabulary(batch, recipe.draft_vocab, tok.eos_ids)
    hc = head_config(json.loads((target_dir / "config.json").read_text()), len(vocab), layers)
    head = new_head(hc, vocab, emb, rows_w, norm_w, recipe.seed)
    record = train(head, batch, rows_w[vocab], tok.eos_ids, recipe, minutes * 60)
    with torch.no_grad():
        starts, alpha, committed = chained_acceptance(head, refs)
    report = {
        "target": Path(target_dir).name,
        "layers": list(layers),
        "data": {
            **attrs.asdict(plan),
            "dir": str(store.root),
            "tokens_held": store.tokens,
            "rows_held": int(batch.ids.shape[0]),
            "sampler_dtype": str(dtype),
        },
        "recipe": attrs.asdict(recipe),
        "minutes": minutes,
        "threads": torch.get_num_threads(),
        "train": record,
        "measured": {
            "starts": starts,
            "alpha": alpha,
            "committed": committed,
            "draft_ms": _draft_ms(head, refs[0]),
        },
        "wall_s": round(time.perf_counter() - began, 1),
        "data_s": round(data_s, 1),
        "load_average": round(os.getloadavg()[0], 2),
    }
    save_head(head, hc, out, report)
    return report


def _target_tables(target_dir: Path, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's embedding (as the coordinator reads it for a head without one), its
    head's rows and its final norm's weight, in fp32."""
    emb = target_embedding(target_dir)
    last = load_stage(target_dir, n - 1, n, dtype=torch.float32, weights="float32")
    assert last.lm_head is not None and last.norm is not None
    return emb, last.lm_head.weight.detach().clone(), last.norm.weight.detach().clone()


def _held_out(
    sampler: StageModel, tok: Tokenizer, layers: tuple[int, ...], tokens: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The target's greedy continuations of ``HELD_OUT`` with its states: (ids, states,
    prompt length) each."""
    refs = []
    for kind, text in HELD_OUT:
        s = tok.apply_chat([{"role": "user", "content": text}]) if kind == "chat" else text
        ids = tok.encode(s)
        b = sample_batch(
            sampler,
            [ids],
            layers=layers,
            seq_len=len(ids) + tokens,
            temperature=0.0,
            stop_ids=tok.eos_ids,
            generator=torch.Generator(),
        )
        n = int(b.valid[0].sum())
        refs.append((b.ids[0, :n], b.states[0, :n].float(), len(ids)))
    return refs


def _draft_ms(head: Any, ref: tuple[torch.Tensor, torch.Tensor, int]) -> float:
    """Median ms per drafted token: 3 x 8 tokens drafted past a held-out prompt."""
    ids, states, p = ref
    times = []
    for _ in range(3):
        proposer = HeadProposer(head, max_len=len(ids) + 10)
        proposer.observe(0, states[: p - 1])
        proposer.propose(ids[:p].tolist(), 1)  # the prompt: not timed
        t = time.perf_counter()
        proposer.propose(ids[:p].tolist(), 8)
        times.append((time.perf_counter() - t) * 1000 / 8)
    return round(sorted(times)[1], 2)
