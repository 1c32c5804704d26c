"""Measured vs predicted lap: the planner's plan on ``specs/geography/world.toml`` and worse
alternatives, each run as a real ring of processes behind its emulated latencies.

For each plan, ``shard.placement.emulate`` writes a loopback spec: the plan's coordinator and
stages (named as in the geography), its blocks mapped onto the local model, and on every hop of
the ring a ``[[links.edge]]`` one-way latency of ``--scale`` x the plan's (half the geography's
round trip; the launcher's delaying relay in user space). ``shard.nodes.launcher.launch`` starts
each ring; every ring is up at once and requests are interleaved round by round, so a drift in
the machine's load hits every plan alike. Each request is plain decoding (``k = 0``: one lap,
one token) of ``--tokens`` tokens with EOS ignored; a lap is the interval between two streamed
tokens at the client (prefill left out), pooled over ``--rounds`` requests.

Prediction, per plan: emulated latency (sum over hops) + the compute the ring reported for the
same requests (median over rounds of the per-lap compute summed over stages). Compute is this
machine's CPU running the local model, not the geography's GPUs: the check is of the latency
model. Also recorded: the planner's own geography prediction (``lap_one_token_ms``: latency +
the geography's per-layer compute) and whether the plans' order by it, by the emulated
prediction and by the measured median agree.

Writes ``bench/results/lap_geography.json``; prints a Markdown table. Benchmarks are not tests:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from shard.cli.benchmark.geolap import (
    LapRun,
    Tolerance,
    measure,
    quantile,
    start_plan,
    write_plan_spec,
)
from shard.cli.benchmark.ringspec import free_ports
from shard.placement import Plan, Problem, plan, read_geography
from shard.placement.emulate import scaled_blocks
from shard.placement.lap import Mesh, evaluate
from shard.placement.planner import baseline
from shard.spec.swarm import SwarmSpec

REPO = Path(__file__).resolve().parent.parent
PROMPT = "the river runs to the sea and the sea runs to the river"
Record = dict[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/lap_geography.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (~6 min on a loaded 2-core box): .venv/bin/python bench/lap_geography.py",
    )
    p.add_argument("--geography", type=Path, default=REPO / "specs/geography/world.toml")
    p.add_argument("--scale", type=float, default=1.0, help="latency scale (default 1.0)")
    p.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--rounds", type=int, default=4, help="requests per plan (default 4)")
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (shard.testing.make_tiny_checkpoint, 16 layers, random weights: compute "
        "is small next to latency), 'smollm2', or a checkpoint dir (default tiny)",
    )
    p.add_argument("--no-even", action="store_true", help="leave out the 12-stage even split")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/lap_geography.json")
    p.add_argument("--request-timeout", type=float, default=300.0)
    return p.parse_args(argv)


def plans(geography_path: Path, with_even: bool) -> list[tuple[str, Plan]]:
    """The planner's plan and worse ones: the same ring with the coordinator moved out of its
    region (coord-iad), the best plan with the coordinator at coord-tyo, the even split in file
    order (12 stages)."""
    data = tomllib.loads(geography_path.read_text(encoding="utf-8"))
    g = read_geography(data, str(geography_path))
    assert g.model is not None
    problem = Problem(g.nodes, g.rtt, g.model, g.coordinators, g.pin_boundaries)
    chosen = plan(problem)
    mesh = Mesh(problem)
    order = [s.node for s in chosen.stages]
    counts = [s.layers for s in chosen.stages]
    found = [("planner", chosen)]
    moved = evaluate(mesh, "coord-iad", order, counts, "planner's ring, coordinator at coord-iad")
    found.append(("ring-coord-iad", moved))
    found.append(("best-coord-tyo", plan(attrs.evolve(problem, coordinators=("coord-tyo",)))))
    if with_even:
        _, even = baseline(mesh)
        if isinstance(even, Plan):
            found.append(("even-file-order", even))
    return found


def model_dir_of(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from shard.testing import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp / "tiny", seed=3, n_layers=16, max_position_embeddings=1024)
    from shard.convert.bundled import resolve_model

    return resolve_model(name)


async def run_all(
    found: list[tuple[str, Plan]],
    model_dir: Path,
    n_layers: int,
    args: argparse.Namespace,
    tmp: Path,
) -> list[tuple[SwarmSpec, list[LapRun]]]:
    from shard.transport import WebSocketNetwork

    rids = itertools.count(1)
    all_ports = iter(free_ports(sum(len(p.stages) + 1 for _, p in found)))  # distinct, at once
    started: dict[int, tuple[SwarmSpec, str]] = {}
    async with trio.open_nursery() as nursery:

        async def up(i: int, label: str, p: Plan) -> None:
            path = tmp / f"{label}.toml"
            ports = [next(all_ports) for _ in range(len(p.stages) + 1)]
            spec = write_plan_spec(
                p, path, name=f"lap-{label}", model_dir=model_dir, n_layers=n_layers,
                ports=ports, scale=args.scale,
            )  # fmt: skip
            began = time.perf_counter()
            handle = await start_plan(nursery, path, spec, model_dir, stderr=subprocess.DEVNULL)
            _progress(f"{label} up in {time.perf_counter() - began:.1f} s: {handle.relays}")
            started[i] = (spec, handle.coordinator)

        async with trio.open_nursery() as starting:  # every ring starts at once
            for i, (label, p) in enumerate(found):
                starting.start_soon(up, i, label, p)
        specs = [started[i] for i in range(len(found))]
        runs: list[list[LapRun]] = [[] for _ in specs]
        async with WebSocketNetwork() as network:
            for spec, address in specs:  # warm-up, discarded
                await measure(
                    network, address, spec, prompt=PROMPT, tokens=4, rid=next(rids),
                    timeout_s=args.request_timeout,
                )  # fmt: skip
            for r in range(args.rounds):
                for (spec, address), into in zip(specs, runs, strict=True):
                    run = await measure(
                        network, address, spec, prompt=PROMPT, tokens=args.tokens,
                        rid=next(rids), timeout_s=args.request_timeout,
                    )  # fmt: skip
                    into.append(run)
                    _progress(f"round {r}: {spec.name} median lap {run.median_ms:.1f} ms")
        nursery.cancel_scope.cancel()
    return [(spec, r) for (spec, _), r in zip(specs, runs, strict=True)]


def summarize(
    label: str, p: Plan, spec: SwarmSpec, runs: list[LapRun], n_layers: int, tol: Tolerance
) -> Record:
    laps = [lap for r in runs for lap in r.laps_ms]
    compute = statistics.median(r.compute_ms for r in runs)
    latency = runs[0].latency_ms
    predicted = latency + compute
    median = statistics.median(laps)
    hops = len(p.hops)
    return {
        "label": label,
        "ring": list(p.ring()),
        "blocks_geography": [list(b) for b in p.blocks()],
        "blocks_local": [list(b) for b in scaled_blocks(p, n_layers)],
        "hops": [{"src": h.src, "dst": h.dst, "plan_ms": h.ms, "via": h.via} for h in p.hops],
        "planner_latency_ms": p.latency_ms,
        "planner_lap_one_token_ms": p.lap_one_token_ms,
        "emulated_latency_ms": latency,
        "measured_compute_ms": compute,
        "predicted_ms": predicted,
        "laps": len(laps),
        "median_ms": median,
        "p10_ms": quantile(laps, 0.10),
        "p90_ms": quantile(laps, 0.90),
        "ring_mean_lap_ms": statistics.median(r.ring_mean_lap_ms for r in runs),
        "transit_ms": statistics.median(r.transit_ms for r in runs),
        "edge_overhead_per_hop_ms": (statistics.median(r.transit_ms for r in runs) - latency)
        / hops,
        "ratio": median / predicted,
        "overhead_ms": median - predicted,
        "overhead_per_hop_ms": (median - predicted) / hops,
        "allowed_ms": tol.allowed_ms(predicted, hops),
        "within_tolerance": tol.holds(median, predicted, hops),
        "rounds": [r.as_json() for r in runs],
        "spec_name": spec.name,
    }


def order_of(rows: Sequence[Record], key: str) -> list[str]:
    return [r["label"] for r in sorted(rows, key=lambda r: r[key])]


def table(rows: Sequence[Record]) -> str:
    out = [
        "| plan | ring | planner lap (GPU, ms) | emulated latency | measured compute | "
        "predicted | measured median (p10-p90) | ratio | within tolerance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['label']} | {' -> '.join(r['ring'])} | {r['planner_lap_one_token_ms']:.1f} | "
            f"{r['emulated_latency_ms']:.1f} | {r['measured_compute_ms']:.1f} | "
            f"{r['predicted_ms']:.1f} | {r['median_ms']:.1f} ({r['p10_ms']:.1f}-"
            f"{r['p90_ms']:.1f}) | {r['ratio']:.2f} | {r['within_tolerance']} |"
        )
    return "\n".join(out)


def _progress(line: str) -> None:
    print(f"[lap_geography] {line}", file=sys.stderr, flush=True)


def _git() -> Record:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": len(git("status", "--porcelain").splitlines()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from shard.model.config import ModelConfig

    tol = Tolerance()
    found = plans(args.geography, not args.no_even)
    began = time.perf_counter()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shard-lapgeo-") as name:
        tmp = Path(name)
        model_dir = model_dir_of(args.model, tmp)
        n_layers = ModelConfig.from_dir(model_dir).n_layers
        results = trio.run(run_all, found, model_dir, n_layers, args, tmp)
    rows = [
        summarize(label, p, spec, runs, n_layers, tol)
        for (label, p), (spec, runs) in zip(found, results, strict=True)
    ]
    base = rows[0]
    for r in rows:
        r["vs_planner_measured_ms"] = r["median_ms"] - base["median_ms"]
        r["vs_planner_predicted_ms"] = r["predicted_ms"] - base["predicted_ms"]
    orders = {
        "planner_geography": order_of(rows, "planner_lap_one_token_ms"),
        "predicted_emulated": order_of(rows, "predicted_ms"),
        "measured": order_of(rows, "median_ms"),
    }
    result = {
        "benchmark": "lap_geography",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "wall_s": time.perf_counter() - began,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "git": _git(),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "config": {
            "geography": str(
                args.geography.relative_to(REPO)
                if args.geography.is_relative_to(REPO)
                else args.geography
            ),
            "model": args.model,
            "n_layers": n_layers,
            "scale": args.scale,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "decoding": "plain (k = 0), greedy, EOS ignored: one lap per token",
            "lap": "interval between consecutive streamed tokens at the client, prefill left out",
            "emulated": "one-way latency per hop in user space (delaying relay per edge); "
            "compute is this machine's CPU, not the geography's GPUs; reachability not emulated",
            "tolerance": {"rel": tol.rel, "per_hop_ms": tol.per_hop_ms},
        },
        "plans": rows,
        "orders": orders,
        "order_measured_matches_predicted": orders["measured"] == orders["predicted_emulated"],
        "order_measured_matches_planner": orders["measured"] == orders["planner_geography"],
        "planner_fastest_measured": orders["measured"][0] == "planner",
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(table(rows))
    print(f"\norders: {json.dumps(orders)}")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
