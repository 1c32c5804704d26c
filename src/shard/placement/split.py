"""Cutting the model's layers into one contiguous block per stage.

``balanced_counts`` gives each stage a number of layers so that the slowest stage (layers ×
its ms per layer) is as fast as it can be, within each node's memory: faster nodes take more
layers. Pipelined decoding runs at the pace of the slowest stage, so this is its objective;
among the splits that reach it, the one with the least total compute (the lap's share) wins.
``even_counts`` is the spec's ``"auto"`` split, the baseline the planner is compared with.
``byte_counts`` cuts layers of unequal sizes (a mixture-of-experts model's dense first
layers, Gemma's embedding that outweighs half its layers) so that the largest stage, its
embedding or head included, holds as few bytes as any contiguous split can.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from shard.placement.problem import Candidate, ModelFacts

__all__ = ["balanced_counts", "blocks_of", "byte_counts", "capacity", "even_counts", "stage_bytes"]

_SLACK = 1e-9  # relative: n * t <= M must survive float rounding of M = n * t


def capacity(node: Candidate, model: ModelFacts, *, first: bool, last: bool) -> int:
    """How many layers ``node`` can hold at this position of the ring (the first stage also
    holds the embedding, the last the head); below 1 means it cannot stand there at all."""
    extra = (model.embedding_bytes if first else 0) + (model.head_bytes if last else 0)
    free = node.memory_bytes - extra
    if free < 0:
        return -1
    if model.layer_bytes == 0:
        return model.n_layers
    return min(model.n_layers, free // model.layer_bytes)


def balanced_counts(
    times: Sequence[float], caps: Sequence[int], n_layers: int
) -> tuple[int, ...] | None:
    """Layers per stage (each >= 1, within ``caps``, summing to ``n_layers``) minimising the
    slowest stage ``max(count × time)``, then the total ``sum(count × time)``; None when no
    split fits.

    Greedy: every stage starts with one layer and each further layer goes where it makes the
    smallest new stage time, which reaches the least possible maximum M. Then, keeping every
    stage within M, the layers are handed out again cheapest node first, which gives the least
    total among the splits that reach M.
    """
    m = len(times)
    if m == 0 or m > n_layers or any(c < 1 for c in caps) or sum(caps) < n_layers:
        return None
    counts = [1] * m
    heap = [((2 * t), t, i) for i, t in enumerate(times) if caps[i] > 1]
    heapq.heapify(heap)
    for _ in range(n_layers - m):
        _, t, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, ((counts[i] + 1) * t, t, i))
    worst = max(c * t for c, t in zip(counts, times, strict=True))
    upper = [max(counts[i], _most_within(times[i], worst, caps[i])) for i in range(m)]
    refill = [1] * m
    left = n_layers - m
    for i in sorted(range(m), key=lambda i: (times[i], i)):
        take = min(left, upper[i] - 1)
        refill[i] += take
        left -= take
    return tuple(refill)


def _most_within(time: float, limit: float, cap: int) -> int:
    """The most layers a node of ``time`` ms per layer can take staying within ``limit``."""
    bound = limit * (1 + _SLACK)
    n = int(bound // time)
    while (n + 1) * time <= bound:
        n += 1
    while n > 0 and n * time > bound:
        n -= 1
    return min(n, cap)


def even_counts(n_stages: int, n_layers: int) -> tuple[int, ...] | None:
    """The spec's ``"auto"`` split: equal blocks, the remainder to the earliest stages."""
    if not 1 <= n_stages <= n_layers:
        return None
    size, extra = divmod(n_layers, n_stages)
    return tuple(size + (1 if i < extra else 0) for i in range(n_stages))


def blocks_of(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``[first, last)`` of each block, in ring order, from the layer counts."""
    blocks = []
    first = 0
    for n in counts:
        blocks.append((first, first + n))
        first += n
    return tuple(blocks)


def stage_bytes(
    sizes: Sequence[int], counts: Sequence[int], *, embedding: int, head: int
) -> tuple[int, ...]:
    """Bytes each stage holds: its layers' ``sizes``, the first stage also the ``embedding``
    and the last the ``head`` (one stage holds both)."""
    out = []
    for i, (first, last) in enumerate(blocks_of(counts)):
        extra = (embedding if i == 0 else 0) + (head if i == len(counts) - 1 else 0)
        out.append(sum(sizes[first:last]) + extra)
    return tuple(out)


def byte_counts(
    sizes: Sequence[int], n_stages: int, *, embedding: int, head: int
) -> tuple[int, ...] | None:
    """Layers per stage (each >= 1, in order) whose largest stage holds the fewest bytes
    (``stage_bytes``); among splits that reach it, the one nearest to equal layer counts
    (least sum of squared counts), then the earliest stages largest. None when
    ``n_stages`` is not in ``[1, len(sizes)]``.

    Exact, by dynamic programming over (stages used, layers taken): O(stages × layers²),
    nothing for the ring sizes and layer counts models have.
    """
    n = len(sizes)
    if not 1 <= n_stages <= n:
        return None
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def cost(i: int, first: int, last: int) -> int:
        extra = (embedding if i == 0 else 0) + (head if i == n_stages - 1 else 0)
        return prefix[last] - prefix[first] + extra

    # best[i][j]: (largest stage, sum of squared counts, -counts) over stages 0..i-1 holding
    # layers [0, j); the last element of the key makes earlier stages larger on a full tie.
    Key = tuple[int, int, tuple[int, ...]]
    best: list[dict[int, Key]] = [{0: (0, 0, ())}]
    for i in range(n_stages):
        row: dict[int, Key] = {}
        for j, (worst, squares, negs) in best[i].items():
            left_after = n_stages - i - 1
            for last in range(j + 1, n - left_after + 1):
                count = last - j
                key = (max(worst, cost(i, j, last)), squares + count * count, (*negs, -count))
                if last not in row or key < row[last]:
                    row[last] = key
        best.append(row)
    return tuple(-c for c in best[n_stages][n][2])
