"""Train a draft against target labels, and measure its agreement with the target.

``train`` fits the draft's layers and final norm (the tied embedding and head stay frozen) to
target labels from ``shard.training.distill.data``. The loss per step is

- cross-entropy on the target's argmax (greedy agreement is what speculation pays for; for
  a 2-layer SmolLM2 draft it beat KL(target || draft) by 1 to 3 points of α at each of three
  learning rates; ``objective="kl"`` keeps the KL), at a random subset of positions: each
  costs a ``[D] x [D, V]`` head product, the dominant cost of a step; plus
- the squared error of the centred logits at every position, computed in hidden space
  through the head's Gram matrix (``|E d|^2 = d^T (E^T E) d``), so it costs ``D^2``.

``measure`` is the honest check: greedy next-token agreement (α) with the target along its
own greedy continuations of held-out prompts, through the ring's proposer API
(``shard.decode.draft``), for the draft, the same layers untrained, and n-gram prompt lookup.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from shard.decode.draft import ModelProposer, NGramProposer, Proposer
from shard.model.llama import StageModel
from shard.model.tokenizer import Tokenizer
from shard.training.distill.data import Corpus, hidden_states

__all__ = [
    "HELD_OUT",
    "Measured",
    "Objective",
    "Run",
    "agreement",
    "kd_loss",
    "mean_kl",
    "measure",
    "reference_runs",
    "train",
]

HELD_OUT = (
    ("chat", "How do I make a good cup of coffee at home?"),
    ("plain", 'def binary_search(items, target):\n    """Return the index of target in items.'),
    ("plain", "The old train station at the edge of town had been closed for years, but"),
    ("chat", "Write a short email inviting my team to a planning meeting on Friday."),
    ("plain", "The planets of the solar system, in order from the Sun:\n1."),
)
"""Evaluation prompts: none is, or is built from, a training seed prompt."""

Objective = Literal["ce", "kl"]

_LR = 3e-3  # best of 5e-4, 1.5e-3, 3e-3, 6e-3 (docs/drafts.md)
_KL_POSITIONS = 256  # per step, of 8 x 192: the full-vocabulary loss is a step's main cost
_MSE_WEIGHT = 0.05


@attrs.frozen
class Measured:
    """Greedy next-token agreement with the target on held-out prompts, and costs.

    ``alpha``: the draft's agreement; ``alpha_truncated``: the same layers untrained;
    ``alpha_ngram`` over the positions where prompt lookup has a guess (``ngram_coverage``).
    """

    positions: int
    alpha: float
    alpha_truncated: float
    alpha_ngram: float
    ngram_coverage: float
    draft_ms: float
    target_ms: float


def train(
    student: StageModel,
    corpus: Corpus,
    *,
    steps: int,
    batch: int,
    seed: int,
    budget_s: float | None = None,
    progress: bool = False,
    lr: float = _LR,
    kl_positions: int = _KL_POSITIONS,
    mse_weight: float = _MSE_WEIGHT,
    objective: Objective = "ce",
) -> list[float]:
    """Train ``student``'s layers and final norm on ``corpus`` in place; the loss per step.

    Stops after ``steps`` or ``budget_s`` seconds, whichever comes first (but runs at least
    one step); the learning rate warms up over the first 5 % of that and then decays (cosine)
    to a tenth. ``kl_positions``: positions per step that get the full-vocabulary loss.

    Kept whole (one line over the house limit): it is the training loop, read top to bottom.
    """
    head = _head_weight(student)
    gram = _gram(head)
    params = [p for name, p in student.named_parameters() if not name.startswith("embed")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    losses: list[float] = []
    began = time.perf_counter()
    total = steps if budget_s is None else None  # a budget usually ends it before ``steps``
    bar = tqdm(total=total, desc="distilling", unit="step", disable=not progress)
    for step in range(steps):
        done = _fraction_done(step, steps, time.perf_counter() - began, budget_s)
        if done >= 1.0 and step > 0:  # at least one step, so there is a loss to report
            break
        for group in opt.param_groups:
            group["lr"] = lr * _schedule(done)
        if len(order) < batch:  # epochs in a fresh random order, each row once per epoch
            order = torch.cat([order, torch.randperm(len(corpus.ids), generator=gen)])
        rows, order = order[:batch], order[batch:]
        h = hidden_states(student, corpus.ids[rows])  # [B, S, D]
        loss = kd_loss(
            h,
            corpus.labels[rows].float(),
            corpus.valid[rows],
            head,
            gram,
            gen,
            kl_positions,
            mse_weight,
            objective,
        )
        _descend(opt, params, loss)
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", done=f"{done:.0%}", refresh=False)
    bar.close()
    for p in params:
        p.requires_grad_(False)
    return losses


def _descend(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], loss: torch.Tensor
) -> None:
    """One optimizer step on ``loss``, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _fraction_done(step: int, steps: int, spent_s: float, budget_s: float | None) -> float:
    """How far training is, 0..1: by steps, or by the time budget when that is further."""
    done = step / steps
    if budget_s is None:
        return done
    return max(done, spent_s / budget_s if budget_s > 0 else 1.0)


def kd_loss(
    h: Tensor,
    labels: Tensor,
    valid: Tensor,
    head: Tensor,
    gram: Tensor,
    gen: torch.Generator,
    kl_positions: int,
    mse_weight: float,
    objective: Objective = "ce",
) -> Tensor:
    """The distillation loss: ``objective`` at ``kl_positions`` random valid positions (``"ce"``:
    cross-entropy on the target's argmax; ``"kl"``: KL(target || draft)), plus
    ``mse_weight`` times the centred-logit squared error at every valid position.

    ``h``, ``labels``: the draft's and target's normed hidden ``[B, S, D]``; ``head`` ``[V, D]``.
    """
    diff = (h - labels)[valid]  # [N, D]
    mse = ((diff @ gram) * diff).sum(-1).mean()
    where = valid.flatten().nonzero()[:, 0]
    pick = where[torch.randperm(len(where), generator=gen)[:kl_positions]]
    log_q = F.log_softmax(h.flatten(0, 1)[pick] @ head.T, dim=-1)  # [K, V]
    with torch.no_grad():
        teacher = labels.flatten(0, 1)[pick] @ head.T  # [K, V]
    if objective == "ce":
        return F.nll_loss(log_q, teacher.argmax(-1)) + mse_weight * mse
    log_p = F.log_softmax(teacher, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") + mse_weight * mse


def mean_kl(model: StageModel, corpus: Corpus) -> float:
    """Mean KL(target || model) over every valid position of ``corpus`` (for tests, reports)."""
    head = _head_weight(model)
    total, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(corpus.ids), 8):
            valid = corpus.valid[i : i + 8]
            log_q = F.log_softmax(hidden_states(model, corpus.ids[i : i + 8])[valid] @ head.T, -1)
            log_p = F.log_softmax(corpus.labels[i : i + 8][valid] @ head.T, -1)
            total += float(F.kl_div(log_q, log_p, log_target=True, reduction="sum"))
            count += int(valid.sum())
    return total / max(count, 1)


def _head_weight(model: StageModel) -> Tensor:
    assert model.lm_head is not None
    return model.lm_head.weight.detach()


def _gram(head: Tensor) -> Tensor:
    """``Ec^T Ec / V`` ``[D, D]`` for the centred head ``Ec``: ``d^T G d`` is the mean squared
    change of the centred logits (softmax ignores a shift) when the hidden moves by ``d``."""
    centred = head - head.mean(0, keepdim=True)  # [V, D]
    return centred.T @ centred / head.shape[0]


def _schedule(done: float) -> float:
    if done < 0.05:
        return (done + 0.01) / 0.06
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (done - 0.05) / 0.95))


Run = tuple[list[int], list[int]]
"""A held-out prompt's ids and the target's greedy continuation of it (ending at EOS)."""


def reference_runs(
    target: StageModel,
    tokenizer: Tokenizer,
    *,
    tokens: int = 64,
    prompts: Sequence[tuple[str, str]] = HELD_OUT,
) -> list[Run]:
    """The target's greedy continuation of each ``(kind, text)`` prompt (kind "chat" wraps the
    text in the chat template), up to ``tokens`` tokens or EOS."""
    runs: list[Run] = []
    for kind, text in prompts:
        chat = tokenizer.apply_chat([{"role": "user", "content": text}])
        prompt = tokenizer.encode(chat if kind == "chat" else text)
        ref = ModelProposer(target, max_len=len(prompt) + tokens + 1).propose(prompt, tokens)
        ends = [i for i, t in enumerate(ref) if t in tokenizer.eos_ids]
        runs.append((prompt, ref[: ends[0] + 1] if ends else ref))
    return runs


def measure(
    target: StageModel, draft: StageModel, baseline: StageModel, runs: list[Run]
) -> Measured:
    """Agreement of ``draft``, ``baseline`` and n-gram lookup with ``target`` along ``runs``.

    At each position of each reference, each proposer guesses one token through the ring's
    own proposer API. Costs are milliseconds per decoded token, draft and target timed
    alternately on the first run's prompt.
    """
    positions = sum(len(ref) for _, ref in runs)
    hits, _ = agreement(lambda n: ModelProposer(draft, max_len=n), runs)
    base, _ = agreement(lambda n: ModelProposer(baseline, max_len=n), runs)
    ngram, guessed = agreement(lambda n: NGramProposer(), runs)
    draft_ms, target_ms = _costs(draft, target, runs[0][0])
    return Measured(
        positions=positions,
        alpha=round(hits / positions, 4),
        alpha_truncated=round(base / positions, 4),
        alpha_ngram=round(ngram / max(guessed, 1), 4),
        ngram_coverage=round(guessed / positions, 4),
        draft_ms=round(draft_ms, 2),
        target_ms=round(target_ms, 2),
    )


def agreement(make: Callable[[int], Proposer], runs: list[Run]) -> tuple[int, int]:
    """(correct guesses, guesses) of one-token proposals along each reference."""
    hits = guessed = 0
    for prompt, ref in runs:
        proposer = make(len(prompt) + len(ref) + 1)
        for i, want in enumerate(ref):
            guess = proposer.propose(prompt + ref[:i], 1)
            guessed += bool(guess)
            hits += guess == [want]
    return hits, guessed


def _costs(draft: StageModel, target: StageModel, context: list[int]) -> tuple[float, float]:
    """Median ms per decoded token of ``draft`` and ``target`` (16 tokens, 3 alternations)."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(3):
        for i, model in enumerate((draft, target)):
            proposer = ModelProposer(model, max_len=len(context) + 17)
            proposer.propose(context, 1)  # prefill, not timed
            began = time.perf_counter()
            proposer.propose(context, 16)  # re-feeds the last token: 16 one-token forwards
            times[i].append((time.perf_counter() - began) * 1000 / 16)
    return sorted(times[0])[1], sorted(times[1])[1]
