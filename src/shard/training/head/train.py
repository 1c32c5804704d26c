"""Train a ``DraftHead`` on cached target features, and measure its chained acceptance.

The corpus is ``shard.training.distill.data``'s: token rows with the target's feature at every
position (its ``labels``). A step takes ``batch`` rows and, for ``passes`` unrolled passes
(``DraftHead.unrolled``), scores the predicted feature ``g_t`` against the real ``f_{t+1}``:

- cross-entropy over the shortlist readout against the target's greedy token ``x*_{t+2}``
  (``argmax lm_head(f_{t+1})`` over the whole vocabulary, precomputed once per corpus;
  positions whose token is outside the shortlist are left out, since no draft can hit them),
  mixed (``soft``) with the KL divergence from the target's whole distribution over the
  shortlist, which says more per position than its argmax when text is scarce;
- ``reg_weight`` times the smooth-L1 distance of ``g_t`` to ``f_{t+1}`` (EAGLE's feature
  regression; it keeps chained features on the target's manifold).

Pass 1's input features get uniform noise (``noise`` times the features' RMS), as EAGLE
does, so the head tolerates its own slightly-wrong features when it chains.

How well a trained head drafts is measured through its proposer (``measure.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from shard.decode.head.model import DraftHead
from shard.model.llama import StageModel
from shard.training.distill.data import Corpus, hidden_states
from shard.training.distill.train import Run

__all__ = [
    "greedy_targets",
    "head_loss",
    "index_in",
    "lr_at",
    "reference_features",
    "shortlist_from",
]

_LABEL_BATCH = 8  # rows whose full-vocabulary argmax is taken at once


def greedy_targets(target: StageModel, corpus: Corpus) -> Tensor:
    """The target's greedy next token at every position of ``corpus`` ``[N, S]`` (int64):
    ``argmax lm_head(label)``, one full-vocabulary product per position, done once."""
    assert target.lm_head is not None
    w = target.lm_head.weight
    out = torch.empty(corpus.ids.shape, dtype=torch.long)
    with torch.inference_mode():
        for i in range(0, len(corpus.ids), _LABEL_BATCH):
            labels = corpus.labels[i : i + _LABEL_BATCH].to(w.dtype)
            out[i : i + _LABEL_BATCH] = (labels @ w.T).argmax(-1)
    return out


def shortlist_from(greedy: Tensor, valid: Tensor, size: int, always: Sequence[int]) -> Tensor:
    """The ``size`` tokens the target most often predicts greedily in the corpus, ``always``
    (e.g. its stop tokens) among them, sorted by id. Ties go to the lower id."""
    counts = torch.bincount(greedy[valid], minlength=int(greedy.max()) + 1).double()
    for t in always:
        if t < len(counts):
            counts[t] = math.inf
    size = min(size, len(counts))
    top = torch.argsort(-counts, stable=True)[:size]
    return torch.sort(top).values


def index_in(shortlist: Tensor, vocab_size: int) -> Tensor:
    """``[V]`` map from token id to shortlist index (-100 for tokens outside it)."""
    table = torch.full((vocab_size,), -100, dtype=torch.long)
    table[shortlist] = torch.arange(len(shortlist))
    return table


def head_loss(
    head: DraftHead,
    features: Tensor,
    ids: Tensor,
    greedy: Tensor,
    valid: Tensor,
    table: Tensor,
    *,
    passes: int,
    noise: float,
    reg_weight: float,
    generator: torch.Generator,
    ce_positions: int = 0,
    soft: float = 0.0,
) -> tuple[Tensor, list[float]]:
    """The training loss on rows ``features`` ``[B, S, D]``, ``ids``, ``greedy``, ``valid``
    ``[B, S]``, and each pass's top-1 accuracy over the scored positions (for progress).

    Position ``t`` (of ``S - 1``) reads ``f_t`` and ``x_{t+1}`` and is scored against
    ``f_{t+1}`` and the target's token after ``t + 1``; both ``t`` and ``t + 1`` must be real.
    ``ce_positions`` (0: all): positions per pass, drawn at random, that get the readout's
    cross-entropy; the feature regression sees every position.
    """
    f_in, f_next = features[:, :-1], features[:, 1:]  # [B, S-1, D]
    pair = valid[:, :-1] & valid[:, 1:]  # [B, S-1]
    index = table[greedy[:, 1:]].masked_fill(~pair, -100)  # [B, S-1]
    if noise > 0:
        rms = f_in.pow(2).mean().sqrt()
        u = torch.rand(f_in.shape, generator=generator, dtype=f_in.dtype)
        f_in = f_in + (u - 0.5) * (2 * noise * rms)
    outs = head.unrolled(f_in, ids[:, 1:], passes)
    total = features.new_zeros(())
    accuracy: list[float] = []
    for p, g in enumerate(outs, start=1):
        scored = pair.clone()
        scored[:, : p - 1] = False  # no chain of p drafts ends there
        reg = F.smooth_l1_loss(g[scored], f_next[scored])
        idx = index[scored]  # [M]
        where = (idx >= 0).nonzero()[:, 0]
        if ce_positions and len(where) > ce_positions:  # the readout is a step's main cost
            where = where[torch.randperm(len(where), generator=generator)[:ce_positions]]
        logits = head.logits(g[scored][where])  # [M', N]
        ce = F.cross_entropy(logits, idx[where]) if len(where) else logits.sum() * 0
        if soft > 0 and len(where):  # the target's whole (shortlist) distribution as well
            with torch.no_grad():
                teacher = F.log_softmax(head.logits(f_next[scored][where]), dim=-1)
            kl = F.kl_div(
                F.log_softmax(logits, -1), teacher, log_target=True, reduction="batchmean"
            )
            ce = (1 - soft) * ce + soft * kl
        total = total + ce + reg_weight * reg
        with torch.no_grad():
            hit = int((logits.argmax(-1) == idx[where]).sum())
            accuracy.append(hit / max(len(where), 1))
    return total / len(outs), accuracy


def lr_at(done: float, peak: float) -> float:
    """Warm-up over the first 3 %, then cosine to a tenth of ``peak``."""
    if done < 0.03:
        return peak * (done + 0.005) / 0.035
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def reference_features(target: StageModel, runs: list[Run]) -> list[tuple[Tensor, Tensor, int]]:
    """Per run: stream ids ``[L]``, the target's features ``[L, D]``, and the prompt length."""
    out = []
    with torch.inference_mode():
        for prompt, ref in runs:
            ids = torch.tensor([prompt + ref])
            out.append((ids[0], hidden_states(target, ids)[0].float(), len(prompt)))
    return out
