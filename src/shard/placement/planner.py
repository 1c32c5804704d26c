"""``plan(problem)``: the placement with the least predicted lap, and why the others lost.

Exact up to ``EXACT_LIMIT`` candidates (``search.py``), the stated heuristic beyond it
(``heuristic.py``). Every plan covers each layer exactly once, fits each node's memory and,
with ``pin_boundaries``, puts trusted nodes at both ends; when none can, ``PlanError`` says
what is missing. The even split in file order (the spec's ``"auto"``) is always among the
alternatives, so an operator sees what the planner saved; given the ring as written
(``Problem.written``), a tie keeps it: the plan changes a spec's ring only to beat it.
"""

from __future__ import annotations

import attrs

from shard.placement.heuristic import EXACT_LIMIT, chain, pool
from shard.placement.lap import Alternative, Mesh, Plan, evaluate
from shard.placement.problem import PlanError, Problem
from shard.placement.search import Search
from shard.placement.split import auto_counts, capacity, even_counts

__all__ = ["baseline", "compare", "plan"]

_GIB = float(1 << 30)
_EPS = 1e-9


def plan(problem: Problem) -> Plan:
    """The best plan for ``problem``, with the alternatives it beat.

    Errors: ``PlanError`` when no ring of the candidates fits the model (memory, layer count,
    pinning), saying what to add or change."""
    _check_possible(problem)
    mesh = Mesh(problem)
    names = pool(problem)
    if problem.ring_size is not None and problem.ring_size > len(names):
        return _chained(mesh, problem.ring_size)
    method = "exact"
    if len(names) < len(problem.candidates):
        method = f"heuristic: exact among the {len(names)} candidates nearest a coordinator"
    if problem.ring_size is not None:
        method += f", rings of {problem.ring_size} stages only"
    search = Search(mesh, names)
    best, by_size, by_coordinator = search.run()
    if best is None:
        raise PlanError(_why_none(problem, len(names)))
    chosen = search.build(best, method)
    label, even = baseline(mesh)
    alternatives: list[Alternative] = []
    if isinstance(even, str):
        alternatives.append(Alternative(label, None, even))
    elif problem.written and not _better(chosen, even, laps_only=problem.by_bytes):
        chosen = attrs.evolve(even, method=f"{method}; no ring beats the ring as written")
    else:
        alternatives.append(_alternative(label, even, chosen))
    for c, found in by_coordinator.items():
        if c != chosen.coordinator:
            alternatives.append(
                _alternative(f"coordinator at {c}", search.build(found, ""), chosen)
            )
    size = len(chosen.stages)
    for k in (size - 1, size + 1):
        if k in by_size:
            label = f"best ring of {k} stage{'s' if k != 1 else ''}"
            if problem.ring_size is not None:
                label += f" (not taken: the ring keeps {problem.ring_size})"
            alternatives.append(_alternative(label, search.build(by_size[k], ""), chosen))
    return attrs.evolve(chosen, alternatives=tuple(alternatives))


def _chained(mesh: Mesh, size: int) -> Plan:
    """A fixed ring of more than ``EXACT_LIMIT`` stages (``heuristic.chain``), against the
    baseline as ``plan`` weighs it. Errors: ``PlanError`` when the chain does not fit."""
    problem = mesh.problem
    chosen = chain(mesh, size)
    if chosen is None:
        raise PlanError(_why_none(problem, min(size, len(problem.candidates))))
    label, even = baseline(mesh)
    if isinstance(even, str):
        return attrs.evolve(chosen, alternatives=(Alternative(label, None, even),))
    if problem.written and not _better(chosen, even, laps_only=problem.by_bytes):
        return attrs.evolve(even, method=f"{chosen.method}; it does not beat the ring as written")
    return attrs.evolve(chosen, alternatives=(_alternative(label, even, chosen),))


def baseline(mesh: Mesh) -> tuple[str, Plan | str]:
    """The spec's ``"auto"`` in file order over the ring as written (``split.auto_counts``:
    by bytes when the model's layer sizes are known), else the even split over every
    candidate, coordinator at the first location: its label, and its plan or why it is not
    a valid one."""
    problem = mesh.problem
    names = list(problem.written) or [c.name for c in problem.candidates]
    coordinator = problem.coordinators[0]
    by_bytes = bool(problem.written) and problem.model.sizes is not None
    kind = "auto split" if by_bytes else "even split"  # auto: the largest stage's bytes least
    label = f"{kind} in file order ({len(names)} stages, coordinator at {coordinator})"
    if by_bytes:
        counts = auto_counts(problem.model, names)
    else:
        counts = even_counts(len(names), problem.model.n_layers)
    if counts is None:
        return label, f"{len(names)} stages for {problem.model.n_layers} layers"
    first = 0
    for i, (name, n) in enumerate(zip(names, counts, strict=True)):
        node = problem.candidate(name)
        cap = capacity(node, problem.model, first=(i == 0), last=(i == len(names) - 1))
        held = problem.model.sizes_of(name).stage(first, first + n, head_too=i == len(names) - 1)
        first += n
        if n > cap and (problem.model.equal_layers or held > node.memory_bytes):
            return label, f"does not fit: {name} has room for {max(cap, 0)} of its {n} layers"
    if problem.pin_boundaries:
        untrusted = sorted({n for n in (names[0], names[-1]) if not problem.candidate(n).trusted})
        if untrusted:
            return label, f"breaks pinning: {', '.join(untrusted)} not trusted"
    return label, evaluate(mesh, coordinator, names, counts, f"{kind} in file order")


def compare(found: Plan, chosen: Plan) -> str:
    """Why ``found`` lost to ``chosen``, in words: its lap and where the difference is."""
    parts = f"latency {found.latency_ms:.1f} + compute {found.compute_ms:.1f} ms"
    gap = found.lap_ms - chosen.lap_ms
    if abs(gap) <= 1e-9:
        return (
            f"{parts}: same lap, slowest stage {found.slowest_stage_ms:.1f} ms vs "
            f"{chosen.slowest_stage_ms:.1f} ms"
        )
    lat = found.latency_ms - chosen.latency_ms
    comp = found.compute_ms - chosen.compute_ms
    return f"{parts}: {gap:+.1f} ms ({lat:+.1f} latency, {comp:+.1f} compute)"


def _better(found: Plan, than: Plan, *, laps_only: bool = False) -> bool:
    """A shorter lap, or the same lap with a faster slowest stage (the search's order);
    ``laps_only`` (a split by bytes, speeds not measured): a shorter lap only."""
    if found.lap_ms < than.lap_ms - _EPS:
        return True
    return (
        not laps_only
        and abs(found.lap_ms - than.lap_ms) <= _EPS
        and (found.slowest_stage_ms < than.slowest_stage_ms - _EPS)
    )


def _alternative(label: str, found: Plan, chosen: Plan) -> Alternative:
    return Alternative(label, found.lap_ms, compare(found, chosen))


def _check_possible(problem: Problem) -> None:
    """The reasons no plan can exist that are plain before any search, with what to do."""
    model = problem.model
    total = sum(c.memory_bytes for c in problem.candidates)
    if total < model.total_bytes:
        raise PlanError(
            f"the candidates hold {total / _GIB:.1f} GiB of weights in all but the model needs "
            f"{model.total_bytes / _GIB:.1f} GiB ({model.n_layers} layers, embedding and head); "
            "add nodes or memory, or use a smaller dtype"
        )
    if problem.pin_boundaries:
        trusted = [c for c in problem.candidates if c.trusted]
        if not trusted:
            raise PlanError(
                "pin_boundaries needs trusted nodes for the first block (embedding) and the "
                "last (head), but no candidate is trusted; mark nodes trusted or unpin"
            )


def _why_none(problem: Problem, searched: int) -> str:
    model = problem.model
    limit = (
        ""
        if searched == len(problem.candidates)
        else (
            f" among the {searched} candidates the heuristic keeps (>{EXACT_LIMIT} needs more: "
            "give fewer, larger nodes)"
        )
    )
    if problem.pin_boundaries:
        trusted = [c.name for c in problem.candidates if c.trusted]
        return (
            f"no ring fits {model.n_layers} layers{limit} with trusted nodes at both ends "
            f"(trusted: {', '.join(trusted)}); the first must also hold the embedding "
            f"({model.embedding_bytes / _GIB:.2f} GiB) and the last the head "
            f"({model.head_bytes / _GIB:.2f} GiB): trust more nodes, add memory to these, or "
            "unpin"
        )
    if problem.ring_size is not None:
        limit += f" with exactly {problem.ring_size} stages"
    return (
        f"no ring of the candidates fits {model.n_layers} layers{limit}: each stage needs room "
        "for at least one layer, the first also for the embedding and the last for the head; "
        "add nodes or memory"
    )
