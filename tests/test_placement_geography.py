"""The checked-in geography (``specs/geography/world.toml``) and its reader.

On the simulated world (12 nodes in six regions, three coordinator places) the planner picks
the low-latency European cluster and puts the coordinator there; forced out of region, the
predicted lap is worse (both numbers are reported). A bad geography is one clear line.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from shard.placement import Geography, PlanError, Problem, plan, read_geography
from shard.placement.geography import GeographyError

WORLD = Path(__file__).resolve().parents[1] / "specs" / "geography" / "world.toml"
EUROPE = {"eu-central", "eu-west"}


def world() -> Geography:
    with open(WORLD, "rb") as f:
        return read_geography(tomllib.load(f), str(WORLD))


def problem(g: Geography, **kw: Any) -> Problem:
    assert g.model is not None
    return attrs.evolve(Problem(g.nodes, g.rtt, g.model, g.coordinators), **kw)


def test_world_is_twelve_nodes_in_several_regions() -> None:
    """The geography has 12 profiled nodes in 6 regions, a symmetric matrix, heterogeneous
    memory and speed, and round trips within a city far below those across an ocean."""
    g = world()
    assert len(g.nodes) == 12
    assert len(set(g.regions.values())) == 6
    assert len({n.memory_bytes for n in g.nodes}) >= 3
    assert len({n.ms_per_layer_chunk for n in g.nodes}) >= 3
    assert any(not n.reachable for n in g.nodes) and any(n.trusted for n in g.nodes)
    names = g.rtt.names
    assert all(g.rtt.rtt(a, b) == g.rtt.rtt(b, a) for a in names for b in names)
    assert g.rtt.rtt("fra-1", "fra-3") < 5 < 50 < g.rtt.rtt("fra-1", "iad-1")
    assert g.model is not None and g.model.n_layers == 64


def test_world_matrix_follows_its_stated_rule() -> None:
    """Every round trip is the city pair's (the table in the file's comment; 1 ms within a
    city) plus 8 ms for each end at home behind NAT, as specs/geography/README.md says."""
    g = world()
    table = {
        frozenset(m[:2]): float(m[2])
        for m in re.findall(r"([A-Z]{3})-([A-Z]{3}) (\d+)", WORLD.read_text())
    }
    home = {n.name for n in g.nodes if not n.reachable}

    def city(name: str) -> str:
        return name.split("-")[-1 if name.startswith("coord-") else 0].upper()

    for a in g.rtt.names:
        for b in g.rtt.names:
            if a == b:
                continue
            pair = frozenset((city(a), city(b)))
            base = 1.0 if len(pair) == 1 else table[pair]
            expected = base + 8.0 * ((a in home) + (b in home))
            assert g.rtt.rtt(a, b) == expected, (a, b)


def test_planner_picks_the_low_latency_cluster_and_its_coordinator(
    report: Callable[[str], None],
) -> None:
    """The chosen stages are all in Europe, the coordinator is the Frankfurt one, and forcing
    the coordinator to Ashburn or Tokyo gives a worse predicted lap (both reported)."""
    g = world()
    best = plan(problem(g))
    assert {g.regions[s.node] for s in best.stages} <= EUROPE
    assert best.coordinator == "coord-fra"
    assert best.method == "exact"
    for place in ("coord-iad", "coord-tyo"):
        forced = plan(problem(g, coordinators=(place,)))
        assert forced.coordinator == place
        assert forced.lap_ms > best.lap_ms
        line = (
            f"geography: coordinator in region (coord-fra) lap {best.lap_ms:.1f} ms, "
            f"forced to {place} lap {forced.lap_ms:.1f} ms"
        )
        print(line)
        report(line)
        listed = [a for a in best.alternatives if a.label == f"coordinator at {place}"]
        assert listed and listed[0].lap_ms == pytest.approx(forced.lap_ms)


def test_world_beats_the_even_split_in_file_order(report: Callable[[str], None]) -> None:
    """The even split over all 12 nodes crosses oceans several times: far worse."""
    best = plan(problem(world()))
    even = best.alternatives[0]
    assert even.label.startswith("even split in file order (12 stages")
    assert even.lap_ms is not None and even.lap_ms > 2 * best.lap_ms
    report(f"geography: plan lap {best.lap_ms:.1f} ms, even split in file order {even.lap_ms:.1f}")


def test_world_with_pinned_boundaries_puts_trusted_nodes_at_the_ends() -> None:
    """Pinned, the first and last stages are trusted nodes, still in Europe."""
    g = world()
    pinned = plan(problem(g, pin_boundaries=True))
    ends = [pinned.stages[0].node, pinned.stages[-1].node]
    assert all(c.trusted for c in g.nodes if c.name in ends) and len(set(ends)) == 2
    assert {g.regions[s.node] for s in pinned.stages} <= EUROPE


def test_world_replans_when_a_stage_dies() -> None:
    """Killing a chosen stage hands its block to a standby or a neighbour, nothing else moves."""
    from shard.placement import replan
    from shard.placement.replan import moved_layers

    p = problem(world())
    before = plan(p)
    dead = before.stages[-1]
    after = replan(before, dead.node, p)
    assert moved_layers(before, after) == dead.layers
    assert after.coordinator == before.coordinator


# --- the reader's errors -----------------------------------------------------------------------


def _data() -> dict[str, Any]:
    return {
        "coordinators": ["c"],
        "model": {"n_layers": 4, "layer_gib": 1.0},
        "node": [{"name": "a", "memory_gib": 8, "ms_per_layer_1": 1.0, "ms_per_layer_k": 1.2}],
        "rtt": {"nodes": ["a", "c"], "ms": [[0, 10], [10, 0]]},
    }


def test_a_good_geography_reads() -> None:
    """The minimal example reads into typed records (GiB become bytes; reachable by default)."""
    g = read_geography(_data(), "g.toml")
    assert g.nodes[0].memory_bytes == 8 << 30 and g.nodes[0].reachable
    assert not g.nodes[0].trusted
    assert g.rtt.hop_ms("a", "c") == 5.0
    assert plan(problem(g)).ring() == ("c", "a", "c")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["rtt"].update(ms=[[0, -1], [10, 0]]), r"rtt\.ms\[0\]\[1\]: is negative"),
        (lambda d: d["rtt"].update(ms=[[0, 10], [10]]), r"rtt\.ms\[1\]: not a matrix"),
        (lambda d: d["rtt"].update(ms="far"), r"rtt\.ms: not a matrix"),
        (lambda d: d["rtt"].update(ms=[[0, 10]]), r"not a matrix: 1 rows for 2 nodes"),
        (lambda d: d["rtt"].update(nodes=["c"], ms=[[0]]), r"node: a not in rtt\.nodes"),
        (lambda d: d.update(coordinators=["z"]), r"coordinators: z not in rtt\.nodes"),
        (lambda d: d.pop("rtt"), r"rtt: missing"),
        (lambda d: d.update(colour="red"), r"colour: unknown key"),
        (lambda d: d["node"][0].pop("memory_gib"), r"node\[0\]\.memory_gib: missing"),
        (lambda d: d["node"][0].update(trusted="yes"), r"node\[0\]\.trusted: must be true"),
        (lambda d: d["node"][0].update(ms_per_layer_k=0), r"node\[0\]: .*positive"),
        (lambda d: d["model"].update(n_layers=0), r"model\.n_layers: must be an integer"),
        (lambda d: d["rtt"]["ms"][0].__setitem__(1, True), r"must be a number"),
    ],
)
def test_a_bad_geography_is_one_clear_line(
    change: Callable[[dict[str, Any]], object], message: str
) -> None:
    """Every mistake names the file and the key, in one line."""
    data = _data()
    change(data)
    with pytest.raises(GeographyError, match=message) as err:
        read_geography(data, "g.toml")
    assert str(err.value).startswith("g.toml: ")
    assert "\n" not in str(err.value)
    assert isinstance(err.value, PlanError)
