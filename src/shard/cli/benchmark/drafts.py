"""Single-process references, the oracle's file, and the choice of the best model draft.

The references are what ``shard generate --local`` computes (``generate_reference`` on the
whole model, chunked like the ring): the identity check of every ring run and the oracle's
script. The best model draft is chosen before any ring starts, from each candidate's
teacher-forced greedy agreement with the references (α₁: the draft's next token equals the
reference's, given the reference's own prefix) and its cost per drafted token, by the D = 1
rate they predict at 25 ms per edge: ``max_K E(α₁, K) / (lap + K · t_d)``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from shard.cli.benchmark.bound import expected_tokens
from shard.cli.benchmark.options import Prompt
from shard.convert.bundled import cache_dir
from shard.coordinator.service import prompt_ids
from shard.decode.draft import ModelProposer, NGramProposer, Proposer
from shard.decode.reference import ReferenceResult, generate_reference
from shard.messages import GenerateRequest
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.llama import StageModel
from shard.model.loader import load_stage, load_truncated
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits

DISTILL_MARKER = "distill.json"  # shard.training.distill.build.MARKER: a finished distilled draft


@attrs.frozen
class Reference:
    """One prompt's single-process greedy run."""

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: str
    text: str
    step_s: float  # mean seconds per decode step: the whole model's compute per token
    tok_s: float  # end to end, prefill included


@attrs.frozen
class Candidate:
    """A model draft the bench may use as 'best', and what it measured."""

    label: str  # "layers:6" or a distilled draft's directory
    speculation: dict[str, str | int]  # its [speculation] keys
    alpha1: float  # teacher-forced greedy agreement with the references
    positions: int
    token_s: float  # seconds per drafted token (one thread, this process)
    predicted_tok_s: float
    predicted_k: int
    info: dict[str, Any] = attrs.field(factory=dict)


def run_references(
    model_dir: Path,
    prompts: Sequence[Prompt],
    max_tokens: int,
    limits: Limits,
    *,
    ignore_eos: bool = False,
) -> tuple[list[Reference], StageModel]:
    """Generate every prompt greedily with the whole model (past EOS with ``ignore_eos``);
    also returns the model."""
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = () if ignore_eos else tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_ids)))
    model = load_stage(model_dir, 0, config.n_layers)

    def run(ids: Sequence[int], n: int) -> ReferenceResult:
        return generate_reference(
            model,
            ids,
            max_tokens=n,
            eos_ids=eos,
            max_len=limits.max_len,
            prefill_chunk=limits.prefill_chunk,
        )

    out: list[Reference] = []
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(tokenizer, GenerateRequest(0, prompt.text, 1, chat=prompt.chat))
        if i == 0:
            run(ids, 4)  # warm-up, discarded
        result = run(ids, max_tokens)
        text = tokenizer.decode(result.token_ids)
        stats = result.stats
        out.append(
            Reference(
                prompt=prompt,
                prompt_ids=tuple(ids),
                output_ids=result.token_ids,
                finish_reason=result.finish_reason,
                text=text,
                step_s=stats.mean_lap_s,
                tok_s=stats.tok_s,
            )
        )
    return out, model


def write_oracle(path: Path, refs: Sequence[Reference]) -> None:
    """The oracle draft's file: each reference as prompt ids followed by its output ids."""
    references = [[*r.prompt_ids, *r.output_ids] for r in refs]
    path.write_text(json.dumps({"references": references}) + "\n")


def agreement(model: StageModel, refs: Sequence[Reference]) -> tuple[int, int]:
    """(hits, positions): the draft's greedy next token vs each reference token, teacher-forced
    (one forward over prompt + reference per prompt)."""
    hits = positions = 0
    with torch.inference_mode():
        for r in refs:
            ids = [*r.prompt_ids, *r.output_ids]
            cache = model.new_cache(len(ids) + 1)
            logits = []
            for start in range(0, len(ids), 128):
                chunk = torch.tensor([ids[start : start + 128]])  # [1, S]
                logits.append(model(chunk, start, cache)[0].argmax(-1))  # [S]
            guesses = torch.cat(logits)[len(r.prompt_ids) - 1 : -1].tolist()
            hits += sum(g == t for g, t in zip(guesses, r.output_ids, strict=True))
            positions += len(r.output_ids)
    return hits, positions


def ngram_agreement(refs: Sequence[Reference]) -> tuple[int, int, int]:
    """(hits, guesses, positions) of one-token n-gram proposals along each reference."""
    hits = guessed = positions = 0
    for r in refs:
        proposer = NGramProposer()
        for i, want in enumerate(r.output_ids):
            guess = proposer.propose([*r.prompt_ids, *r.output_ids[:i]], 1)
            guessed += bool(guess)
            hits += guess == [want]
        positions += len(r.output_ids)
    return hits, guessed, positions


def token_cost(make: Callable[[], Proposer], context: Sequence[int], k: int = 8) -> float:
    """Median seconds per drafted token of a fresh proposer continuing ``context`` by ``k``
    (its prefill is done first and not timed), over three tries."""
    times = []
    for _ in range(3):
        proposer = make()
        proposer.propose(context[:-1], 1)
        began = time.perf_counter()
        got = proposer.propose(context, k)
        times.append((time.perf_counter() - began) / max(len(got), 1))
    return sorted(times)[1]


def candidates(model_dir: Path, layers: Sequence[int]) -> list[tuple[str, dict[str, str | int]]]:
    """Truncated drafts (``layers``) and the distilled drafts in the cache for this model."""
    config = ModelConfig.from_dir(model_dir)
    out: list[tuple[str, dict[str, str | int]]] = [
        (f"layers:{n}", {"draft": "model", "draft_layers": n})
        for n in layers
        if n < config.n_layers
    ]
    root = cache_dir() / "drafts"
    for marker in sorted(root.glob(f"*/{DISTILL_MARKER}")) if root.is_dir() else []:
        try:
            if ModelConfig.from_dir(marker.parent).vocab_size != config.vocab_size:
                continue
        except ModelLoadError:
            continue  # a half-written or foreign directory is not a candidate
        out.append((str(marker.parent), {"draft": "model", "draft_model": str(marker.parent)}))
    return out


def parse_best(text: str, model_dir: Path) -> tuple[str, dict[str, str | int]]:
    """``layers:N`` or a checkpoint directory, as a candidate."""
    if text.startswith("layers:"):
        return text, {"draft": "model", "draft_layers": int(text.split(":", 1)[1])}
    path = Path(text).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"--best-draft {text!r}: not layers:N nor a checkpoint directory")
    return str(path), {"draft": "model", "draft_model": str(path)}


def measure(
    label: str,
    speculation: dict[str, str | int],
    model_dir: Path,
    refs: Sequence[Reference],
    *,
    lap_s: float,
    k_max: int,
) -> Candidate:
    """A candidate's agreement, cost and predicted D = 1 rate for a ring lap of ``lap_s``."""
    if "draft_layers" in speculation:
        model = load_truncated(model_dir, int(speculation["draft_layers"]))
        info: dict[str, Any] = {}
    else:
        path = Path(str(speculation["draft_model"]))
        model = load_stage(path, 0, ModelConfig.from_dir(path).n_layers)
        marker = path / DISTILL_MARKER
        info = json.loads(marker.read_text()) if marker.is_file() else {}
        info = {k: info[k] for k in ("target", "layers", "steps", "measured") if k in info}
    hits, positions = agreement(model, refs)
    context = [*refs[0].prompt_ids, *refs[0].output_ids[:8]]
    cost = token_cost(lambda: ModelProposer(model, max_len=len(context) + 16), context)
    alpha = hits / positions if positions else 0.0
    rates = {k: expected_tokens(alpha, k) / (lap_s + k * cost) for k in range(1, k_max + 1)}
    best_k = max(rates, key=lambda k: rates[k])
    return Candidate(label, speculation, alpha, positions, cost, rates[best_k], best_k, info)
