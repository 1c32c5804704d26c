"""Mesh: the scheduler's latest RTT mesh between joined nodes, how old each row is, and which
nodes accept inbound connections.

Each joined node's row is what it last reported (``RttReport``, already checked against what
it was asked: ``shard.formation.formation.check_report``). The formation measures the mesh
before planning and then, every ``[formation] remeasure_s``, again (``Formation.remeasure``);
a round that a node does not answer is a *miss*:

- 0 misses: the row is **fresh**;
- 1 .. ``STALE_MISSES - 1`` misses in a row: the last row is kept and used, marked **stale**;
- ``STALE_MISSES`` misses in a row: the row is **dropped** — the node is still registered and
  alive on its control link, but every pair through it costs ``UNREACHABLE_MS`` to the
  planner (a node that will not measure is chosen last), until it answers again.

**Reachability** is detected from the same rounds: a candidate's row says, for each other
candidate, whether it reached that one's announced listen address (-1: it did not); the
coordinator probes every candidate's listen address itself. A node that at least one of them
tried and none reached accepts no inbound connection (``reachable`` False); one that any of
them reached is reachable; one nobody tried is unknown (taken as reachable). The latest
attempt of each prober counts, so a node can move both ways.

Pure bookkeeping: no I/O, time passed in. ``statistics`` is what operators see
(``Scheduler.statistics().mesh``, and the ``mesh`` events of the status feed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import attrs

from shard.messages import NodeName, RttReport

#: Rounds in a row without an answer after which a node's row is dropped (see above).
STALE_MISSES: Final = 3


@attrs.frozen
class MeshRow:
    """One joined node's part of the mesh: ``state`` is ``fresh``, ``stale``, ``dropped`` or
    ``none`` (never reported); ``age_s`` since its last report (None: never); ``misses`` in a
    row; ``reachable`` as detected (None: nobody tried its listen address); ``rtt_ms`` the
    round trips it last reported, (name, ms) for the peers it reached."""

    node: NodeName
    state: str
    age_s: float | None
    misses: int
    reachable: bool | None
    rtt_ms: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class MeshStatistics:
    """The mesh as the scheduler holds it: ``rounds`` measured since start, ``age_s`` since
    the last round ended (None before the first), and one row per node measured."""

    rounds: int = 0
    age_s: float | None = None
    rows: tuple[MeshRow, ...] = ()


class Mesh:
    """See the module docstring."""

    def __init__(self, coordinator: NodeName) -> None:
        self._coordinator = coordinator
        self._rows: dict[NodeName, dict[str, float]] = {}
        self._at: dict[NodeName, float] = {}
        self._misses: dict[NodeName, int] = {}
        self._answered: set[NodeName] = set()
        #: target -> prober -> whether the prober's latest attempt reached it
        self._inbound: dict[str, dict[str, bool]] = {}
        self._rounds = 0
        self._round_at: float | None = None

    # --- what comes in -------------------------------------------------------------------

    def take(self, report: RttReport, now: float) -> None:
        """``report.node``'s row (checked by the caller: it answers what was asked)."""
        node = report.node
        self._rows[node] = {
            n: ms for n, ms in zip(report.names, report.rtt_ms, strict=True) if ms >= 0
        }
        self._at[node] = now
        self._misses[node] = 0
        self._answered.add(node)
        for name, ms in zip(report.names, report.rtt_ms, strict=True):
            if name != self._coordinator and name != node:
                self._inbound.setdefault(name, {})[node] = ms >= 0

    def probed(self, target: str, reached: bool) -> None:
        """The coordinator's own attempt at ``target``'s listen address."""
        self._inbound.setdefault(target, {})[self._coordinator] = reached

    def round_started(self) -> None:
        self._answered = set()

    def answered(self, node: str) -> bool:
        """Whether ``node`` reported in the round in progress (or the last one)."""
        return NodeName(node) in self._answered

    def round_done(self, asked: Iterable[NodeName], now: float) -> list[str]:
        """Count a miss for each node of ``asked`` that did not answer this round; the
        one-line notes of rows that changed state because of it (stale, dropped)."""
        notes = []
        for node in asked:
            if node in self._answered:
                continue
            misses = self._misses.get(node, 0) + 1
            self._misses[node] = misses
            if misses == STALE_MISSES:
                notes.append(
                    f"{node} answered no RTT measurement for {misses} rounds: its row is "
                    "dropped (pairs through it cost the unreachable stand-in until it answers)"
                )
            elif misses == 1 and node in self._rows:
                notes.append(f"{node} did not answer this RTT round: its last row is stale")
        self._rounds += 1
        self._round_at = now
        return notes

    # --- what the planner reads ----------------------------------------------------------

    def row(self, node: str) -> dict[str, float] | None:
        """``node``'s usable row: its last report unless never reported or dropped."""
        if self.dropped(node):
            return None
        return self._rows.get(NodeName(node))

    def dropped(self, node: str) -> bool:
        return self._misses.get(NodeName(node), 0) >= STALE_MISSES

    def reachable(self, node: str) -> bool | None:
        """Detected: True when a prober reached ``node``'s listen address in its latest
        attempt, False when some tried and none did, None when nobody tried."""
        tried = self._inbound.get(node)
        if not tried:
            return None
        return any(tried.values())

    def statistics(self, nodes: Iterable[NodeName], now: float) -> MeshStatistics:
        rows = []
        for node in nodes:
            misses = self._misses.get(node, 0)
            at = self._at.get(node)
            if at is None:
                state = "dropped" if misses >= STALE_MISSES else "none"
            else:
                state = "dropped" if misses >= STALE_MISSES else "stale" if misses else "fresh"
            rtt = tuple(sorted(self._rows.get(node, {}).items()))
            age = None if at is None else now - at
            rows.append(MeshRow(node, state, age, misses, self.reachable(node), rtt))
        age_s = None if self._round_at is None else now - self._round_at
        return MeshStatistics(self._rounds, age_s, tuple(rows))


__all__ = ["STALE_MISSES", "Mesh", "MeshRow", "MeshStatistics"]
