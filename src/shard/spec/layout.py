"""A spec's ring as the planner runs it: the spec as a ``placement.Problem``, the layout its
plan gives (ring order, blocks, standbys), and that layout applied to the spec.

``shard plan SPEC`` prints ``plan(problem_of(spec, ...))``; ``shard swarm up|run SPEC`` plan
the same problem and run ``decide``'s layout, so both say the same thing. The candidates are
the spec's stages and standbys (auditors aside). A node the geography (``--rtt``) does not
profile is assumed as fast as every other, with room for the spec's largest block and the
embedding and head, untrusted; when no node is profiled the plan keeps the spec's number of
stages (``Problem.ring_size``): assumed speeds and memory are no reason to drop a stage.
Without a geography the latencies are the spec's ``[links]``: a hop's override, else the
default (so every pair the spec does not name, too).

The layout is applied only when the plan beats the ring as written (every stage ``"auto"``,
file order, the spec's ``"auto"`` split, coordinator as given): a shorter predicted lap, or,
when some node's speed is measured (an ``--rtt`` profile), the same lap with a faster
slowest stage. ``"auto"`` splits by bytes (``SwarmSpec.blocks`` with the model's sizes): with
no speed measured (``Problem.by_bytes``) the plan splits any ring that way too. A tie keeps
the ring as written (``Problem.written``), so a spec with uniform links runs as written.
Never applied: explicit blocks (the operator's pin), a ``[formation]`` spec (its scheduler
places joined nodes), a plan that would move a node that ``[[faults]]``, ``[fetch]`` or an
auditor names between the ring and the standbys, and ``--as-written``. A spec cannot move
its coordinator: the layout is the best plan with the coordinator where the spec puts it,
and the decision says what moving it would give.

Every node of the swarm must run the same layout: ``shard swarm up`` passes it to each
node it starts as ``shard up --layout NAME=FIRST:LAST,...`` (``Layout.parse``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from shard.placement import (
    Candidate,
    Geography,
    ModelFacts,
    Plan,
    PlanError,
    Problem,
    RttMatrix,
    plan,
)
from shard.spec.nodes import EdgeSpec, StageSpec, StandbySpec
from shard.spec.swarm import SpecError, SwarmSpec
from shard.spec.validate import Block, check_tiling

__all__ = [
    "ASSUMED_MS_PER_LAYER",
    "Decision",
    "Layout",
    "apply_layout",
    "decide",
    "problem_of",
    "spec_rtt",
    "with_links",
]

#: What an unprofiled node is assumed to take per layer (ms): only its equality matters.
ASSUMED_MS_PER_LAYER = 1.0


@attrs.frozen
class Layout:
    """The ring a swarm runs: its stages in ring order with their blocks ``[first, last)``.
    The spec's other stages and standbys (auditors aside) stand by."""

    stages: tuple[tuple[str, Block], ...]

    @classmethod
    def of_plan(cls, found: Plan) -> Layout:
        """The ring order and blocks of a plan."""
        return cls(tuple((s.node, (s.first, s.last)) for s in found.stages))

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"s1=0:10,s0=10:30"`` (what ``str()`` writes). Errors: ``ValueError``."""
        stages = []
        for part in text.split(","):
            name, sep, block = part.strip().partition("=")
            first, colon, last = block.partition(":")
            if not (sep and colon and name and first.isdigit() and last.isdigit()):
                raise ValueError(f"{part!r} is not NAME=FIRST:LAST; e.g. s0=0:10,s1=10:30")
            stages.append((name, (int(first), int(last))))
        return cls(tuple(stages))

    def names(self) -> tuple[str, ...]:
        """The stages' names in ring order."""
        return tuple(name for name, _ in self.stages)

    def __str__(self) -> str:
        return ",".join(f"{name}={a}:{b}" for name, (a, b) in self.stages)


@attrs.frozen
class Decision:
    """What ``swarm up`` runs: ``layout`` (None: the spec as written) and why, in words."""

    layout: Layout | None
    why: str

    def line(self) -> str:
        """The line ``shard plan SPEC`` and ``swarm up`` print under the plan."""
        if self.layout is None:
            return f"swarm up:    the spec as written ({self.why})"
        return f"swarm up:    --layout {self.layout} ({self.why})"


def problem_of(
    spec: SwarmSpec,
    model: ModelFacts,
    geography: Geography | None = None,
    *,
    rtt_source: str = "--rtt",
) -> tuple[Problem, tuple[str, ...]]:
    """``spec`` as a placement problem, and what was assumed (one line each).

    Errors: ``SpecError`` for blocks that do not fit the model, ``PlanError`` for a
    geography that lacks the spec's nodes (``rtt_source`` names it)."""
    assumed: list[str] = []
    names = [s.name for s in spec.stages] + [s.name for s in spec.standbys if s.role != "auditor"]
    unprofiled = [n for n in names if geography is None or geography.node(n) is None]
    blocks = spec.blocks(model.n_layers, model)
    largest = max(last - first for first, last in blocks)
    stages = [s.name for s in spec.stages]
    heaviest = max(model.sizes_of(n).stage(a, b) for n, (a, b) in zip(stages, blocks, strict=True))
    ends = model.embedding_bytes + model.head_bytes
    room = max(largest * model.layer_bytes, heaviest) + ends
    if unprofiled:
        assumed.append(
            f"{', '.join(unprofiled)}: {ASSUMED_MS_PER_LAYER} ms per layer (equal speeds), room "
            f"for the spec's largest block ({largest} layers) with the embedding and head, "
            "untrusted; give [[node]] profiles in an --rtt file"
        )
    ring_size = len(spec.stages) if len(unprofiled) == len(names) else None
    if ring_size is not None:
        assumed.append(
            f"no node is profiled: the ring keeps the spec's {ring_size} stages (the plan may "
            "reorder them and swap in standbys)"
        )
    candidates = tuple(_candidate(n, geography, room) for n in names)
    coordinators: tuple[str, ...] = (spec.coordinator.name,)
    if geography is None:
        rtt = spec_rtt(spec)
        assumed.append(
            "latencies from the spec's [links] (one way; a hop without an override has the "
            f"default {spec.default_latency_ms} ms, and so does every pair not in its ring)"
        )
    else:
        rtt = geography.rtt
        missing = [n for n in (spec.coordinator.name, *names) if not rtt.has(n)]
        if missing:
            raise PlanError(
                f"{rtt_source}: rtt.nodes has no {', '.join(missing)} (nodes of {spec.source}); "
                "add their rows and columns"
            )
        coordinators += tuple(c for c in geography.coordinators if c != spec.coordinator.name)
        if geography.model is not None:
            assumed.append(f"the model is {spec.source}'s, not the [model] of {rtt_source}")
    problem = Problem(
        candidates,
        rtt,
        model,
        coordinators,
        geography.pin_boundaries if geography else False,
        written=tuple(s.name for s in spec.stages),
        ring_size=ring_size,
        by_bytes=ring_size is not None and model.sizes is not None,
    )
    return problem, tuple(assumed)


def _candidate(name: str, geography: Geography | None, room: int) -> Candidate:
    found = geography.node(name) if geography is not None else None
    if found is not None:
        return found
    return Candidate(name, room, ASSUMED_MS_PER_LAYER, ASSUMED_MS_PER_LAYER)


def spec_rtt(spec: SwarmSpec) -> RttMatrix:
    """Round trips from the spec's one-way link latencies: twice the hop's (or the default)."""
    names = [
        spec.coordinator.name,
        *(s.name for s in spec.stages),
        *(s.name for s in spec.standbys),
    ]
    overrides = {(e.src, e.dst): e.latency_ms for e in spec.edges}
    rows = []
    for a in names:
        row = []
        for b in names:
            one_way = overrides.get((a, b), spec.default_latency_ms)
            row.append(0.0 if a == b else 2.0 * one_way)
        rows.append(tuple(row))
    return RttMatrix(tuple(names), tuple(rows))


def decide(
    spec: SwarmSpec, problem: Problem, chosen: Plan, *, as_written: bool = False
) -> Decision:
    """The layout ``swarm up`` runs for ``spec`` given the plan ``chosen`` of ``problem``
    (``problem_of``'s), or why it runs the spec as written (the rules: the module docstring).

    Errors: ``PlanError`` when re-planning with the spec's coordinator fails."""
    if any(s.layers is not None for s in spec.stages):
        return Decision(None, 'explicit blocks are the operator\'s pin; give "auto" to plan')
    if as_written:
        return Decision(None, "--as-written")
    here = spec.coordinator.name
    note = ""
    if chosen.coordinator != here:
        note = (
            f"; a spec cannot move its coordinator: at {chosen.coordinator} the lap would be "
            f"{chosen.lap_ms:.1f} ms"
        )
        chosen = plan(attrs.evolve(problem, coordinators=(here,)))
    layout = Layout.of_plan(chosen)
    written = tuple(s.name for s in spec.stages)
    if layout.names() == written and layout == _auto(spec, written, problem.model):
        return Decision(None, f"no ring beats it: {chosen.lap_ms:.1f} ms{note}")
    pinned = _pinned(spec, set(layout.names()) ^ set(written))
    if pinned:
        return Decision(
            None,
            f"the plan would move {pinned} between the ring and the standbys{note}",
        )
    was = next((a.lap_ms for a in chosen.alternatives if "split in file order" in a.label), None)
    than = f" vs {was:.1f} ms as written" if was is not None else ""
    return Decision(layout, f"the plan: {chosen.lap_ms:.1f} ms{than}{note}")


def _auto(spec: SwarmSpec, names: Sequence[str], model: ModelFacts) -> Layout:
    """The ring as written: the spec's ``"auto"`` blocks (``SwarmSpec.blocks``)."""
    return Layout(tuple(zip(names, spec.blocks(model.n_layers, model), strict=True)))


def _pinned(spec: SwarmSpec, moved: set[str]) -> str:
    """Which of ``moved`` (nodes changing role) the spec names elsewhere, and where; ""."""
    found = []
    for fault in spec.faults:
        if fault.node in moved:
            found.append(f"{fault.node} ([[faults]] names it)")
    if spec.fetch is not None and moved:
        found.append(f"{', '.join(sorted(moved))} ([fetch] lists the stages)")
    for s in spec.standbys:
        if s.role == "auditor" and s.layers_of in moved:
            found.append(f"{s.layers_of} (auditor {s.name} audits it)")
    return ", ".join(dict.fromkeys(found))


def apply_layout(spec: SwarmSpec, layout: Layout) -> SwarmSpec:
    """``spec`` running ``layout``: its stages in that order with those blocks, every other
    stage and standby a standby (a hot standby whose stage stands by becomes a spare), and
    only the ``[links]`` overrides that are still hops of the ring.

    Errors: ``SpecError`` (key ``--layout``) for a name that is not a stage or standby, a name
    twice, blocks that do not tile, or a node that ``[[faults]]``, ``[fetch]`` or an auditor
    names moved between the ring and the standbys."""
    where = "--layout"
    nodes: dict[str, StageSpec | StandbySpec] = {s.name: s for s in spec.stages}
    nodes.update({s.name: s for s in spec.standbys if s.role != "auditor"})
    names = layout.names()
    for name in names:
        if name not in nodes:
            raise SpecError(
                spec.source, where, f"{name!r} is not a stage or standby ({', '.join(nodes)})"
            )
    if len(set(names)) != len(names) or not names:
        raise SpecError(spec.source, where, f"names each stage once, got {', '.join(names)}")
    check_tiling(where, [block for _, block in layout.stages])
    pinned = _pinned(spec, set(names) ^ {s.name for s in spec.stages})
    if pinned:
        raise SpecError(spec.source, where, f"moves {pinned} between ring and standbys")
    stages = tuple(_as_stage(nodes[name], block) for name, block in layout.stages)
    ring = set(names)
    standbys = [_as_standby(s) for s in spec.stages if s.name not in ring]
    for s in spec.standbys:
        if s.name in ring:
            continue
        if s.role != "auditor" and s.layers_of is not None and s.layers_of not in ring:
            s = attrs.evolve(s, layers_of=None)
        standbys.append(s)
    hops = set(itertools.pairwise((spec.coordinator.name, *names, spec.coordinator.name)))
    edges = tuple(e for e in spec.edges if (e.src, e.dst) in hops)
    return attrs.evolve(spec, stages=stages, standbys=tuple(standbys), edges=edges)


def _as_stage(node: StageSpec | StandbySpec, block: Block) -> StageSpec:
    if isinstance(node, StageSpec):
        return attrs.evolve(node, layers=block)
    return StageSpec(node.name, node.listen, block, node.credentials, node.runtime, node.reachable)


def _as_standby(node: StageSpec) -> StandbySpec:
    return StandbySpec(
        node.name,
        node.listen,
        credentials=node.credentials,
        runtime=node.runtime,
        reachable=node.reachable,
    )


def with_links(spec: SwarmSpec, rtt: RttMatrix) -> SwarmSpec:
    """``spec`` whose every ring hop has the one-way latency ``rtt`` gives it (half the round
    trip; ``swarm up --rtt``), its bandwidth as the spec's. Errors: ``KeyError`` for a node
    the matrix lacks (``problem_of`` has checked)."""
    edges = tuple(
        EdgeSpec(a, b, rtt.hop_ms(a, b), spec.edge(a, b).bandwidth_mbps)
        for a, b in itertools.pairwise(spec.ring())
    )
    return attrs.evolve(spec, edges=edges)
