"""The exact search: which candidates, in which ring order, with the coordinator where.

For every subset S of the candidates, every first stage f and tail l in S and every
coordinator location c, the predicted lap is

    hop(c, f) + shortest path f -> ... -> l through all of S + hop(l, c) + compute(S, f, l)

The shortest Hamiltonian paths come from Held–Karp's dynamic programme over subsets, run once
from each possible first stage (O(2^n · n^3) for n candidates, about a second for 12). The
compute term is the balanced split's total (``split.balanced_counts``); it depends on f and l
only through the embedding and head memory the ends must also hold, so the split of S is
computed once and redone only for the (f, l) where it does not fit. Every term is exact, so
the minimum over everything is the best plan the lap model allows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import attrs

from shard.placement.lap import Mesh, Plan, evaluate
from shard.placement.split import balanced_counts, capacity, ring_split

__all__ = ["Best", "Search"]

_EPS = 1e-9


@attrs.frozen
class Best:
    """A candidate plan, before it is built: subset ``mask``, ends ``first``/``last``
    (indices), coordinator location, and its lap and slowest stage."""

    lap_ms: float
    slowest_ms: float
    mask: int
    first: int
    last: int
    coordinator: str

    def beats(self, other: Best | None) -> bool:
        """Strictly better: a shorter lap, or the same lap with a faster slowest stage."""
        return other is None or _beats(
            self.lap_ms, self.slowest_ms, (other.lap_ms, other.slowest_ms)
        )


def _beats(lap: float, slowest: float, than: tuple[float, float]) -> bool:
    if lap < than[0] - _EPS:
        return True
    return abs(lap - than[0]) <= _EPS and slowest < than[1] - _EPS


class Search:
    """Held–Karp over ``names`` (a subset of the problem's candidates, at most about 12)."""

    def __init__(self, mesh: Mesh, names: Sequence[str]) -> None:
        self.mesh = mesh
        problem = mesh.problem
        self.names = tuple(names)
        self.nodes = tuple(problem.candidate(n) for n in self.names)
        self.n = len(self.names)
        self.times = tuple(c.ms_per_layer_chunk for c in self.nodes)
        self.hop = [[mesh.ms(a, b) for b in self.names] for a in self.names]
        self.firsts = [
            i for i, c in enumerate(self.nodes) if c.trusted or not problem.pin_boundaries
        ]
        self.paths = {f: _held_karp(f, self.hop, self.n) for f in self.firsts}
        model = problem.model
        # capacity at the head of the ring, at its tail, and as its only stage
        self.caps = [
            tuple(
                capacity(c, model, first=a, last=b)
                for a, b in ((True, False), (False, True), (True, True))
            )
            for c in self.nodes
        ]
        self.mids = [capacity(c, model, first=False, last=False) for c in self.nodes]

    def run(self) -> tuple[Best | None, dict[int, Best], dict[str, Best]]:
        """The best candidate plan overall, the best for each ring size, the best for each
        coordinator location (overall and by coordinator: of ``ring_size`` stages, if set)."""
        by_size: dict[int, Best] = {}
        by_coordinator: dict[str, Best] = {}
        coordinators = self.mesh.problem.coordinators
        ends = {
            c: [[self.mesh.ms(c, a) + self.mesh.ms(b, c) for b in self.names] for a in self.names]
            for c in coordinators
        }
        # (lap, slowest) of the current bests, kept as plain floats: this loop is the search
        size_key: dict[int, tuple[float, float]] = {}
        coord_key = {c: (math.inf, math.inf) for c in coordinators}
        fixed = self.mesh.problem.ring_size  # the best must have this size; by_size has all
        for mask, f, t, base, slowest in self._rings():
            size = mask.bit_count()
            for c in coordinators:
                lap = base + ends[c][f][t]
                if (fixed is None or size == fixed) and _beats(lap, slowest, coord_key[c]):
                    coord_key[c] = (lap, slowest)
                    by_coordinator[c] = Best(lap, slowest, mask, f, t, c)
                if _beats(lap, slowest, size_key.get(size, (math.inf, math.inf))):
                    size_key[size] = (lap, slowest)
                    by_size[size] = Best(lap, slowest, mask, f, t, c)
        best: Best | None = None
        for found in by_coordinator.values():  # in coordinator order: the first wins a tie
            if found.beats(best):
                best = found
        return best, by_size, by_coordinator

    def build(self, found: Best, method: str) -> Plan:
        """The full plan for a candidate the search found."""
        order = self.order(found.mask, found.first, found.last)
        counts = self.counts(found.mask, found.first, found.last)
        assert counts is not None  # the search only keeps rings whose split fits
        by_node = dict(zip(self._members(found.mask), counts, strict=True))
        names = [self.names[i] for i in order]
        split = [by_node[i] for i in order]
        problem = self.mesh.problem
        if problem.by_bytes or not problem.model.equal_layers:
            # the search counted every layer as the largest; split this ring by real bytes
            exact = ring_split(
                [self.nodes[i] for i in order], problem.model, by_bytes=problem.by_bytes
            )
            split = list(exact) if exact is not None else split
        return evaluate(self.mesh, found.coordinator, names, split, method)

    def order(self, mask: int, first: int, last: int) -> list[int]:
        """Indices in ring order of the shortest path ``first -> ... -> last`` through mask."""
        _, parent = self.paths[first]
        order = [last]
        while order[-1] != first:
            here = order[-1]
            order.append(parent[mask][here])
            mask ^= 1 << here
        return order[::-1]

    def counts(self, mask: int, first: int, last: int) -> tuple[int, ...] | None:
        """The balanced split of mask's members (index order) with these ends, or None."""
        members = self._members(mask)
        caps = [self._capacity(i, first=i == first, last=i == last) for i in members]
        times = [self.times[i] for i in members]
        return balanced_counts(times, caps, self.mesh.problem.model.n_layers)

    def _capacity(self, i: int, *, first: bool, last: bool) -> int:
        """``capacity`` of node ``i`` at that place in the ring, computed once in ``__init__``
        (this is called for every subset and pair of ends whose memory is tight)."""
        if first or last:
            return self.caps[i][2 if first and last else 0 if first else 1]
        return self.mids[i]

    def _members(self, mask: int) -> list[int]:
        return [i for i in range(self.n) if mask >> i & 1]

    def _rings(self) -> Iterator[tuple[int, int, int, float, float]]:
        """``(mask, first, last, path + compute, slowest stage)`` of every feasible ring."""
        model = self.mesh.problem.model
        mids = self.mids
        for mask in range(1, 1 << self.n):
            members = self._members(mask)
            if len(members) > model.n_layers:
                continue
            counts = balanced_counts(
                [self.times[i] for i in members], [mids[i] for i in members], model.n_layers
            )
            if counts is None:
                continue  # the ends only lower capacities: no ring of mask fits
            count = dict(zip(members, counts, strict=True))
            plain = self._cost(members, counts)
            for f in self.firsts:
                if not mask >> f & 1:
                    continue
                cost = self.paths[f][0][mask]
                for t in self._lasts(members, f):
                    if math.isinf(cost[t]):
                        continue
                    if self._fits(f, t, count[f], count[t]):
                        yield mask, f, t, cost[t] + plain[0], plain[1]
                        continue
                    again = self.counts(mask, f, t)
                    if again is not None:
                        total, slowest = self._cost(members, again)
                        yield mask, f, t, cost[t] + total, slowest

    def _lasts(self, members: list[int], first: int) -> Iterator[int]:
        pinned = self.mesh.problem.pin_boundaries
        for tail in members:
            if (tail == first) != (len(members) == 1):
                continue
            if pinned and not self.nodes[tail].trusted:
                continue
            yield tail

    def _fits(self, first: int, last: int, n_first: int, n_last: int) -> bool:
        if first == last:
            return n_first <= self.caps[first][2]
        return n_first <= self.caps[first][0] and n_last <= self.caps[last][1]

    def _cost(self, members: list[int], counts: Sequence[int]) -> tuple[float, float]:
        stage = [n * self.times[i] for i, n in zip(members, counts, strict=True)]
        return sum(stage), max(stage)


def _held_karp(
    first: int, hop: list[list[float]], n: int
) -> tuple[list[list[float]], list[list[int]]]:
    """``cost[mask][j]``: the shortest path from ``first`` through exactly ``mask`` ending at
    ``j`` (``parent`` the node before ``j``); masks without ``first`` stay infinite."""
    size = 1 << n
    cost = [[math.inf] * n for _ in range(size)]
    parent = [[-1] * n for _ in range(size)]
    cost[1 << first][first] = 0.0
    for mask in range(1 << first, size):
        if not mask >> first & 1:
            continue
        row = cost[mask]
        for j in range(n):
            here = row[j]
            if here == math.inf:
                continue
            out = hop[j]
            for k in range(n):
                if mask >> k & 1:
                    continue
                nxt = mask | 1 << k
                value = here + out[k]
                if value < cost[nxt][k]:
                    cost[nxt][k] = value
                    parent[nxt][k] = j
    return cost, parent
