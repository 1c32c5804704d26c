"""A plan for people (``text``) and for programs (``as_json``): what ``shard plan`` prints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from shard.placement.lap import Plan

__all__ = ["as_json", "text"]


def text(
    plan: Plan, *, assumed: Sequence[str] = (), regions: Mapping[str, str] | None = None
) -> str:
    """The plan as lines: ring, blocks, coordinator, standbys, timings, the alternatives that
    lost and why, and what was assumed."""
    where = regions or {}

    def name(node: str) -> str:
        region = where.get(node)
        return f"{node} ({region})" if region else node

    lines = [
        f"ring:        {' -> '.join(plan.ring())}",
        f"coordinator: {name(plan.coordinator)}",
        "stages:",
    ]
    for i, s in enumerate(plan.stages):
        lines.append(
            f"  {i}. {name(s.node):<28} layers {f'[{s.first}, {s.last})':<10} "
            f"{s.layers:>3} layers  {_mib(s.weight_bytes):>10}  {s.compute_ms:7.1f} ms"
        )
    lines.append(f"standbys:    {', '.join(name(n) for n in plan.standbys) or 'none'}")
    lines.append("hops:")
    for h in plan.hops:
        via = f"  (relayed via {h.via})" if h.via else ""
        lines.append(f"  {h.src} -> {h.dst}: {h.ms:.1f} ms{via}")
    lines += [
        f"predicted lap: {plan.lap_ms:.1f} ms per verify chunk (latency {plan.latency_ms:.1f} "
        f"+ compute {plan.compute_ms:.1f}); {plan.lap_one_token_ms:.1f} ms for one token",
        f"slowest stage: {plan.slowest_stage_ms:.1f} ms (the pace of pipelined decoding)",
        f"method:        {plan.method}",
    ]
    if plan.alternatives:
        lines.append("alternatives that lost:")
        for alt in plan.alternatives:
            lap = "not valid" if alt.lap_ms is None else f"{alt.lap_ms:.1f} ms"
            lines.append(f"  {alt.label}: {lap}: {alt.why}")
    for line in assumed:
        lines.append(f"assumed: {line}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 10 * 2**30 else f"{n / 2**30:.1f} GiB"


def as_json(plan: Plan, *, assumed: Sequence[str] = ()) -> dict[str, object]:
    """The plan as a JSON-ready dict (every field of ``Plan``, plus ``ring`` and ``assumed``)."""
    data = attrs.asdict(plan)
    data["ring"] = list(plan.ring())
    data["assumed"] = list(assumed)
    return data
