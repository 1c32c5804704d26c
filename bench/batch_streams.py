"""Batched against unbatched stages, side by side: N concurrent greedy streams through a ring.

In one run, on the bundled SmolLM2 (CPU; fp32, or ``--dtype``) and the prompts in
``bench/prompts/``:

- ``batched-<L>ms``: a ring of ``--stages`` stage processes (generated spec, free loopback
  ports, ``layers = "auto"``, plain decoding) with ``[limits] max_batch_rows = 512`` and
  ``gather_window_s = --window`` (0.03): every chunk waiting at a stage runs in one forward
  (``shard.stage.batch``), and a stage waits up to the window for the chunks of the other
  sessions it has seen lately (never for a lone session);
- ``unbatched-<L>ms``: the same ring with ``max_batch_rows = 1`` (one forward per chunk, the
  behaviour before batching).

Every ring is up at once, and for each stream count (``--streams``, default 1,2,4,8,16) the
modes run one after the other, so a drift in the machine's load hits them alike; with
``--repeats R`` each stream count runs R times, the modes' order reversed every other time
(so neither mode always runs first after another stream count), and the summary holds each
mode's median over the repeats, the ratio of the medians and each repeat's paired ratio. A point is
``N`` requests started together (prompts round-robin, ``ignore_eos`` so each makes exactly
``--max-tokens``): aggregate tok/s (all tokens / wall time of the point), per-stream tok/s,
p50/p95 time per output token (decode laps), and each stage process's resident memory after
the point. Greedy outputs are compared with the lone stream's (``identical``), reported,
never asserted.

Writes JSON (``--json``) and, when matplotlib is installed, a PNG of aggregate tok/s against
streams next to it. Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from plain_ring import (
    REPO,
    Prompt,
    Ring,
    free_ports,
    git_info,
    machine_info,
    ring_spec_toml,
)
from shard.convert.bundled import resolve_model
from shard.messages import GenerateDone, GenerateRequest
from shard.spec.swarm import load_spec
from shard.transport import Network

Record = dict[str, Any]
MODES = {"batched": 512, "unbatched": 1}  # max_batch_rows


def modes(args: argparse.Namespace) -> dict[str, int]:
    """Every ring's mode and its ``max_batch_rows``: ``MODES`` and one ``capN`` per cap."""
    caps = [int(x) for x in args.caps.split(",") if x.strip()]
    return {**MODES, **{f"cap{n}": n for n in caps}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled model name or a checkpoint dir")
    p.add_argument("--streams", default="1,2,4,8,16", help="concurrent stream counts")
    p.add_argument("--latencies", default="0,25", help="emulated one-way ms per edge")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--prompts", type=Path, default=REPO / "bench" / "prompts")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    p.add_argument(
        "--window",
        type=float,
        default=0.03,
        help="batched rings' [limits] gather_window_s: the longest a stage waits for the\n"
        "chunks of sessions it has seen lately (never for a lone session); default 0.03",
    )
    p.add_argument(
        "--caps",
        default="",
        help="extra batched rings, one per cap: [limits] max_batch_rows = N (so a wave of\n"
        "sessions splits into convoys of at most N rows), e.g. 8,4; reported as capN",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each stream count, the modes' order reversed every other run; the\n"
        "summary holds medians over them (default 1)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the rings' [swarm] dtype: weights and activations (default float32)",
    )
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "batch_streams.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _spec_toml(
    name: str,
    ports: Sequence[int],
    latency_ms: float,
    max_rows: int,
    sessions: int,
    window: float,
    dtype: str = "float32",
) -> str:
    text = ring_spec_toml(name, ports, latency_ms).replace('"float32"', json.dumps(dtype), 1)
    text = text.replace("max_sessions = 16\n", f"max_sessions = {max(16, sessions)}\n", 1)
    limits = f"[limits]\nmax_batch_rows = {max_rows}\ngather_window_s = {window!r}\n"
    return text.replace("[limits]\n", limits, 1)


async def start(
    nursery: trio.Nursery, model_dir: Path, args: argparse.Namespace, mode: str, latency: float
) -> tuple[Ring, Path]:
    from shard.nodes.launcher import launch

    label = f"{mode}-{latency:g}ms"
    path = Path(args.workdir) / f"{label}.toml"
    name = f"batch-{label}".replace(".", "_")
    most = max(int(x) for x in args.streams.split(",") if x.strip())
    window = args.window if mode != "unbatched" else 0.0
    ports = free_ports(args.stages + 1)
    path.write_text(_spec_toml(name, ports, latency, modes(args)[mode], most, window, args.dtype))
    spec = load_spec(path)
    began = trio.current_time()
    handle = await nursery.start(
        lambda task_status: launch(path, spec, model_dir=model_dir, task_status=task_status)
    )
    up = trio.current_time() - began
    _progress(f"{label} up in {up:.1f} s")
    text = path.read_text()
    ring = Ring(label, latency, spec.name, spec.hops(), text, handle.coordinator, handle.relays, up)
    return ring, path


async def ask(network: Network, ring: Ring, prompt: Prompt, n: int, rid: int) -> GenerateDone:
    from shard.coordinator.client import request

    req = GenerateRequest(rid, prompt.text, n, chat=prompt.chat, k=0, ignore_eos=True)
    done = await request(network, ring.coordinator, req, swarm=ring.swarm)
    if done.finish_reason == "error":
        raise RuntimeError(f"{ring.mode}: {prompt.name}: {done.error}")
    return done


def stage_rss_mib(spec_path: Path) -> list[float]:
    """Resident memory of each process started with ``spec_path`` on its command line."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if str(spec_path).encode() not in cmd or b"stage" not in b" ".join(cmd):
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        rss = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS")), "0")
        out.append(int(rss) / 1024)
    return sorted(out)


async def point(
    network: Network, ring: Ring, path: Path, prompts: list[Prompt], n: int, tokens: int
) -> Record:
    """``n`` streams at once on ``ring``; what they gave."""
    done: list[GenerateDone | None] = [None] * n
    began = trio.current_time()

    async def one(i: int) -> None:
        done[i] = await ask(network, ring, prompts[i % len(prompts)], tokens, rid=i)

    async with trio.open_nursery() as streams:
        for i in range(n):
            streams.start_soon(one, i)
    wall = trio.current_time() - began
    runs = [d for d in done if d is not None]
    total = sum(d.stats.tokens for d in runs)
    tpot = sorted(d.stats.mean_lap_s for d in runs)
    return {
        "mode": ring.mode.rsplit("-", 1)[0],
        "latency_ms": ring.latency_ms,
        "streams": n,
        "prompts": len(prompts),
        "wall_s": wall,
        "aggregate_tok_s": total / wall if wall > 0 else None,
        "per_stream_tok_s": statistics.median(d.stats.tok_s for d in runs),
        "tpot_p50_s": statistics.median(tpot),
        "tpot_p95_s": tpot[min(len(tpot) - 1, round(0.95 * (len(tpot) - 1)))],
        "batch_rows": max((s.batch_rows for d in runs for s in d.stats.nodes), default=0.0),
        "per_node": _per_node(runs),
        "edges_ms": _edges_ms(runs),
        "stage_rss_mib": stage_rss_mib(path),
        "loadavg_after": list(os.getloadavg()),
        "token_ids": [list(d.token_ids) for d in runs],
    }


def _per_node(runs: Sequence[GenerateDone]) -> dict[str, Record]:
    """Per node, over every stream of a point: ms of compute and of queueing per chunk (the
    median stream's), the mean rows per forward."""
    out: dict[str, Record] = {}
    for name in sorted({s.node for d in runs for s in d.stats.nodes}):
        stats = [s for d in runs for s in d.stats.nodes if s.node == name and s.chunks]
        out[name] = {
            "compute_ms_per_chunk": statistics.median(1e3 * s.compute_s / s.chunks for s in stats),
            "queued_ms_per_chunk": statistics.median(1e3 * s.queued_s / s.chunks for s in stats),
            "batch_rows": statistics.median(s.batch_rows for s in stats),
        }
    return out


def _edges_ms(runs: Sequence[GenerateDone]) -> dict[str, float]:
    """Per ring edge, the median stream's mean one-way transit (ms; one host, one clock)."""
    names = sorted({(e.src, e.dst) for d in runs for e in d.stats.edges})
    return {
        f"{a}->{b}": statistics.median(
            1e3 * e.mean_s for d in runs for e in d.stats.edges if (e.src, e.dst) == (a, b)
        )
        for a, b in names
    }


async def run_all(model_dir: Path, prompts: list[Prompt], args: argparse.Namespace) -> list[Record]:
    from shard.transport import WebSocketNetwork

    streams = [int(x) for x in args.streams.split(",") if x.strip()]
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    points: list[Record] = []
    async with trio.open_nursery() as nursery:
        rings = [
            await start(nursery, model_dir, args, mode, lat)
            for lat in latencies
            for mode in modes(args)
        ]
        async with WebSocketNetwork() as network:
            for ring, _path in rings:  # warm-up, discarded
                await ask(network, ring, prompts[0], 4, rid=0)
            for n in streams:
                for r in range(args.repeats):
                    for ring, path in rings if r % 2 == 0 else rings[::-1]:
                        with trio.fail_after(args.timeout):
                            rec = await point(network, ring, path, prompts, n, args.max_tokens)
                        rec["repeat"] = r
                        _progress(
                            f"{ring.mode} x{n} (run {r + 1}/{args.repeats}): "
                            f"{rec['aggregate_tok_s']:.2f} tok/s in all, "
                            f"rows/forward up to {rec['batch_rows']:.1f}"
                        )
                        points.append(rec)
        nursery.cancel_scope.cancel()
    return points


def summarize(points: list[Record]) -> list[Record]:
    """Per (latency, streams): batched vs unbatched aggregate tok/s (each the median over the
    repeats), the ratio of those medians, and each repeat's own ratio (the two modes of one
    repeat ran back to back)."""
    rows = []
    lone = {(p["mode"], p["latency_ms"]): p["token_ids"][0] for p in points if p["streams"] == 1}
    for p in points:  # streams 0, P, 2P, ... ran the lone stream's prompt
        same = p["token_ids"][:: p["prompts"]]
        p["identical_to_lone"] = all(ids == lone.get((p["mode"], p["latency_ms"])) for ids in same)
    keys = sorted({(p["latency_ms"], p["streams"]) for p in points})
    for lat, n in keys:
        at = [p for p in points if (p["latency_ms"], p["streams"]) == (lat, n)]
        b = [p for p in at if p["mode"] == "batched"]
        u = [p for p in at if p["mode"] == "unbatched"]
        b_tok = statistics.median(p["aggregate_tok_s"] for p in b) if b else None
        u_tok = statistics.median(p["aggregate_tok_s"] for p in u) if u else None
        paired = [
            x["aggregate_tok_s"] / y["aggregate_tok_s"]
            for x in b
            for y in u
            if x.get("repeat", 0) == y.get("repeat", 0)
        ]
        rows.append({"latency_ms": lat, "streams": n, "batched": b_tok, "unbatched": u_tok,
                     "ratio": b_tok / u_tok if b_tok and u_tok else None,
                     "ratio_per_repeat": paired, "repeats": max(len(b), len(u)),
                     "batched_equals_unbatched": all(
                         x["token_ids"] == y["token_ids"] for x in b for y in u
                     ) if b and u else None})  # fmt: skip
    return rows


def plot(rows: list[Record], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for lat in sorted({r["latency_ms"] for r in rows}):
        pts = [r for r in rows if r["latency_ms"] == lat]
        for mode, style in (("batched", "-"), ("unbatched", ":")):
            ax.plot([r["streams"] for r in pts], [r[mode] for r in pts], style, marker="o",
                    label=f"{mode}, {lat:g} ms/edge")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _progress(line: str) -> None:
    print(f"[batch_streams] {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [Prompt.from_file(p) for p in sorted(args.prompts.glob("*.txt"))]
    model_dir = resolve_model(args.model)
    began, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shard-batch-") as tmp:
        args.workdir = tmp
        points = trio.run(run_all, model_dir, prompts, args)
    rows = summarize(points)
    result = {
        "benchmark": "batch_streams",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "wall_s": time.perf_counter() - began,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "git": git_info(),
        "machine": machine_info(),
        "config": {k: str(v) for k, v in vars(args).items() if k != "workdir"},
        "summary": rows,
        "points": points,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    for r in rows:
        print(r)
    try:
        plot(rows, args.json.with_suffix(".png"))
    except ImportError:
        _progress("matplotlib not installed: no PNG")
    _progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
