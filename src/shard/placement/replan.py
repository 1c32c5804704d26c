"""``replan(previous, dead, problem)``: the plan after a node dies, moving the fewest layers.

Sticky, never a reshuffle: every surviving stage keeps its block, and only the dead stage's
layers move — to one standby that takes the whole block in its place, or to its two
neighbours in the ring (the predecessor takes the front of the block, the successor the rest;
at an end of the ring the one neighbour takes it all). Among those, the least predicted lap
wins (a standby on a tie: it disturbs no running stage). A dead standby just leaves the
list; a dead coordinator location moves the coordinator to the best other one (no layer
moves). The fresh plan from scratch is listed among the alternatives, so an operator sees
what stickiness costs.
"""

from __future__ import annotations

import attrs

from shard.placement.lap import Alternative, Mesh, Plan, evaluate
from shard.placement.planner import compare, plan
from shard.placement.problem import PlanError, Problem
from shard.placement.split import capacity

__all__ = ["moved_layers", "replan"]


def replan(previous: Plan, dead: str, problem: Problem, *, neighbours: bool = True) -> Plan:
    """The plan after ``dead`` (a stage, a standby or the coordinator's place) is lost.
    ``neighbours`` False considers standbys only (the live scheduler: a running stage cannot
    yet grow its block).

    Errors: ``PlanError`` when no standby can take the dead stage's block and its neighbours
    cannot absorb it (memory or pinning), or no coordinator location is left."""
    known = {*(s.node for s in previous.stages), *previous.standbys, previous.coordinator}
    if dead not in known:
        raise PlanError(f"{dead!r} is not part of the plan (ring {' -> '.join(previous.ring())})")
    survivors = tuple(c for c in problem.candidates if c.name != dead)
    coordinators = tuple(c for c in problem.coordinators if c != dead)
    if not coordinators:
        raise PlanError(f"{dead} was the only coordinator location; name another one")
    if not survivors:
        raise PlanError(f"{dead} was the only candidate node; add nodes to re-form the ring")
    rest = attrs.evolve(problem, candidates=survivors, coordinators=coordinators)
    mesh = Mesh(rest)
    options = _options(mesh, previous, dead, neighbours)
    if not options:
        raise PlanError(_why_stuck(previous, dead, neighbours))
    best = options[0]
    for option in options[1:]:
        if _better(option, best):
            best = option
    lost = [o for o in options if o is not best]
    alternatives = [Alternative(o.method, o.lap_ms, compare(o, best)) for o in lost]
    try:
        fresh = plan(rest)
    except PlanError as e:
        alternatives.append(Alternative("a fresh plan", None, str(e)))
    else:
        moved = moved_layers(previous, fresh)
        why = f"moves {moved} layers: {compare(fresh, best)}"
        alternatives.append(Alternative("a fresh plan", fresh.lap_ms, why))
    return attrs.evolve(best, alternatives=tuple(alternatives))


def moved_layers(before: Plan, after: Plan) -> int:
    """How many layers are held by a different node ``after`` than ``before``."""
    old = _holders(before)
    new = _holders(after)
    return sum(1 for a, b in zip(old, new, strict=True) if a != b)


def _holders(p: Plan) -> list[str]:
    return [s.node for s in p.stages for _ in range(s.first, s.last)]


def _better(a: Plan, b: Plan) -> bool:
    if a.lap_ms < b.lap_ms - 1e-9:
        return True
    return abs(a.lap_ms - b.lap_ms) <= 1e-9 and a.slowest_stage_ms < b.slowest_stage_ms - 1e-9


def _options(mesh: Mesh, previous: Plan, dead: str, neighbours: bool) -> list[Plan]:
    order = [s.node for s in previous.stages]
    counts = [s.layers for s in previous.stages]
    if dead not in order:
        coordinators = [previous.coordinator]
        if dead == previous.coordinator:
            coordinators = list(mesh.problem.coordinators)
        method = f"{dead} lost: the ring unchanged"
        return [
            evaluate(mesh, c, order, counts, f"{method}, coordinator at {c}") for c in coordinators
        ]
    i = order.index(dead)
    # the coordinator stays, unless it ran on the dead node: then every other place is tried
    places = [previous.coordinator]
    if previous.coordinator == dead:
        places = list(mesh.problem.coordinators)
    found = []
    for coordinator in places:
        for standby in previous.standbys:
            if standby == dead or not _fits(mesh, standby, i, len(order), counts[i]):
                continue
            swapped = [*order[:i], standby, *order[i + 1 :]]
            method = f"{dead} died: standby {standby} takes layers {_span(previous, i)}"
            found.append(evaluate(mesh, coordinator, swapped, counts, method))
        if neighbours:
            found += _absorbed(mesh, previous, i, coordinator)
    return found


def _absorbed(mesh: Mesh, previous: Plan, i: int, coordinator: str) -> list[Plan]:
    """The dead stage ``i``'s block split between its neighbours, every feasible cut."""
    order = [s.node for s in previous.stages]
    counts = [s.layers for s in previous.stages]
    if len(order) < 2:
        return []
    dead, n = order[i], counts[i]
    rest = [*order[:i], *order[i + 1 :]]
    cuts = range(n + 1)
    if i == 0:
        cuts = range(1)  # the successor takes it all
    elif i == len(order) - 1:
        cuts = range(n, n + 1)  # the predecessor takes it all
    found = []
    for front in cuts:
        new = [*counts[:i], *counts[i + 1 :]]
        if i > 0:
            new[i - 1] += front
        if i < len(order) - 1:
            new[i] += n - front
        if all(_fits(mesh, name, j, len(rest), new[j]) for j, name in enumerate(rest)):
            method = f"{dead} died: neighbours absorb layers {_span(previous, i)}"
            if 0 < i < len(order) - 1:
                method += f" ({rest[i - 1]} {front}, {rest[i]} {n - front})"
            found.append(evaluate(mesh, coordinator, rest, new, method))
    return found


def _fits(mesh: Mesh, name: str, index: int, size: int, layers: int) -> bool:
    problem = mesh.problem
    node = problem.candidate(name)
    ends = index in (0, size - 1)
    if problem.pin_boundaries and ends and not node.trusted:
        return False
    return layers <= capacity(node, problem.model, first=index == 0, last=index == size - 1)


def _span(previous: Plan, i: int) -> str:
    s = previous.stages[i]
    return f"[{s.first}, {s.last})"


def _why_stuck(previous: Plan, dead: str, neighbours: bool) -> str:
    i = [s.node for s in previous.stages].index(dead)
    block = _span(previous, i)
    absorb = "its neighbours cannot absorb them" if neighbours else "standbys only were asked"
    return (
        f"no standby can take {dead}'s layers {block} and {absorb} "
        "(memory, or pinning at an end of the ring); add a standby with room for "
        f"{previous.stages[i].layers} layers"
    )
