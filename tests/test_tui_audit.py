"""The monitor's headline shows spot-check counters once a swarm audits, and nothing before."""

from __future__ import annotations

import attrs

from shard.messages import AuditCounts
from shard.observe.tui.app import summary_text
from shard.observe.tui.testing import sample_snapshot


def test_summary_shows_audits_strikes_and_evictions_only_when_there_are_any() -> None:
    """A swarm with no audits keeps the old two lines; one with audits gets a third."""
    plain = summary_text(sample_snapshot()).plain
    assert "audits" not in plain
    snap = attrs.evolve(sample_snapshot(), audit=AuditCounts(audits=12, strikes=2, evictions=1))
    assert "audits 12  strikes 2  evictions 1" in summary_text(snap).plain
