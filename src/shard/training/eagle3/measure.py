"""How well an EAGLE-3 head drafts: chained acceptance along the target's own greedy
continuations of held-out prompts, through ``HeadProposer`` exactly as the coordinator runs
it, fed the target's states at every committed position."""

from __future__ import annotations

from torch import Tensor

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.proposer import HeadProposer

__all__ = ["chained_acceptance"]


def chained_acceptance(
    head: Eagle3Head, refs: list[tuple[Tensor, Tensor, int]], depth: int = 4
) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(starts, alpha per draft, tokens committed per verify of K = 1..depth) along ``refs``:
    each the stream's ids ``[L]``, the target's states ``[L, F]`` and the prompt's length.

    At each start ``m`` of the continuation, a proposer that has observed the states up to
    ``m - 1`` drafts ``depth`` tokens after ``x_0..x_m``: ``x_m`` is the token the target
    just committed, whose states the ring has not computed yet.
    """
    hits, tried, runs, starts = [0] * depth, [0] * depth, [0] * (depth + 1), 0
    for ids, states, p in refs:
        stream = ids.tolist()
        proposer = HeadProposer(head, max_len=len(stream) + depth + 1)
        proposer.observe(0, states[: p - 1])
        for m in range(p, len(stream) - 1):
            proposer.observe(m - 1, states[m - 1 : m])
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
