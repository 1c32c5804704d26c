"""Beyond ``EXACT_LIMIT`` candidates: which of them the exact search looks at.

The heuristic, stated: rank the candidates by their round trip to the nearest coordinator
location (ties in file order) and search exactly among the ``EXACT_LIMIT`` nearest; with
``pin_boundaries`` the two nearest trusted nodes are always among them. The candidates left
out become standbys. It finds the best ring inside the pool, not necessarily the best overall:
a far node that is much faster is never considered (a ring that does not fit the pool's
memory is a ``PlanError`` saying so).

A ring of more than ``EXACT_LIMIT`` stages (a spec's or a formation's fixed ``ring_size``) is
past the exact search: ``chain`` builds it from the ``ring_size`` nodes nearest a coordinator
location, each next stage the nearest node left (nearest neighbour; with ``pin_boundaries``
the two nearest trusted nodes at the ends), its layers split as the search splits its rings.
It is a good ring, not the best one.
"""

from __future__ import annotations

from shard.placement.lap import Mesh, Plan, evaluate
from shard.placement.problem import Problem
from shard.placement.split import ring_split

__all__ = ["EXACT_LIMIT", "chain", "pool"]

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


def chain(mesh: Mesh, size: int) -> Plan | None:
    """A ring of ``size`` stages (see the module docstring): the best lap over the
    coordinator locations; None when its nodes cannot hold the model."""
    problem = mesh.problem
    names = list(pool(problem, limit=size))
    if len(names) < size:
        return None
    ends: list[str] = []
    if problem.pin_boundaries:
        ends = [n for n in names if problem.candidate(n).trusted][:2]
        if len(ends) < min(2, size):
            return None
    best: Plan | None = None
    for coordinator in problem.coordinators:
        order = _nearest_first(mesh, coordinator, names, ends)
        counts = ring_split(
            [problem.candidate(n) for n in order], problem.model, by_bytes=problem.by_bytes
        )
        if counts is None:
            continue
        found = evaluate(
            mesh, coordinator, order, counts,
            f"heuristic: a chain of the {size} candidates nearest a coordinator, each next "
            f"stage the nearest left (more than the exact search's {EXACT_LIMIT} stages)",
        )  # fmt: skip
        if best is None or found.lap_ms < best.lap_ms:
            best = found
    return best


def _nearest_first(mesh: Mesh, coordinator: str, names: list[str], ends: list[str]) -> list[str]:
    """``names`` in nearest-neighbour order from ``coordinator`` (``ends``: the first and the
    last stage, fixed)."""
    left = [n for n in names if n not in ends]
    order = ends[:1]
    here = order[0] if order else coordinator
    while left:
        here = min(left, key=lambda n: mesh.ms(here, n))  # ties: the earlier in file order
        left.remove(here)
        order.append(here)
    return order + ends[1:]
