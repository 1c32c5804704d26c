"""Plain tests of the planner's pieces (``shard.placement``): the inputs' validation, the
split, the lap model with relays, pinning, the errors an operator sees, the heuristic beyond
12 candidates and the sticky re-plan. Pure functions: no I/O, no clock."""

from __future__ import annotations

import itertools
import random

import attrs
import pytest

from shard.placement import (
    EXACT_LIMIT,
    Candidate,
    ModelFacts,
    PlanError,
    Problem,
    RttMatrix,
    plan,
    replan,
)
from shard.placement.heuristic import pool
from shard.placement.lap import Mesh, evaluate
from shard.placement.replan import moved_layers
from shard.placement.split import (
    balanced_counts,
    blocks_of,
    byte_counts,
    capacity,
    even_counts,
    stage_bytes,
)

GIB = 1 << 30


def node(name: str, mem: int = 100, ms: float = 1.0, **kw: bool) -> Candidate:
    """A candidate with ``mem`` GiB and ``ms`` per layer for both chunk sizes."""
    return Candidate(name, mem * GIB, ms, ms, **kw)


def line(names: list[str], gaps: list[float]) -> RttMatrix:
    """Places on a line, ``gaps[i]`` ms of round trip between names[i] and names[i+1]."""
    at = [0.0]
    for g in gaps:
        at.append(at[-1] + g)
    pairs = {
        (a, b): abs(x - y)
        for a, x in zip(names, at, strict=True)
        for b, y in zip(names, at, strict=True)
        if a != b
    }
    return RttMatrix.symmetric(names, pairs)


MODEL = ModelFacts(n_layers=8, layer_bytes=GIB, embedding_bytes=GIB, head_bytes=GIB)


# --- inputs -----------------------------------------------------------------------------------


def test_rtt_matrix_refuses_what_is_not_a_square_of_round_trips() -> None:
    """A ragged row, a negative or infinite value, or a repeated name is a PlanError."""
    with pytest.raises(PlanError, match="must be square"):
        RttMatrix(("a", "b"), ((0.0, 1.0), (1.0,)))
    with pytest.raises(PlanError, match="finite and >= 0"):
        RttMatrix(("a", "b"), ((0.0, -1.0), (1.0, 0.0)))
    with pytest.raises(PlanError, match="finite and >= 0"):
        RttMatrix(("a", "b"), ((0.0, float("inf")), (1.0, 0.0)))
    with pytest.raises(PlanError, match="twice"):
        RttMatrix(("a", "a"), ((0.0, 1.0), (1.0, 0.0)))
    with pytest.raises(PlanError, match="2 rows for 3 nodes"):
        RttMatrix(("a", "b", "c"), ((0.0, 1.0, 1.0), (1.0, 0.0, 1.0)))


def test_a_hop_costs_half_a_round_trip_and_may_be_asymmetric() -> None:
    """``hop_ms`` is half the measured RTT, per direction; a place to itself costs 0."""
    rtt = RttMatrix(("a", "b"), ((0.0, 10.0), (30.0, 0.0)))
    assert rtt.hop_ms("a", "b") == 5.0
    assert rtt.hop_ms("b", "a") == 15.0
    assert rtt.hop_ms("a", "a") == 0.0


def test_problem_names_nodes_the_matrix_lacks() -> None:
    """A candidate or coordinator place missing from the RTT matrix is named in the error."""
    rtt = line(["c", "a"], [1.0])
    with pytest.raises(PlanError, match="no row for b"):
        Problem((node("a"), node("b")), rtt, MODEL, ("c",))
    with pytest.raises(PlanError, match="no row for far"):
        Problem((node("a"),), rtt, MODEL, ("far",))


def test_candidates_refuse_nonsense_profiles() -> None:
    """Zero or negative compute per layer, negative memory, a layerless model: PlanError."""
    with pytest.raises(PlanError, match="positive"):
        Candidate("a", GIB, 0.0, 1.0)
    with pytest.raises(PlanError, match="memory"):
        Candidate("a", -1, 1.0, 1.0)
    with pytest.raises(PlanError, match="at least one layer"):
        ModelFacts(0, GIB)


# --- the split --------------------------------------------------------------------------------


def test_faster_nodes_take_more_layers() -> None:
    """Twice as fast holds twice the layers, so both stages take the same time."""
    assert balanced_counts([1.0, 2.0], [100, 100], 12) == (8, 4)
    assert balanced_counts([2.0, 1.0, 1.0], [100, 100, 100], 10) == (2, 4, 4)


def test_memory_caps_the_split() -> None:
    """A fast node that is full passes the rest to slower ones; too little room is None."""
    assert balanced_counts([1.0, 3.0], [3, 100], 8) == (3, 5)
    assert balanced_counts([1.0, 1.0], [3, 3], 8) is None
    assert balanced_counts([1.0, 1.0, 1.0], [9, 9, 9], 2) is None  # more stages than layers


def test_the_ends_also_hold_embedding_and_head() -> None:
    """Capacity at the first and last position leaves room for the embedding and head."""
    n = node("a", mem=5)
    assert capacity(n, MODEL, first=False, last=False) == 5
    assert capacity(n, MODEL, first=True, last=False) == 4
    assert capacity(n, MODEL, first=True, last=True) == 3
    assert capacity(node("b", mem=0), MODEL, first=True, last=False) == -1


def test_even_split_matches_the_specs_auto() -> None:
    """The remainder goes to the earliest stages, as ``layers = "auto"`` does."""
    assert even_counts(3, 10) == (4, 3, 3)
    assert blocks_of((4, 3, 3)) == ((0, 4), (4, 7), (7, 10))
    assert even_counts(4, 3) is None


# --- planning ---------------------------------------------------------------------------------


def test_ring_order_follows_the_map_not_the_file() -> None:
    """Nodes listed out of geographic order are visited along the line, coordinator at an end."""
    rtt = line(["c", "a", "b", "d"], [2.0, 2.0, 2.0])
    cands = (node("d", mem=4), node("a", mem=4), node("b", mem=4))  # file order: d, a, b
    found = plan(Problem(cands, rtt, MODEL, ("c",)))
    assert [s.node for s in found.stages] in (["a", "b", "d"], ["d", "b", "a"])
    assert found.latency_ms == pytest.approx(6.0)  # c->a->b->d->c: (2 + 2 + 2 + 6) / 2
    even = found.alternatives[0]
    assert even.label.startswith("even split in file order")
    assert even.lap_ms is not None and even.lap_ms > found.lap_ms


def test_coordinator_goes_where_the_ring_is() -> None:
    """Of two coordinator places, the one next to the nodes wins; the other is explained."""
    rtt = line(["near", "a", "b", "far"], [1.0, 1.0, 100.0])
    found = plan(Problem((node("a", mem=6), node("b", mem=6)), rtt, MODEL, ("far", "near")))
    assert found.coordinator == "near"
    lost = [a for a in found.alternatives if a.label == "coordinator at far"]
    assert lost and lost[0].lap_ms is not None and lost[0].lap_ms > found.lap_ms
    assert "latency" in lost[0].why


def test_spare_nodes_become_standbys() -> None:
    """A node the best ring does not need is a standby, in file order."""
    rtt = line(["c", "a", "b", "x"], [1.0, 1.0, 50.0])
    cands = (node("x", mem=20), node("a", mem=20), node("b", mem=20))
    found = plan(Problem(cands, rtt, MODEL, ("c",)))
    assert [s.node for s in found.stages] == ["a"]
    assert found.standbys == ("x", "b")


def test_two_unreachable_neighbours_talk_through_a_relay() -> None:
    """An edge between two nodes behind NAT is routed via a reachable place and named."""
    rtt = line(["c", "a", "b"], [1.0, 1.0])
    cands = (node("a", mem=6, reachable=False), node("b", mem=6, reachable=False))
    found = plan(Problem(cands, rtt, MODEL, ("c",)))
    middle = [h for h in found.hops if h.src in ("a", "b") and h.dst in ("a", "b")]
    assert middle and middle[0].via == "c"
    assert middle[0].ms > rtt.hop_ms(middle[0].src, middle[0].dst)


def test_pinned_boundaries_go_to_trusted_nodes() -> None:
    """With pinning, the first and last stages are trusted even when others are closer."""
    rtt = line(["c", "u", "t1", "t2"], [1.0, 20.0, 1.0])
    cands = (node("u", mem=20), node("t1", mem=5, trusted=True), node("t2", mem=5, trusted=True))
    free = plan(Problem(cands, rtt, MODEL, ("c",)))
    assert [s.node for s in free.stages] == ["u"]
    pinned = plan(Problem(cands, rtt, MODEL, ("c",), pin_boundaries=True))
    names = [s.node for s in pinned.stages]
    assert {names[0], names[-1]} <= {"t1", "t2"}
    assert pinned.lap_ms > free.lap_ms


def test_pinning_without_trusted_nodes_says_what_to_do() -> None:
    """No trusted candidate, or trusted ones too small for the ends: a PlanError with a fix."""
    rtt = line(["c", "a", "b"], [1.0, 1.0])
    with pytest.raises(PlanError, match="mark nodes trusted or unpin"):
        plan(Problem((node("a"), node("b")), rtt, MODEL, ("c",), pin_boundaries=True))
    tiny = (node("a", mem=1, trusted=True), node("b", mem=100))
    with pytest.raises(PlanError, match="trusted nodes at both ends"):
        plan(Problem(tiny, rtt, MODEL, ("c",), pin_boundaries=True))


def test_too_little_memory_is_a_clear_error() -> None:
    """When the candidates cannot hold the model the error gives both sizes and the fix."""
    rtt = line(["c", "a", "b"], [1.0, 1.0])
    with pytest.raises(PlanError, match=r"hold 4\.0 GiB .* needs 10\.0 GiB.*add nodes"):
        plan(Problem((node("a", mem=2), node("b", mem=2)), rtt, MODEL, ("c",)))
    lumpy = ModelFacts(n_layers=2, layer_bytes=3 * GIB)
    with pytest.raises(PlanError, match="no ring of the candidates fits"):
        plan(Problem((node("a", mem=4), node("b", mem=2)), rtt, lumpy, ("c",)))


def test_beyond_the_exact_limit_the_nearest_are_searched() -> None:
    """With more than 12 candidates the 12 nearest a coordinator place are searched and the
    plan says it used the heuristic; far ones are standbys."""
    names = [f"n{i:02d}" for i in range(EXACT_LIMIT + 3)]
    rtt = line(["c", *names], [1.0] * len(names))
    cands = tuple(node(n, mem=2) for n in reversed(names))
    problem = Problem(cands, rtt, ModelFacts(6, GIB), ("c",))
    kept = pool(problem)
    assert set(kept) == set(names[:EXACT_LIMIT])
    found = plan(problem)
    assert found.method.startswith("heuristic")
    assert set(found.standbys) >= set(names[EXACT_LIMIT:])


def test_a_fixed_ring_longer_than_the_exact_limit_is_chained_nearest_first() -> None:
    """A ring of exactly 16 stages (a formation's ``stages = 16``) is past the exact search:
    the 16 nodes nearest the coordinator place, each next stage the nearest left, every layer
    held once within memory; the farther nodes stand by. Before, no ring was found at all (the
    soak of issue 40: "no ring ... among the 12 candidates the heuristic keeps")."""
    names = [f"n{i:02d}" for i in range(20)]
    rtt = line(["c", *names], [1.0] * len(names))
    cands = tuple(node(n, mem=3) for n in reversed(names))  # file order is not ring order
    model = ModelFacts(30, GIB, embedding_bytes=GIB, head_bytes=GIB)
    found = plan(Problem(cands, rtt, model, ("c",), ring_size=16))
    assert [s.node for s in found.stages] == names[:16]
    assert found.blocks()[0][0] == 0 and found.blocks()[-1][1] == 30
    assert all(a[1] == b[0] for a, b in itertools.pairwise(found.blocks()))
    assert all(s.weight_bytes <= 3 * GIB for s in found.stages)
    assert set(found.standbys) == set(names[16:])
    assert found.method.startswith("heuristic: a chain of the 16")
    small_near = tuple(node(n, mem=1 if n < "n16" else 100) for n in names)
    with pytest.raises(PlanError, match=r"among the 16 candidates .* with exactly 16 stages"):
        plan(Problem(small_near, rtt, model, ("c",), ring_size=16))  # the 16 nearest too small


def test_a_chained_ring_keeps_trusted_nodes_at_its_ends_when_pinned() -> None:
    names = [f"n{i:02d}" for i in range(16)]
    rtt = line(["c", *names], [1.0] * len(names))
    cands = tuple(node(n, mem=3, trusted=n in ("n05", "n09")) for n in names)
    model = ModelFacts(30, GIB, embedding_bytes=GIB, head_bytes=GIB)
    found = plan(Problem(cands, rtt, model, ("c",), ring_size=14, pin_boundaries=True))
    ring = [s.node for s in found.stages]
    assert (ring[0], ring[-1]) == ("n05", "n09") and len(ring) == 14


def test_pool_keeps_trusted_nodes_when_pinned() -> None:
    """The heuristic's pool always holds the two nearest trusted nodes when pinning."""
    names = [f"n{i:02d}" for i in range(EXACT_LIMIT + 2)]
    rtt = line(["c", *names], [1.0] * len(names))
    cands = tuple(node(n, trusted=n in ("n12", "n13")) for n in names)
    kept = pool(Problem(cands, rtt, ModelFacts(6, GIB), ("c",), pin_boundaries=True))
    assert {"n12", "n13"} <= set(kept) and len(kept) == EXACT_LIMIT


# --- re-planning ------------------------------------------------------------------------------


def _three() -> Problem:
    rtt = line(["c", "a", "b", "d", "s"], [1.0, 1.0, 1.0, 1.0])
    cands = (node("a", mem=4), node("b", mem=4), node("d", mem=4), node("s", mem=4))
    return Problem(cands, rtt, ModelFacts(9, GIB), ("c",))


def test_replan_gives_the_dead_block_to_a_standby() -> None:
    """The standby takes exactly the dead stage's block; nothing else moves."""
    problem = _three()
    before = plan(problem)
    assert len(before.stages) == 3 and before.standbys == ("s",)
    dead = before.stages[1]
    after = replan(before, dead.node, problem)
    assert after.block_of("s") == (dead.first, dead.last)
    assert moved_layers(before, after) == dead.layers
    assert after.standbys == ()
    assert "standby s" in after.method
    assert any(a.label == "a fresh plan" for a in after.alternatives)


def test_replan_lets_neighbours_absorb_when_no_standby_fits() -> None:
    """With no standby the neighbours split the dead block between them, sticky."""
    rtt = line(["c", "a", "b", "d"], [1.0, 1.0, 1.0])
    problem = Problem((node("a", 8), node("b", 8), node("d", 8)), rtt, ModelFacts(9, GIB), ("c",))
    # the ring as it runs (an operator asked for three stages)
    before = evaluate(Mesh(problem), "c", ["a", "b", "d"], [3, 3, 3], "given")
    after = replan(before, "b", problem)
    assert [s.node for s in after.stages] == ["a", "d"]
    assert after.block_of("a") == (0, after.stages[0].last) and after.stages[0].last >= 3
    assert after.block_of("d") == (after.stages[0].last, 9)
    assert moved_layers(before, after) == 3
    assert "absorb" in after.method


def test_replan_with_standbys_only_never_grows_a_running_block() -> None:
    """``neighbours=False`` (the live scheduler): with no standby there is no plan, and the
    error says standbys only were asked and what to add."""
    rtt = line(["c", "a", "b", "d"], [1.0, 1.0, 1.0])
    problem = Problem((node("a", 8), node("b", 8), node("d", 8)), rtt, ModelFacts(9, GIB), ("c",))
    before = evaluate(Mesh(problem), "c", ["a", "b", "d"], [3, 3, 3], "given")
    with pytest.raises(PlanError, match=r"standbys only were asked.*add a standby"):
        replan(before, "b", problem, neighbours=False)
    with_standby = _three()
    first = plan(with_standby)
    after = replan(first, first.stages[1].node, with_standby, neighbours=False)
    assert after.block_of("s") == (first.stages[1].first, first.stages[1].last)


def test_replan_that_cannot_fit_says_what_to_add() -> None:
    """A dead stage whose block nobody can take: a PlanError asking for a standby."""
    rtt = line(["c", "a", "b"], [1.0, 1.0])
    problem = Problem((node("a", 3), node("b", 3)), rtt, ModelFacts(4, GIB), ("c",))
    before = plan(problem)
    with pytest.raises(PlanError, match="add a standby with room for"):
        replan(before, before.stages[0].node, problem)


def test_a_dead_standby_or_coordinator_place_moves_no_layer() -> None:
    """Losing a standby only shortens the list; losing the coordinator's place moves it."""
    rtt = line(["c", "a", "b", "d", "s", "c2"], [1.0, 1.0, 1.0, 1.0, 10.0])
    problem = attrs.evolve(_three(), rtt=rtt, coordinators=("c", "c2"))
    before = plan(problem)
    assert before.coordinator == "c" and before.standbys == ("s",)
    after = replan(before, "s", problem)
    assert after.blocks() == before.blocks() and after.standbys == ()
    moved = replan(before, "c", problem)
    assert moved.coordinator == "c2" and moved.blocks() == before.blocks()
    assert moved.ring()[1:-1] == before.ring()[1:-1]
    with pytest.raises(PlanError, match="not part of the plan"):
        replan(before, "nobody", problem)


def _brute_byte_counts(sizes: list[int], n_stages: int, embedding: int, head: int) -> int:
    """The least largest-stage bytes over every contiguous split, by enumeration."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        counts = [b - a for a, b in itertools.pairwise(bounds)]
        worst = max(stage_bytes(sizes, counts, embedding=embedding, head=head))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_byte_counts_reach_the_brute_force_minimum() -> None:
    """On 300 seeded random models (layers of unequal sizes, embedding and head of any
    weight), ``byte_counts`` finds a contiguous split whose largest stage is as small as the
    best of every split, and its counts tile the layers."""
    seed = 31
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 12)
        sizes = [rng.choice((rng.randint(1, 20), rng.randint(50, 200))) for _ in range(n)]
        stages = rng.randint(1, n)
        embedding, head = rng.randint(0, 300), rng.randint(0, 300)
        counts = byte_counts(sizes, stages, embedding=embedding, head=head)
        assert counts is not None
        assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
        got = max(stage_bytes(sizes, counts, embedding=embedding, head=head))
        assert got == _brute_byte_counts(sizes, stages, embedding, head), f"seed {seed}"


def test_byte_counts_on_equal_layers_is_the_even_split() -> None:
    """Equal layers and no embedding or head: the even split (remainder to the earliest)."""
    assert byte_counts([7] * 30, 3, embedding=0, head=0) == (10, 10, 10)
    assert byte_counts([7] * 31, 3, embedding=0, head=0) == (11, 10, 10)
    assert byte_counts([7] * 3, 4, embedding=0, head=0) is None


def test_byte_counts_move_layers_off_the_embedding_stage() -> None:
    """A heavy embedding (Gemma's is most of its bytes) leaves the first stage fewer
    layers; dense first layers of a mixture-of-experts model weigh less than the rest."""
    counts = byte_counts([10] * 18, 3, embedding=100, head=0)
    assert counts is not None and counts[0] < counts[1]
    moe = [5, 5, 5] + [40] * 9
    counts = byte_counts(moe, 3, embedding=0, head=0)
    assert counts is not None and counts[0] > counts[2]


def test_the_search_splits_with_the_capacities_it_computed_once() -> None:
    """``Search.counts`` (capacities computed once per node and place) gives the split that
    ``capacity`` computed for each call gave, for every subset and pair of ends of 200
    seeded problems with tight memory at the ends."""
    from shard.placement.search import Search

    rng = random.Random(40)
    for _ in range(200):
        n = rng.randint(1, 5)
        names = [f"n{i}" for i in range(n)]
        nodes = tuple(
            Candidate(name, rng.randint(1, 6) * GIB, rng.uniform(0.5, 2), rng.uniform(0.5, 2))
            for name in names
        )
        model = ModelFacts(
            rng.randint(1, 10), GIB, rng.randint(0, 3) * GIB, rng.randint(0, 3) * GIB
        )
        rtt = line([*names, "c"], [rng.uniform(1, 9) for _ in names])
        search = Search(Mesh(Problem(nodes, rtt, model, ("c",))), names)
        for mask in range(1, 1 << n):
            members = [i for i in range(n) if mask >> i & 1]
            for f, t in itertools.product(members, repeat=2):
                caps = [capacity(nodes[i], model, first=i == f, last=i == t) for i in members]
                times = [nodes[i].ms_per_layer_chunk for i in members]
                want = balanced_counts(times, caps, model.n_layers)
                assert search.counts(mask, f, t) == want, (mask, f, t)


def test_pool_and_candidate_lookups_are_unchanged_at_hundreds_of_candidates() -> None:
    """At 300 candidates with many tied round trips, the pool is the 12 nearest with ties in
    file order (as ranking by ``names.index`` gave it), and ``candidate`` finds each by
    name and refuses an unknown one."""
    rng = random.Random(41)
    names = [f"n{i}" for i in range(300)]
    far = {n: float(rng.randint(1, 20)) for n in names} | {"c": 0.0}
    pairs = {(a, b): far[a] + far[b] for a in far for b in far if a < b}
    rtt = RttMatrix.symmetric([*names, "c"], pairs)
    nodes = tuple(node(n, trusted=rng.random() < 0.2) for n in names)
    for pinned in (False, True):
        problem = Problem(nodes, rtt, MODEL, ("c",), pin_boundaries=pinned)
        ranked = sorted(names, key=lambda n: (2 * problem.rtt.rtt(n, "c"), names.index(n)))
        keep = [n for n in ranked if problem.candidate(n).trusted][:2] if pinned else []
        keep += [n for n in ranked if n not in keep][: EXACT_LIMIT - len(keep)]
        assert pool(problem) == tuple(n for n in names if n in keep)
        assert all(problem.candidate(n) is c for n, c in zip(names, nodes, strict=True))
    with pytest.raises(PlanError, match="no candidate node 'x'"):
        problem.candidate("x")
