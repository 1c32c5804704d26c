"""FailureDetector: whether a node is alive, suspected or dead, from what the scheduler heard.

A pure core (no I/O, no clock: callers pass ``now``; plain synchronous tests in
``tests/test_detector.py``). The scheduler feeds it every message a node sends on its control
link (``heard``), every report that the edge into a node broke (``corroborate``), and calls
``tick`` from its watch loop; ``tick`` returns the nodes whose state changed.

Three ideas keep it from calling a live node dead:

- **Phi accrual** (Hayashibara et al., as in Akka and Cassandra): the gaps between a node's
  heartbeats are modelled as a normal distribution (mean and standard deviation of the last
  ``window`` gaps, the deviation floored at ``min_std_s``); ``phi`` of a silence is
  ``-log10 P(a gap at least this long)``. A jittery link (a WAN, a loaded host) widens the
  distribution, so the same silence gives a lower phi: the timeout adapts to what was measured.
- **Suspicion before death**: ``phi >= suspect_phi`` makes a node *suspected* (reported, not
  acted on); it is *dead* only once ``phi >= dead_phi`` **and** it has been silent for at
  least ``dead_after_s`` — or, with a second, independent signal (its upstream neighbour
  reported the edge into it broken since it was last heard), as soon as it is suspected.
- **The scheduler's own lag is not the node's silence**: ``tick`` is expected every
  ``tick_s``; when it runs late (the event loop was busy tokenizing a huge prompt, the host
  was loaded), the excess is *lag*, and silence is measured net of the lag that accrued since
  the node was last heard. A gap that spans the scheduler's own lag is not a sample either
  (it measures the scheduler, not the link). So a scheduler that was not scheduled for 3 s
  does not blame the nodes whose heartbeats sat unread in its socket buffers.

A dead node stays dead here until ``watch`` is called for it again (it re-registered).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final, Literal

import attrs

from shard.spec.failover import FailoverSpec

State = Literal["alive", "suspect", "dead"]

#: Gaps kept per node for the distribution (Akka's default window).
WINDOW: Final = 100


@attrs.frozen
class Assessment:
    """One node's standing at ``now``: its state, its silence net of the scheduler's own lag,
    the phi of that silence, and what confirmed a death (``""`` when none)."""

    node: str
    state: State
    silence_s: float
    phi: float
    confirmed_by: str = ""


@attrs.define
class _Arrivals:
    last: float  # the last message heard
    lag_at_last: float  # the scheduler's total lag then
    last_beat: float  # the last heartbeat (the distribution's samples are heartbeat gaps)
    lag_at_beat: float
    gaps: deque[float]
    state: State = "alive"
    corroborated: str = ""  # a neighbour's report since the node was last heard


def phi(silence_s: float, mean_s: float, std_s: float) -> float:
    """``-log10`` of the chance that a gap lasts at least ``silence_s``, for gaps distributed
    normally with ``mean_s`` and ``std_s`` (> 0). ``inf`` past what a float resolves."""
    if silence_s <= 0:
        return 0.0
    later = 0.5 * math.erfc((silence_s - mean_s) / (std_s * math.sqrt(2.0)))
    return math.inf if later <= 0 else -math.log10(later)


class FailureDetector:
    """See the module docstring. ``policy`` is the spec's ``[failover]`` record;
    ``tick_s``: how often the caller ticks (its ``heartbeat_s`` by default)."""

    def __init__(self, policy: FailoverSpec = FailoverSpec(), *, tick_s: float | None = None):
        self._policy = policy
        self._tick_s = policy.heartbeat_s if tick_s is None else tick_s
        self._nodes: dict[str, _Arrivals] = {}
        self._last_tick: float | None = None
        self._lag_s = 0.0

    @property
    def lag_s(self) -> float:
        """Total time the caller's loop ran late (the silence no node is blamed for)."""
        return self._lag_s

    def watch(self, node: str, now: float) -> None:
        """Start (or restart) watching ``node``: it just registered, which counts as heard.

        The distribution starts from two gaps one quarter of a heartbeat either side of
        ``heartbeat_s`` (nothing measured yet; Akka's first-heartbeat estimate)."""
        beat = self._policy.heartbeat_s
        gaps = deque([beat - beat / 4, beat + beat / 4], maxlen=WINDOW)
        self._nodes[node] = _Arrivals(now, self._lag_s, now, self._lag_s, gaps)

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def heard(self, node: str, now: float, *, heartbeat: bool = True) -> None:
        """``node`` sent something at ``now``. Heartbeats also add a gap to its distribution
        unless that gap spans the caller's own lag (then it measures the caller)."""
        a = self._nodes.get(node)
        if a is None or a.state == "dead":
            return
        a.last, a.lag_at_last, a.corroborated = now, self._lag_s, ""
        if not heartbeat:
            return
        overdue = self._last_tick is not None and now - self._last_tick > 2 * self._tick_s
        if a.lag_at_beat == self._lag_s and not overdue:
            a.gaps.append(now - a.last_beat)
        a.last_beat, a.lag_at_beat = now, self._lag_s

    def corroborate(self, node: str, detail: str) -> None:
        """A second signal: ``node``'s upstream neighbour says the edge into it broke."""
        a = self._nodes.get(node)
        if a is not None and a.state != "dead":
            a.corroborated = detail

    def assess(self, node: str, now: float) -> Assessment | None:
        """``node``'s standing at ``now`` (None if it is not watched)."""
        a = self._nodes.get(node)
        if a is None:
            return None
        silence = max(0.0, now - a.last - (self._lag_s - a.lag_at_last))
        p = self._phi(a, silence)
        if a.state == "dead":
            return Assessment(node, "dead", silence, p)
        policy = self._policy
        if p >= policy.dead_phi and silence >= policy.dead_after_s:
            return Assessment(node, "dead", silence, p, "silence")
        if p >= policy.suspect_phi and a.corroborated:
            return Assessment(node, "dead", silence, p, a.corroborated)
        return Assessment(node, "suspect" if p >= policy.suspect_phi else "alive", silence, p)

    def tick(self, now: float) -> tuple[Assessment, ...]:
        """The caller's periodic check: note its own lag, then return every watched node
        whose state changed since the last tick (``suspect``, back to ``alive``, ``dead``)."""
        if self._last_tick is not None:
            self._lag_s += max(0.0, now - self._last_tick - self._tick_s)
        self._last_tick = now
        changes: list[Assessment] = []
        for node, a in self._nodes.items():
            before = a.state
            seen = self.assess(node, now)
            assert seen is not None
            a.state = seen.state
            if seen.state != before:
                changes.append(seen)
        return tuple(changes)

    def _phi(self, a: _Arrivals, silence_s: float) -> float:
        n = len(a.gaps)
        mean = sum(a.gaps) / n
        var = sum((g - mean) ** 2 for g in a.gaps) / n
        return phi(silence_s, mean, max(math.sqrt(var), self._policy.min_std_s))


__all__ = ["Assessment", "FailureDetector", "State", "phi"]
