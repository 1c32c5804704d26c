"""A ring already running when a coordinator starts forming: adopted, not formed again.

A coordinator that starts over a formed swarm — a standby coordinator that took over, or the
primary restarted — finds the ring's nodes registering as stages, each with its slot and its
block (``Register.role == "stage"``). Forming again would order nodes that serve a slot to load
another block; they refuse (``already serves a ring slot``), and that ended the coordinator
(the soak's first coordinator kill, issue 40). So formation waits for the stages that register
to hold every layer once, in order (``warm_ring``), and adopts them: their slots become the
registry's, the tail is told to re-dial its return link to this coordinator, and the plan is
that ring as it stands (``adopted_plan``: its lap over the measured mesh, for the re-plans
after later deaths). Standbys stay standbys. Stage claims that make no whole ring within
``[failover] join_deadline_s`` (a stage died while no coordinator watched, or a joiner lied)
are logged and set aside: the ring forms from the other nodes, the claimants left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import trio

from shard.formation.report import FormationError
from shard.membership.registry import Member, RecoveryFailed, Registry, Slot
from shard.messages import NodeName, Rewire
from shard.placement import Plan, Problem
from shard.placement.lap import Mesh, evaluate

__all__ = ["WarmRing", "adopt", "adopted_plan", "warm_ring"]


@attrs.frozen
class WarmRing:
    """The registered stages in ring order (by block), and the layers none of them holds
    (``""``: none missing) or the claims that overlap."""

    stages: tuple[Member, ...]
    missing: str

    @property
    def complete(self) -> bool:
        return not self.missing


def warm_ring(members: Iterable[Member], n_layers: int) -> WarmRing | None:
    """The ring the live ``members`` that registered as stages hold; None when none did."""
    stages = sorted(
        (m for m in members if m.alive and m.role == "stage" and 0 <= m.first < m.last),
        key=lambda m: (m.first, m.last),
    )
    if not stages:
        return None
    at, gaps = 0, []
    for m in stages:
        if m.first < at:
            gaps.append(f"{m.node}'s [{m.first}, {m.last}) overlaps another stage's block")
        elif m.first > at:
            gaps.append(f"[{at}, {m.first})")
        at = max(at, m.last)
    if at < n_layers:
        gaps.append(f"[{at}, {n_layers})")
    return WarmRing(tuple(stages), ", ".join(gaps))


def adopted_plan(problem: Problem, stages: Sequence[Member]) -> Plan:
    """The plan of the ring ``stages`` as it runs (the coordinator at its first place)."""
    counts = [m.last - m.first for m in stages]
    order = [m.node for m in stages]
    method = "adopted: the ring as it was running when this coordinator started"
    return evaluate(Mesh(problem), problem.coordinators[0], order, counts, method)


async def adopt(registry: Registry, found: Plan, timeout_s: float) -> None:
    """Make ``found`` (``adopted_plan``) the registry's ring, and have its tail re-dial its
    return link to this coordinator. Errors: ``FormationError`` when the tail cannot."""
    members = [registry.members[NodeName(s.node)] for s in found.stages]
    registry.slots = [
        Slot(NodeName(m.slot or m.node), m.first, m.last, m.node, registry.dial_address(m))
        for m in members
    ]
    tail = members[-1]
    try:  # its return link led to the coordinator before this one
        await tail.order(Rewire(registry.return_address, False), timeout_s=timeout_s)
    except (RecoveryFailed, trio.TooSlowError) as exc:
        raise FormationError(
            f"{tail.node} (the tail) could not re-dial this coordinator: "
            f"{exc or 'no answer in time'} (failover.splice_timeout_s)"
        ) from None
