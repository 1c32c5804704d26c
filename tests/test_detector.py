"""The failure detector's pure core (``shard.failover.detector``): phi accrual, suspicion
before death, the scheduler's own lag not blamed on nodes, a second signal. Plain synchronous
tests: time is a number passed in."""

from __future__ import annotations

import random

import attrs
import pytest

from shard.failover.detector import Assessment, FailureDetector, phi
from shard.spec.failover import FailoverSpec

LAN = FailoverSpec(heartbeat_s=0.25, dead_after_s=1.0)
WAN = FailoverSpec()  # the defaults


def beating(
    policy: FailoverSpec, *, until: float, gaps: list[float] | None = None
) -> tuple[FailureDetector, float]:
    """A detector watching "s1", which beat every ``heartbeat_s`` (or with ``gaps``) until
    ``until``; the caller's loop ticked on time throughout. Returns it and the last beat."""
    d = FailureDetector(policy)
    d.watch("s1", 0.0)
    d.tick(0.0)
    now, last, tick, i = 0.0, 0.0, 0.0, 0
    while True:
        gap = gaps[i % len(gaps)] if gaps else policy.heartbeat_s
        i += 1
        if last + gap > until:
            break
        last += gap
        while tick + policy.heartbeat_s <= last:  # ticks due before this beat
            tick += policy.heartbeat_s
            assert d.tick(tick) == ()
        now = last
        d.heard("s1", now)
    return d, last


def ticks_until(d: FailureDetector, start: float, end: float, step: float) -> list[Assessment]:
    """Tick on time every ``step`` from ``start`` to ``end``; every change, in order."""
    changes: list[Assessment] = []
    t = start
    while t < end:
        t = round(t + step, 9)
        changes += d.tick(t)
    return changes


def test_phi_grows_with_silence_and_is_zero_for_none() -> None:
    """phi is 0 with no silence, about 0.3 at the mean gap, and grows without bound."""
    assert phi(0.0, 0.25, 0.1) == 0.0
    assert phi(0.25, 0.25, 0.1) == pytest.approx(0.30103, abs=1e-4)
    values = [phi(s, 0.25, 0.1) for s in (0.3, 0.5, 0.8, 1.2)]
    assert values == sorted(values) and values[-1] > 8
    assert phi(100.0, 0.25, 0.1) == float("inf")


def test_a_silent_node_is_suspected_before_it_is_dead() -> None:
    """Steady beats, then silence: suspect first, dead only past dead_after_s."""
    d, _ = beating(LAN, until=5.0)
    changes = ticks_until(d, 5.0, 8.0, 0.05)
    assert [c.state for c in changes] == ["suspect", "dead"]
    suspect, dead = changes
    assert suspect.silence_s < LAN.dead_after_s
    assert dead.silence_s >= LAN.dead_after_s and dead.phi >= LAN.dead_phi
    assert dead.confirmed_by == "silence"


def test_a_suspect_that_is_heard_again_is_cleared_and_never_dead() -> None:
    """A node silent long enough to be suspected, then heard: back to alive, not dead."""
    d, last = beating(LAN, until=5.0)
    changes = ticks_until(d, 5.0, last + 0.8, 0.05)
    assert [c.state for c in changes] == ["suspect"]
    d.heard("s1", last + 0.85)
    (back,) = d.tick(last + 0.9)
    assert back.state == "alive"


def test_the_schedulers_own_lag_is_not_the_nodes_silence() -> None:
    """The caller's loop does not run for 3 s (a huge prompt tokenized on it): when it wakes,
    the nodes' heartbeats are still unread, yet nobody is suspected or dead."""
    d, _ = beating(LAN, until=5.0)
    woke = 5.0 + 3.0
    assert d.tick(woke) == ()  # the only tick in 3 s, heartbeats not yet read
    assert d.lag_s == pytest.approx(3.0 - LAN.heartbeat_s)
    seen = d.assess("s1", woke)
    assert seen is not None and seen.silence_s < LAN.heartbeat_s * 2
    for t in (8.01, 8.02, 8.03):  # the buffered beats, read in a burst
        d.heard("s1", t)
    for i in range(1, 9):  # then beats and ticks on time again
        d.heard("s1", woke + 0.25 * i - 0.01)
        assert d.tick(woke + 0.25 * i) == ()


def test_a_gap_spanning_the_schedulers_lag_is_not_a_sample() -> None:
    """Beats read after the caller's stall do not widen the node's distribution (a wide one
    would hide a real death for longer)."""
    d, _ = beating(LAN, until=5.0)
    ref, _ = beating(LAN, until=5.0)
    d.tick(8.0)  # 3 s late
    d.heard("s1", 8.01)
    ref.tick(5.25)
    ref.heard("s1", 5.25)
    mine, theirs = d.assess("s1", 8.61), ref.assess("s1", 5.85)
    assert mine is not None and theirs is not None
    assert mine.phi == pytest.approx(theirs.phi, rel=0.05)


def test_a_node_that_dies_during_the_schedulers_lag_is_still_found() -> None:
    """Crediting lag only delays the verdict by the lag: a node that stays silent after the
    caller wakes is dead once dead_after_s of silence has been observed."""
    d, _ = beating(LAN, until=5.0)
    d.tick(8.0)
    changes = ticks_until(d, 8.0, 12.0, LAN.heartbeat_s)
    assert [c.state for c in changes] == ["suspect", "dead"]
    assert changes[-1].silence_s >= LAN.dead_after_s


def test_the_timeout_adapts_to_measured_jitter() -> None:
    """A jittery node (gaps 0.05..0.9 s) is given longer before suspicion than a steady one,
    and neither is dead before dead_after_s."""
    rng = random.Random(7)
    jitter = [round(rng.uniform(0.05, 0.9), 3) for _ in range(60)]
    policy = attrs.evolve(WAN, dead_after_s=2.0)
    steady, s_last = beating(policy, until=20.0)
    jittery, j_last = beating(policy, until=20.0, gaps=jitter)

    def first(d: FailureDetector, last: float, state: str) -> float:
        for c in ticks_until(d, last, last + 30.0, 0.05):
            if c.state == state:
                return c.silence_s
        raise AssertionError(f"never {state}")

    assert first(jittery, j_last, "suspect") > 1.5 * first(steady, s_last, "suspect")
    j2, j2_last = beating(policy, until=20.0, gaps=jitter)
    assert first(j2, j2_last, "dead") >= policy.dead_after_s


def test_wan_defaults_survive_a_tcp_double_retransmit() -> None:
    """Default timings: 3 s of silence (two lost segments, RTO 1 s then 2 s) is not a death."""
    d, last = beating(WAN, until=10.0)
    changes = ticks_until(d, last, last + 3.0, WAN.heartbeat_s)
    assert "dead" not in [c.state for c in changes]


def test_a_second_signal_confirms_a_suspect_at_once() -> None:
    """A suspected node whose upstream neighbour reports the edge into it broken is dead
    without waiting out dead_after_s; the report alone, on a node heard from, is not."""
    d, _ = beating(WAN, until=5.0)
    d.corroborate("s1", "s0 reported the edge into it broken")
    assert d.tick(5.05) == ()  # heard 0.05 s ago: one signal only
    changes = ticks_until(d, 5.05, 6.0, 0.05)
    assert [c.state for c in changes] == ["dead"]
    assert changes[0].silence_s < WAN.dead_after_s
    assert changes[0].confirmed_by == "s0 reported the edge into it broken"


def test_a_report_is_forgotten_once_the_node_is_heard() -> None:
    """A neighbour's report counts only until the node is heard again."""
    d, _ = beating(WAN, until=5.0)
    d.corroborate("s1", "s0 reported the edge into it broken")
    d.heard("s1", 5.1)
    changes = ticks_until(d, 5.0, 6.0, 0.05)
    assert [c.state for c in changes] == ["suspect"]


def test_a_dead_node_stays_dead_until_watched_again() -> None:
    """Dead is final for this incarnation: beats after it are ignored until it registers
    (``watch``) again."""
    d, _ = beating(LAN, until=5.0)
    ticks_until(d, 5.0, 8.0, 0.25)
    d.heard("s1", 8.1)
    seen = d.assess("s1", 8.2)
    assert seen is not None and seen.state == "dead"
    d.watch("s1", 8.3)
    assert ticks_until(d, 8.3, 8.5, 0.05) == []
    again = d.assess("s1", 8.5)
    assert again is not None and again.state == "alive"


def test_unwatched_nodes_are_not_assessed() -> None:
    """A node never watched (or forgotten) has no standing and never changes state."""
    d = FailureDetector(LAN)
    d.heard("ghost", 1.0)
    d.corroborate("ghost", "x")
    assert d.assess("ghost", 2.0) is None
    d.watch("s1", 0.0)
    d.forget("s1")
    assert d.tick(5.0) == ()
