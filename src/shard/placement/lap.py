"""The lap model and the plan it scores.

One lap of the ring is what a verify chunk costs: the coordinator sends the chunk to the first
stage, each stage computes its block and passes the hidden states on, and the tail returns the
verdict straight to the coordinator (direct return). Predicted lap = the one-way latency of
every hop (half its round trip) + every stage's compute for a (K+1)-token chunk. Bandwidth,
the coordinator's own drafting and the embedding/head compute are not modelled.

Who dials an edge does not change its latency (the NAT-friendly edges of issue #17), so a
node that accepts no inbound connection costs nothing extra next to one that does. Two
unreachable stages next to each other talk through a relay: the cheapest detour through a
reachable candidate or a coordinator location, and the plan names it (``Hop.via``). The
coordinator is assumed reachable.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs

from shard.placement.problem import Problem
from shard.placement.split import blocks_of

__all__ = ["Alternative", "Hop", "Mesh", "Plan", "Stage", "evaluate"]


@attrs.frozen
class Stage:
    """One stage of a plan: ``node`` holds layers ``[first, last)``, costing ``compute_ms``
    per verify chunk, and ``weight_bytes`` of weights as it holds them (the embedding on the
    first stage, the head on the last: what the split balances)."""

    node: str
    first: int
    last: int
    compute_ms: float
    weight_bytes: int

    @property
    def layers(self) -> int:
        """How many layers the block holds."""
        return self.last - self.first


@attrs.frozen
class Hop:
    """One hop of the ring and its one-way latency; ``via`` names the relay, if any."""

    src: str
    dst: str
    ms: float
    via: str | None = None


@attrs.frozen
class Alternative:
    """A plan the planner considered and did not choose: its lap (None: not feasible) and
    why it lost, in words."""

    label: str
    lap_ms: float | None
    why: str


@attrs.frozen
class Plan:
    """A placement: the coordinator's location, the stages in ring order with their blocks,
    the standbys (spare candidates, file order), every hop, and the predicted timings (ms):
    ``lap_ms`` = ``latency_ms`` + ``compute_ms`` for a (K+1)-token verify chunk,
    ``lap_one_token_ms`` for plain decoding, ``slowest_stage_ms`` the pace of pipelined
    decoding. ``method`` says how it was found; ``alternatives`` what lost, and why."""

    coordinator: str
    stages: tuple[Stage, ...]
    standbys: tuple[str, ...]
    hops: tuple[Hop, ...]
    latency_ms: float
    compute_ms: float
    lap_ms: float
    lap_one_token_ms: float
    slowest_stage_ms: float
    method: str
    alternatives: tuple[Alternative, ...] = ()

    def ring(self) -> tuple[str, ...]:
        """The ring, closed: ``(coordinator, first stage, ..., tail, coordinator)``."""
        return (self.coordinator, *(s.node for s in self.stages), self.coordinator)

    def blocks(self) -> tuple[tuple[int, int], ...]:
        """Each stage's ``[first, last)`` in ring order."""
        return tuple((s.first, s.last) for s in self.stages)

    def block_of(self, node: str) -> tuple[int, int] | None:
        """The block ``node`` holds, or None when it is not a stage."""
        for s in self.stages:
            if s.node == node:
                return (s.first, s.last)
        return None


class Mesh:
    """One-way latency of every hop the planner may use, relays resolved once."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        reachable = {c.name for c in problem.candidates if c.reachable}
        self._unreachable = {c.name for c in problem.candidates if not c.reachable}
        self._relays = tuple(sorted(reachable | set(problem.coordinators)))
        self._cache: dict[tuple[str, str], tuple[float, str | None]] = {}

    def hop(self, src: str, dst: str) -> tuple[float, str | None]:
        """``(ms, relay)`` of ``src -> dst``: direct unless neither end accepts inbound
        connections; ``(inf, None)`` when no relay can join them."""
        key = (src, dst)
        found = self._cache.get(key)
        if found is None:
            found = self._resolve(src, dst)
            self._cache[key] = found
        return found

    def ms(self, src: str, dst: str) -> float:
        """The one-way latency of ``src -> dst`` (relay included)."""
        return self.hop(src, dst)[0]

    def _resolve(self, src: str, dst: str) -> tuple[float, str | None]:
        rtt = self.problem.rtt
        if src == dst or src not in self._unreachable or dst not in self._unreachable:
            return (rtt.hop_ms(src, dst), None)
        best: tuple[float, str | None] = (math.inf, None)
        for relay in self._relays:
            if relay in (src, dst):
                continue
            cost = rtt.hop_ms(src, relay) + rtt.hop_ms(relay, dst)
            if cost < best[0]:
                best = (cost, relay)
        return best


def evaluate(
    mesh: Mesh, coordinator: str, order: Sequence[str], counts: Sequence[int], method: str
) -> Plan:
    """The plan with the coordinator at ``coordinator``, stages ``order`` holding ``counts``
    layers each; every other candidate is a standby."""
    problem = mesh.problem
    ring = (coordinator, *order, coordinator)
    hops = tuple(Hop(a, b, *mesh.hop(a, b)) for a, b in itertools.pairwise(ring))
    stages = []
    one_token = 0.0
    for name, (first, last) in zip(order, blocks_of(counts), strict=True):
        node = problem.candidate(name)
        held = problem.model.sizes_of(name).stage(first, last)
        stages.append(Stage(name, first, last, (last - first) * node.ms_per_layer_chunk, held))
        one_token += (last - first) * node.ms_per_layer_one
    chosen = set(order)
    latency = sum(h.ms for h in hops)
    compute = sum(s.compute_ms for s in stages)
    return Plan(
        coordinator=coordinator,
        stages=tuple(stages),
        standbys=tuple(c.name for c in problem.candidates if c.name not in chosen),
        hops=hops,
        latency_ms=latency,
        compute_ms=compute,
        lap_ms=latency + compute,
        lap_one_token_ms=latency + one_token,
        slowest_stage_ms=max(s.compute_ms for s in stages),
        method=method,
    )
