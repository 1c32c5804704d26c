"""What formation checks and says: a candidate's RTT report checked against what it was
asked, a plan described in one line (hops not measured yet named, not added), and
``FormationError``.
"""

from __future__ import annotations

import math

from shard.messages import MeasureRtt, RttReport
from shard.placement import Plan
from shard.placement.lap import Hop

#: Stand-in round trip (ms) for a pair nobody could measure: the planner avoids that edge.
UNREACHABLE_MS = 60_000.0


class FormationError(Exception):
    """The ring could not form; ``str()`` says who joined, what is missing and what to do."""


def check_report(asked: MeasureRtt, report: RttReport) -> str | None:
    """Why an ``RttReport`` does not answer ``asked``, or None."""
    if report.names != asked.names or len(report.rtt_ms) != len(asked.names):
        return "names or entries do not match the MeasureRtt it answers"
    for ms in report.rtt_ms:
        if not (ms == -1.0 or (math.isfinite(ms) and 0 <= ms <= UNREACHABLE_MS)):
            return f"round trip {ms!r} is neither -1 nor in [0, {UNREACHABLE_MS:g}] ms"
    return None


def unmeasured(p: Plan) -> tuple[Hop, ...]:
    """The hops of ``p`` priced with the ``UNREACHABLE_MS`` stand-in, not a measurement: a
    node that joined after the last mesh round (its round trips are not known yet), or one
    whose row was dropped. The planner counts them so to avoid them; a lap quoted to an
    operator must not (60 s a hop is no prediction)."""
    return tuple(h for h in p.hops if h.ms >= UNREACHABLE_MS / 2)


def describe(p: Plan) -> str:
    """One line: ``coord -> a [0, 3) -> b [3, 6) -> coord; standbys: c; predicted lap 1.2 ms``.
    Hops not measured yet are named, not added: ``predicted lap 14.78 ms over the measured
    hops; not measured yet: coord -> d, d -> b (the next mesh round measures them)``."""
    stages = " -> ".join(f"{s.node} [{s.first}, {s.last})" for s in p.stages)
    standbys = ", ".join(p.standbys) or "none"
    missing = unmeasured(p)
    lap = f"predicted lap {p.lap_ms - sum(h.ms for h in missing):.2f} ms"
    if missing:
        hops = ", ".join(f"{h.src} -> {h.dst}" for h in missing)
        lap += (
            f" over the measured hops; not measured yet: {hops} (the next mesh round measures them)"
        )
    return f"{p.coordinator} -> {stages} -> {p.coordinator}; standbys: {standbys}; {lap}"


__all__ = ["UNREACHABLE_MS", "FormationError", "check_report", "describe", "unmeasured"]
