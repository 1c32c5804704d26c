"""Beyond ``EXACT_LIMIT`` candidates: which of them the exact search looks at.

The heuristic, stated: rank the candidates by their round trip to the nearest coordinator
location (ties in file order) and search exactly among the ``EXACT_LIMIT`` nearest; with
``pin_boundaries`` the two nearest trusted nodes are always among them. The candidates left
out become standbys. It finds the best ring inside the pool, not necessarily the best overall:
a far node that is much faster, or a ring that needs more than ``EXACT_LIMIT`` stages, is
never considered (a ring that does not fit the pool's memory is a ``PlanError`` saying so).
"""

from __future__ import annotations

from shard.placement.problem import Problem

__all__ = ["EXACT_LIMIT", "pool"]

#: The most candidates the exact search takes (Held–Karp: 2^n · n^3 steps).
EXACT_LIMIT = 12


def pool(problem: Problem, limit: int = EXACT_LIMIT) -> tuple[str, ...]:
    """The names the exact search considers, in file order: all of them up to ``limit``,
    else the ``limit`` nearest to a coordinator location (trusted ones kept when pinned)."""
    names = [c.name for c in problem.candidates]
    if len(names) <= limit:
        return tuple(names)

    def distance(name: str) -> float:
        return min(
            problem.rtt.rtt(c, name) + problem.rtt.rtt(name, c) for c in problem.coordinators
        )

    order = {n: i for i, n in enumerate(names)}  # ties in file order (not names.index: N^2)
    ranked = sorted(names, key=lambda n: (distance(n), order[n]))
    keep: list[str] = []
    if problem.pin_boundaries:
        keep = [n for n in ranked if problem.candidate(n).trusted][:2]
    for name in ranked:
        if len(keep) >= limit:
            break
        if name not in keep:
            keep.append(name)
    chosen = set(keep)
    return tuple(n for n in names if n in chosen)
