"""The scheduler at internet scale (issue 40, point 4): form, place and repair swarms of 50 to
1,000 simulated nodes with the real scheduler, formation and planner in virtual time
(``shard.testing.swarm_sim``; the world: ``shard.testing.swarm_world``), and time the
scheduler's own decisions on the wall clock as the swarm grows.

Two parts, side by side in one run:

- **simulation** (per size, ``--seeds`` worlds): virtual time to form (from the first arrival,
  and from the ``expect``-th), the formed ring and its predicted lap, each repair's detection,
  splice and total time and the lap after it, whether the ring serves at the end, and the
  wall time the scheduler's calls took inside it (building the planning problem from the
  mesh, the planner, each re-plan after a death). A world whose formation fails
  (``FormationError``) is recorded with its reason.
- **decisions** (per size, ``--repeats``): the pure calls alone on the world's round trips —
  the N x N matrix, the heuristic's pool, ``plan``, and ``replan`` after stage 0 dies with
  every other node a standby — medians; and a profile of ``replan`` at the largest size.

Writes JSON (``--json``), prints Markdown tables of medians. Benchmarks are not tests.

    .venv/bin/python bench/swarm_sim.py                      # 50 .. 1000, one world each
    .venv/bin/python bench/swarm_sim.py --sizes 100 --seeds 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import time
from pathlib import Path

import attrs

from shard.formation.formation import FormationError
from shard.placement import Candidate, ModelFacts, Problem, RttMatrix, plan, replan
from shard.placement.heuristic import pool
from shard.testing.swarm_sim import POLICY, simulate
from shard.testing.swarm_world import World

RESULTS = Path(__file__).resolve().parent / "results"


def problem_of(world: World, n: int) -> Problem:
    """The planning problem of the first ``n`` nodes, as formation builds it (every pair)."""
    nodes = world.nodes[:n]
    names = [x.name for x in nodes] + ["coord"]
    rows = tuple(tuple(world.rtt_ms(a, b) for b in names) for a in names)
    m = world.model
    return Problem(
        tuple(Candidate(x.name, x.memory_bytes, x.ms_one, x.ms_chunk) for x in nodes),
        RttMatrix(tuple(names), rows),
        ModelFacts(m.n_layers, m.layer_bytes, m.embedding_bytes, m.head_bytes),
        ("coord",),
    )


def timed(fn: object, *args: object, **kw: object) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn(*args, **kw)  # type: ignore[operator]
    return time.perf_counter() - started, out


def decisions(n: int, seed: int, repeats: int) -> dict[str, object]:
    """The pure calls' wall times (medians of ``repeats``) for ``n`` candidates."""
    world = World.generate(n, seed)
    runs: dict[str, list[float]] = {"matrix_s": [], "pool_s": [], "plan_s": [], "replan_s": []}
    for _ in range(repeats):
        t, problem = timed(problem_of, world, n)
        runs["matrix_s"].append(t)
        assert isinstance(problem, Problem)
        runs["pool_s"].append(timed(pool, problem)[0])
        t, found = timed(plan, problem)
        runs["plan_s"].append(t)
        dead = found.stages[0].node  # type: ignore[attr-defined]
        runs["replan_s"].append(timed(replan, found, dead, problem, neighbours=False)[0])
    return {"n": n, **{k: statistics.median(v) for k, v in runs.items()}}


def profile_replan(n: int, seed: int) -> list[str]:
    """The top functions (own time) of one ``replan`` over ``n`` candidates."""
    problem = problem_of(World.generate(n, seed), n)
    found = plan(problem)
    prof = cProfile.Profile()
    prof.runcall(replan, found, found.stages[0].node, problem, neighbours=False)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
    return [line.strip() for line in out.getvalue().splitlines() if "(" in line][:8]


def one_sim(n: int, seed: int, args: argparse.Namespace) -> dict[str, object]:
    world = World.generate(n, seed, horizon_s=args.horizon + 600.0)
    started = time.perf_counter()
    try:
        report = simulate(
            world, expect=int(args.expect * n), horizon_s=args.horizon, ring_kills=args.kills
        )
    except FormationError as exc:
        return {"n": n, "seed": seed, "formed": False, "why": str(exc),
                "wall_s": time.perf_counter() - started}  # fmt: skip
    done = [r for r in report.repairs if r.replacement is not None]
    out = attrs.asdict(report)
    out.update(
        n=n,
        formed=True,
        nodes_ever=len(world.nodes),
        repair_median_s=report.repair_s(),
        detect_median_s=statistics.median([r.detect_s for r in done]) if done else None,
        choose_median_s=statistics.median(report.choose_wall_s) if report.choose_wall_s else None,
        laps_after_repairs=[r.lap_ms for r in done],
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="50,100,250,500,1000")
    parser.add_argument("--seeds", type=int, default=1, help="worlds per size (simulation)")
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="per size (decisions)")
    parser.add_argument("--expect", type=float, default=0.8, help="formation.expect / n")
    parser.add_argument("--horizon", type=float, default=600.0, help="virtual s after forming")
    parser.add_argument("--kills", type=int, default=3, help="injected ring deaths")
    parser.add_argument("--json", type=Path, default=RESULTS / "swarm_sim.json")
    parser.add_argument("--no-sim", action="store_true", help="the decisions part only")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",")]
    load = os.getloadavg()
    result: dict[str, object] = {
        "load_at_start": load,
        "policy": attrs.asdict(POLICY),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    result["decisions"] = rows = [decisions(n, args.seed, args.repeats) for n in sizes]
    print("| N | N x N matrix (s) | pool (s) | plan (s) | replan, N-1 standbys (s) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {r['matrix_s']:.3f} | {r['pool_s']:.4f} | {r['plan_s']:.2f} "
              f"| {r['replan_s']:.2f} |")  # fmt: skip
    result["replan_profile"] = profile_replan(sizes[-1], args.seed)
    sims: list[dict[str, object]] = []
    if not args.no_sim:
        print(
            "\n| N | seed | form (s) | after expect (s) | ring | lap (ms) | repairs "
            "(median s) | serving | problem (s) | choose (median s) | wall (s) |"
        )
        print("|---:|---:|---:|---:|---|---:|---|---|---:|---:|---:|")
        for n in sizes:
            for seed in range(args.seed, args.seed + args.seeds):
                s = one_sim(n, seed, args)
                sims.append(s)
                if not s["formed"]:
                    print(f"| {n} | {seed} | failed: {s['why']} |")
                    continue
                ring = " ".join(f"[{a},{b})" for _, a, b in s["ring"])  # type: ignore[attr-defined]
                rep = s["repair_median_s"]
                print(
                    f"| {n} | {seed} | {s['form_s']:.0f} | {s['form_after_expect_s']:.0f} | "
                    f"{ring} | {s['lap_ms']:.1f} | {len(s['repairs'])} "  # type: ignore[arg-type]
                    f"({'-' if rep is None else f'{rep:.0f}'}) | {s['not_serving'] or 'yes'} | "
                    f"{s['problem_wall_s']:.2f} | {s['choose_median_s'] or 0:.2f} | "
                    f"{s['run_wall_s']:.0f} |",
                    flush=True,
                )
                result["simulations"] = sims
                args.json.write_text(json.dumps(result, indent=1, default=str))
    result["simulations"] = sims
    result["load_at_end"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nload {load} -> {result['load_at_end']}; wrote {args.json}")


if __name__ == "__main__":
    main()
