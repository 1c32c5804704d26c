"""How well a head drafts: chained acceptance on held-out prompts, and what a draft costs.

Both go through the proposer the ring uses (``HeadProposer``: ``observe`` then
``propose``), not through the training forward, so what is measured is what drafting does,
rollback included: the proposer is fed each start's real features in turn and asked to
continue a context its previous drafts have run past.
"""

from __future__ import annotations

import time

import attrs
import torch

from shard.decode.draft import ModelProposer
from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.model import DraftHead
from shard.decode.head.proposer import HeadProposer
from shard.model.llama import StageModel
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT, reference_runs
from shard.training.head.train import reference_features

__all__ = ["DEPTH", "Measured", "chained_acceptance", "costs", "measure_head"]

DEPTH = 4  # drafts per start that acceptance is reported for


@attrs.frozen
class Measured:
    """``alpha[k-1]``: P(draft k is the target's token | drafts 1..k-1 were), over ``starts``
    positions of the held-out continuations (``shard.training.distill.train.HELD_OUT``);
    ``committed[k-1]``: mean tokens one verify of ``k`` drafts commits (accepted + 1);
    ``coverage``: the share of the target's held-out tokens inside the shortlist."""

    prompts: int
    starts: int
    alpha: tuple[float, ...]
    committed: tuple[float, ...]
    coverage: float
    draft_ms: float
    target_ms: float
    cost_ratio: float


def measure_head(target: StageModel, tokenizer: Tokenizer, head: DraftHead) -> Measured:
    """Acceptance along the target's greedy continuations of ``HELD_OUT``, and costs."""
    runs = reference_runs(target, tokenizer, prompts=HELD_OUT)
    refs = reference_features(target, runs)
    starts, alpha, committed = chained_acceptance(head, refs)
    continuation = torch.cat([ids[p:] for ids, _, p in refs])
    coverage = float(torch.isin(continuation, head.shortlist).float().mean())
    draft_ms, target_ms = costs(head, target, refs[0][0][: refs[0][2]].tolist(), refs[0][1])
    return Measured(
        prompts=len(runs),
        starts=starts,
        alpha=alpha,
        committed=committed,
        coverage=round(coverage, 4),
        draft_ms=round(draft_ms, 2),
        target_ms=round(target_ms, 2),
        cost_ratio=round(draft_ms / target_ms, 4),
    )


def chained_acceptance(
    head: DraftHead | Eagle3Head,
    refs: list[tuple[torch.Tensor, torch.Tensor, int]],
    depth: int = DEPTH,
) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(starts, α per draft, committed per K) of ``head`` along ``refs``
    (``train.reference_features``: stream ids, target features, prompt length; for an
    EAGLE-3 head, the states entering its layers in place of the features).

    At each start ``m`` (``x_{m+1}`` in the continuation) one proposer, fed the features up
    to ``m - 1`` (a prompt's last window of them, as the ring sends), drafts ``depth`` tokens
    from ``x_0..x_m``.
    """
    window = head.config.window if isinstance(head, DraftHead) else head.feature_window
    hits, tried = [0] * depth, [0] * depth
    runs = [0] * (depth + 1)
    starts = 0
    for ids, feats, p in refs:
        stream = ids.tolist()
        proposer = HeadProposer(head, max_len=len(stream) + depth + 1)
        first = max(p - 1, 1)
        lo = max(0, first - 1 - window)
        proposer.observe(lo, feats[lo : first - 1])
        for m in range(first, len(stream) - 1):
            if m - 1 >= first - 1:
                proposer.observe(m - 1, feats[m - 1 : m])
            drafts = proposer.propose(stream[: m + 1], depth)
            starts += 1
            right = 0
            for k, token in enumerate(drafts, start=1):
                if m + k >= len(stream):
                    break
                tried[k - 1] += 1
                if token != stream[m + k]:
                    break
                hits[k - 1] += 1
                right = k
            runs[right] += 1
    alpha = tuple(round(h / max(t, 1), 4) for h, t in zip(hits, tried, strict=True))
    committed = tuple(
        round(1 + sum(min(j, k) * runs[j] for j in range(depth + 1)) / max(starts, 1), 3)
        for k in range(1, depth + 1)
    )
    return starts, alpha, committed


def costs(
    head: DraftHead, target: StageModel, context: list[int], features: torch.Tensor
) -> tuple[float, float]:
    """Median ms per drafted token of ``head`` and per decoded token of ``target`` (16
    tokens each, 3 alternations, prefill not timed)."""
    times: dict[str, list[float]] = {"head": [], "target": []}
    n = len(context)
    for _ in range(3):
        proposer = HeadProposer(head, max_len=n + 18)
        proposer.observe(0, features[: n - 1])
        proposer.propose(context, 1)  # catches up on the prompt: prefill, not timed
        began = time.perf_counter()
        proposer.propose(context, 16)
        times["head"].append((time.perf_counter() - began) * 1000 / 16)
        model = ModelProposer(target, max_len=n + 17)
        model.propose(context, 1)
        began = time.perf_counter()
        model.propose(context, 16)
        times["target"].append((time.perf_counter() - began) * 1000 / 16)
    return sorted(times["head"])[1], sorted(times["target"])[1]
