"""Cutting the model's layers into one contiguous block per stage.

``balanced_counts`` gives each stage a number of layers so that the slowest stage (layers ×
its ms per layer) is as fast as it can be, within each node's memory: faster nodes take more
layers. Pipelined decoding runs at the pace of the slowest stage, so this is its objective;
among the splits that reach it, the one with the least total compute (the lap's share) wins.
``even_counts`` is the spec's ``"auto"`` split, the baseline the planner is compared with.
``byte_split`` (and ``byte_counts``, its one-format form) cuts layers of unequal sizes (a
mixture-of-experts model's dense first layers, Gemma's embedding that outweighs half its
layers) so that the largest stage, its embedding or head included, holds as few bytes as any
contiguous split can: the spec's ``"auto"`` and ``shard plan --config``. ``ring_split`` is
the split of a chosen ring whose layers differ in size: by bytes, or (measured speeds) the
slowest stage as fast as each node's memory, counted layer by layer, allows. All three are
``contiguous_counts``: exact, by dynamic programming.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from shard.placement.problem import Candidate, ModelFacts, Sizes

__all__ = [
    "auto_counts",
    "balanced_counts",
    "blocks_of",
    "byte_counts",
    "byte_split",
    "capacity",
    "contiguous_counts",
    "even_counts",
    "ring_split",
    "stage_bytes",
]

#: A stage's cost: ``cost(stage, first, last)`` for layers ``[first, last)``; None: it
#: cannot hold them (memory).
Cost = Callable[[int, int, int], float | None]

_SLACK = 1e-9  # relative: n * t <= M must survive float rounding of M = n * t


def capacity(node: Candidate, model: ModelFacts, *, first: bool, last: bool) -> int:
    """How many layers ``node`` can hold at this position of the ring (the first stage also
    holds the embedding, the last the head); below 1 means it cannot stand there at all.
    Layers of unequal sizes count as the largest (``ring_split`` then splits by the real
    ones, so a ring this admits always fits)."""
    sizes = model.sizes_of(node.name)
    extra = (sizes.embedding if first else 0) + (sizes.head if last else 0)
    free = node.memory_bytes - extra
    if free < 0:
        return -1
    largest = max(sizes.layers)
    if largest == 0:
        return model.n_layers
    return min(model.n_layers, free // largest)


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


def auto_counts(model: ModelFacts, names: Sequence[str]) -> tuple[int, ...] | None:
    """The spec's ``"auto"`` split of the ring ``names`` (in order): by bytes
    (``byte_split``, each node's format) when the model's layer sizes are known, else the
    even split. ``SwarmSpec.blocks``, the planner's baseline and ``shard plan --config`` all
    cut with this one function."""
    if model.sizes is None:
        return even_counts(len(names), model.n_layers)
    return byte_split([model.sizes_of(n) for n in names])


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
    """``byte_split`` with every stage holding the same format: layers of ``sizes``, the
    ``embedding`` on the first stage and the ``head`` on the last (one stage holds both)."""
    if not sizes:
        return None
    return byte_split([Sizes(tuple(sizes), embedding, head)] * n_stages)


def byte_split(
    stages: Sequence[Sizes], memory: Sequence[int] | None = None
) -> tuple[int, ...] | None:
    """Layers per stage (each >= 1, in ring order; ``stages[i]`` the bytes as stage ``i``
    holds them) whose largest stage holds the fewest bytes, the embedding counted on the
    first and the head on the last; each stage within ``memory[i]`` when given. Among splits
    that reach it, the one nearest to equal layer counts, then the earliest stages largest.
    None when no split fits."""
    n = len(stages[0].layers) if stages else 0
    sums = [_prefix(s.layers) for s in stages]

    def held(i: int, first: int, last: int) -> float | None:
        found = _held(stages[i], sums[i], first, last, len(stages))
        return None if memory is not None and found > memory[i] else found

    return contiguous_counts(len(stages), n, held)


def ring_split(
    nodes: Sequence[Candidate], model: ModelFacts, *, by_bytes: bool
) -> tuple[int, ...] | None:
    """Layers per stage of the ring ``nodes`` (in ring order), each within its memory with
    its layers' real bytes (``model.sizes_of``): by bytes (``byte_split``), or the slowest
    stage (layers × ms per layer) as fast as possible, then the least total compute. None
    when no split fits."""
    stages = [model.sizes_of(c.name) for c in nodes]
    memory = [c.memory_bytes for c in nodes]
    if by_bytes:
        return byte_split(stages, memory)
    sums = [_prefix(s.layers) for s in stages]

    def time(i: int, first: int, last: int) -> float | None:
        if _held(stages[i], sums[i], first, last, len(nodes)) > memory[i]:
            return None
        return (last - first) * nodes[i].ms_per_layer_chunk

    return contiguous_counts(len(nodes), model.n_layers, time, total=time)


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _held(sizes: Sizes, prefix: Sequence[int], first: int, last: int, n_stages: int) -> int:
    """Bytes stage ``[first, last)`` holds (``Sizes.stage`` with prefix sums)."""
    total = prefix[last] - prefix[first]
    if first == 0:
        total += sizes.embedding
    if last == len(sizes.layers):
        if first == 0 and n_stages == 1:
            total += sizes.head if sizes.shared_head is None else sizes.shared_head
        else:
            total += sizes.head
    return total


def contiguous_counts(
    n_stages: int, n_layers: int, worst: Cost, *, total: Cost | None = None
) -> tuple[int, ...] | None:
    """Layers per stage (each >= 1, in order, summing to ``n_layers``) whose largest
    ``worst`` cost is least; among those, the least sum of ``total``, then the least sum of
    squared counts (nearest to equal), then the earliest stages largest. None when
    ``n_stages`` is not in ``[1, n_layers]`` or no split has every cost defined.

    Exact: a first dynamic programme over (stages used, layers taken) finds the least
    largest cost M; a second, keeping every stage within M, minimises the sums (additive,
    so a programme is exact for them) and breaks the last ties by the counts themselves.
    O(stages × layers²) cost calls each.
    """
    if not 1 <= n_stages <= n_layers:
        return None
    spans = _spans(n_stages, n_layers)
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for i, first, last in spans:
        if best[i][first] < math.inf and (c := worst(i, first, last)) is not None:
            best[i + 1][last] = min(best[i + 1][last], max(best[i][first], c))
    limit = best[n_stages][n_layers]
    if limit == math.inf:
        return None
    # keys[i][j]: (sum of total, sum of squares, -counts) over stages 0..i-1 holding [0, j)
    Key = tuple[float, int, tuple[int, ...]]
    keys: list[dict[int, Key]] = [{} for _ in range(n_stages + 1)]
    keys[0][0] = (0.0, 0, ())
    for i, first, last in spans:
        here = keys[i].get(first)
        c = worst(i, first, last) if here is not None else None
        if here is None or c is None or c > limit:
            continue
        add = (total(i, first, last) or 0.0) if total is not None else 0.0
        count = last - first
        key = (here[0] + add, here[1] + count * count, (*here[2], -count))
        if last not in keys[i + 1] or key < keys[i + 1][last]:
            keys[i + 1][last] = key
    return tuple(-c for c in keys[n_stages][n_layers][2])


def _spans(n_stages: int, n_layers: int) -> list[tuple[int, int, int]]:
    """Every (stage, first, last) a split can use, stage by stage, leaving each later stage
    at least one layer."""
    out = []
    for i in range(n_stages):
        for first in range(i, n_layers - (n_stages - i) + 1):
            for last in range(first + 1, n_layers - (n_stages - i - 1) + 1):
                out.append((i, first, last))
    return out
