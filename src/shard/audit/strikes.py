"""StrikeBook: the scheduler's count of audits, failed audits (strikes) and evictions.

Each strike's signed evidence is also written to a file by the scheduler
(``shard.audit.evidence_files``), so it leaves the coordinator.

Pure: ``record(verdict)`` says whether the verdict's stage has now reached ``limit`` strikes
and must be evicted (once per node: an evicted node is not evicted again). Verdicts with
``method`` "error" (an audit that could not run) accuse nobody and count as no strike.
"""

from __future__ import annotations

import attrs

from shard.messages import NodeName
from shard.messages.audit import AuditVerdict, Evidence


@attrs.frozen
class AuditStatistics:
    """Audits answered, strikes and evictions so far, with the strikes per node, the
    audits each auditor answered, and the evicted nodes in eviction order."""

    audits: int = 0
    strikes: int = 0
    evictions: int = 0
    by_node: tuple[tuple[NodeName, int], ...] = ()
    by_auditor: tuple[tuple[NodeName, int], ...] = ()
    evicted: tuple[NodeName, ...] = ()


class StrikeBook:
    """See the module docstring. ``evidence`` keeps every failed audit's signed evidence."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._audits = 0
        self._answered: dict[NodeName, int] = {}  # by auditor
        self._strikes: dict[NodeName, int] = {}
        self._evicted: dict[NodeName, None] = {}  # in eviction order
        self.evidence: list[Evidence] = []

    def record(self, verdict: AuditVerdict) -> bool:
        """Count ``verdict``; True when its node must be evicted now."""
        self._audits += 1
        self._answered[verdict.auditor] = self._answered.get(verdict.auditor, 0) + 1
        if verdict.ok or verdict.method == "error":
            return False
        if verdict.evidence is not None:
            self.evidence.append(verdict.evidence)
        node = verdict.accused
        self._strikes[node] = self._strikes.get(node, 0) + 1
        if self._strikes[node] >= self._limit and node not in self._evicted:
            self._evicted[node] = None
            return True
        return False

    def strikes(self, node: NodeName) -> int:
        return self._strikes.get(node, 0)

    def statistics(self) -> AuditStatistics:
        return AuditStatistics(
            audits=self._audits,
            strikes=sum(self._strikes.values()),
            evictions=len(self._evicted),
            by_node=tuple(sorted(self._strikes.items())),
            by_auditor=tuple(sorted(self._answered.items())),
            evicted=tuple(self._evicted),
        )
