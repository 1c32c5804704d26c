"""The monitor's headline shows spot-check counters once a swarm audits, and nothing before;
it names the evicted nodes and the newest evidence file, and the ring line marks an evicted
node still in the ring (the feed drops one replaced: ``tests/test_evidence_files.py``)."""

from __future__ import annotations

import attrs

from shard.messages import AuditCounts, EdgeStatus, NodeName
from shard.observe.tui.app import ring_text, summary_text
from shard.testing.snapshots import sample_snapshot


def test_summary_shows_audits_strikes_and_evictions_only_when_there_are_any() -> None:
    """A swarm with no audits keeps the old two lines; one with audits gets a third."""
    plain = summary_text(sample_snapshot()).plain
    assert "audits" not in plain
    snap = attrs.evolve(sample_snapshot(), audit=AuditCounts(audits=12, strikes=2, evictions=1))
    assert "audits 12  strikes 2  evictions 1" in summary_text(snap).plain


def test_summary_names_the_evicted_and_the_newest_evidence_file() -> None:
    """Evicted nodes follow the eviction count; the newest evidence path gets its own line."""
    counts = AuditCounts(
        audits=12, strikes=2, evictions=1, evicted=(NodeName("s1"),),
        evidence=("/ev/s1-session1-chunk0-aa.json", "/ev/s1-session1-chunk1-bb.json"),
    )  # fmt: skip
    plain = summary_text(attrs.evolve(sample_snapshot(), audit=counts)).plain
    assert "evictions 1 (s1)" in plain
    assert "evidence /ev/s1-session1-chunk1-bb.json" in plain and "chunk0" not in plain


def test_ring_line_strikes_an_evicted_node_and_never_chains_an_edge_off_the_ring() -> None:
    """An evicted node still in the ring is struck through; an edge that does not continue
    the ring (measured off it) starts a new run after " · " instead of seeming to follow."""
    snap = sample_snapshot()
    stray = EdgeStatus(NodeName("old"), NodeName("coord"), 0.001, 0.001)
    snap = attrs.evolve(
        snap, edges=(*snap.edges, stray), audit=AuditCounts(evictions=1, evicted=(NodeName("s1"),))
    )
    text = ring_text(snap)
    first = text.plain.splitlines()[0]
    assert first.startswith("coord ─") and first.endswith(" coord · old ─1.0/1.0→ coord")
    struck = [text.plain[s.start : s.end] for s in text.spans if "strike" in str(s.style)]
    assert struck == ["s1"]
