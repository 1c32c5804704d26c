"""The mesh's bookkeeping (``shard.formation.mesh``): rows fresh, stale, then dropped after
``STALE_MISSES`` unanswered rounds and back on the next answer; reachability detected from
who reached a node's listen address."""

from __future__ import annotations

from shard.formation.mesh import STALE_MISSES, Mesh
from shard.messages import NodeName, RttReport

COORD = NodeName("coord")
A, B, C = NodeName("a"), NodeName("b"), NodeName("c")


def _state(mesh: Mesh, node: NodeName, now: float = 0.0) -> str:
    (row,) = mesh.statistics([node], now).rows
    return row.state


def test_a_row_goes_stale_then_is_dropped_then_comes_back() -> None:
    """One miss keeps the last row (stale); STALE_MISSES misses drop it, with one note each
    time the state changes; an answer makes it fresh again."""
    mesh = Mesh(COORD)
    assert _state(mesh, A) == "none"
    mesh.round_started()
    mesh.take(RttReport(A, ("b", "coord"), (4.0, 9.0)), now=1.0)
    assert mesh.round_done([A], now=1.0) == []
    assert _state(mesh, A) == "fresh" and mesh.row("a") == {"b": 4.0, "coord": 9.0}
    notes: list[str] = []
    for i in range(STALE_MISSES):
        mesh.round_started()
        notes += mesh.round_done([A], now=2.0 + i)
        if i < STALE_MISSES - 1:
            assert _state(mesh, A) == "stale" and mesh.row("a") == {"b": 4.0, "coord": 9.0}
    assert _state(mesh, A) == "dropped" and mesh.row("a") is None and mesh.dropped("a")
    assert len(notes) == 2 and "stale" in notes[0] and "dropped" in notes[1]
    mesh.round_started()
    mesh.take(RttReport(A, ("b", "coord"), (5.0, 9.0)), now=10.0)
    mesh.round_done([A], now=10.0)
    stats = mesh.statistics([A], now=12.0)
    assert stats.rounds == STALE_MISSES + 2 and stats.age_s == 2.0
    (row,) = stats.rows
    assert row.state == "fresh" and row.age_s == 2.0 and row.rtt_ms == (("b", 5.0), ("coord", 9.0))


def test_reachability_is_detected_from_who_reached_the_listen_address() -> None:
    """Nobody tried: unknown. Tried by some, reached by none: unreachable. Reached by anyone
    (a peer or the coordinator): reachable. The latest attempt of each prober counts."""
    mesh = Mesh(COORD)
    assert mesh.reachable("c") is None
    mesh.take(RttReport(A, ("b", "c", "coord"), (3.0, -1.0, 9.0)), now=0.0)
    mesh.take(RttReport(B, ("a", "c", "coord"), (3.0, -1.0, 9.0)), now=0.0)
    mesh.probed("c", reached=False)
    assert mesh.reachable("c") is False
    assert mesh.reachable("a") is True and mesh.reachable("b") is True
    assert mesh.reachable("coord") is None  # the coordinator is never judged by its row
    mesh.probed("c", reached=True)
    assert mesh.reachable("c") is True
    mesh.probed("c", reached=False)
    mesh.take(RttReport(A, ("b", "c", "coord"), (3.0, 7.0, 9.0)), now=1.0)
    assert mesh.reachable("c") is True
