"""Plain pipelined decoding, side by side: one process vs the ring of stage processes.

In one run, on the bundled SmolLM2 (fp32, CPU) and the prompts in ``bench/prompts/``:

- ``single``: the whole model in this process (``shard.decode.reference.generate_reference``);
- ``ring-<L>ms``: a coordinator and ``--stages`` stage processes started from a generated spec
  (free loopback ports, ``layers = "auto"``), with ``L`` ms of emulated one-way latency on every
  edge of the ring (a delaying relay per edge, as in ``specs/wan-sim.toml``; 0 = direct links,
  as in ``specs/local.toml``).

Plain decoding sends one token per lap, so the analytical expectation is::

    lap   ~ sum(stage compute per token) + sum(edge latencies) + wire overhead
    tok/s ~ 1 / lap

All rings are up at once and the modes are interleaved prompt by prompt, so a drift in the
machine's load hits every mode alike. Each ring prompt runs twice: a 1-token request (prefill
only) and the ``--max-tokens`` request. Their difference gives per-token decode compute per
node and decode-only edge transit, so the bound ``sum(compute) + sum(latency)`` is measured,
not guessed. Greedy output of every ring mode is compared with ``single`` and reported
(``identical``), never asserted.

Writes JSON (``--json``), prints a Markdown summary: medians over prompts, ratios vs
``single``. Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from shard.convert.bundled import resolve_model
from shard.coordinator.service import prompt_ids
from shard.messages import GenerateDone, GenerateRequest, RunStats
from shard.model.config import ModelConfig
from shard.model.tokenizer import Tokenizer
from shard.spec.nodes import EdgeSpec
from shard.spec.swarm import load_spec
from shard.transport import Network

REPO = Path(__file__).resolve().parent.parent
Record = dict[str, Any]
EXPECTATION = (
    "lap ~ sum(stage compute per token) + sum(edge latencies) + wire overhead; tok/s ~ 1/lap. "
    "bound = decode compute per token summed over the stages (measured in the same run) + the "
    "emulated latency summed over the ring's edges, with no wire cost: a lower bound on the lap."
)


@attrs.frozen
class Prompt:
    """One benchmark prompt: a file's text; files named ``*-chat.txt`` use the chat template."""

    name: str
    text: str
    chat: bool

    @classmethod
    def from_file(cls, path: Path) -> Prompt:
        text = path.read_text(encoding="utf-8").removesuffix("\n")
        return cls(name=path.stem, text=text, chat=path.stem.endswith("-chat"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/plain_ring.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (the default run, ~4 min on 2 cores): .venv/bin/python bench/plain_ring.py",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument(
        "--latencies",
        default="0,25,50",
        help="comma-separated one-way ms per ring edge, one ring mode each (default 0,25,50; "
        "add 10 for a finer curve, ~1 min more)",
    )
    p.add_argument("--stages", type=int, default=3, help="stage processes (default 3)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=REPO / "bench/prompts",
        help="dir of *.txt prompts (default bench/prompts)",
    )
    p.add_argument(
        "--model", default="smollm2", help="bundled name or checkpoint dir (default smollm2)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench/results/plain_ring.json",
        help="output file (default bench/results/plain_ring.json)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for single (default 1, what each ring node gets from "
        "shard.nodes.launcher.launch on 2 cores: cores // nodes; 0 = torch's default)",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    return p.parse_args(argv)


# -- machine and spec ------------------------------------------------------------------------


def machine_info() -> Record:
    import torch

    cpu = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "gpu": "none used (everything runs on the CPU)",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def git_info() -> Record:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip()

    changed = git("status", "--porcelain").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(changed)}


def run_record(benchmark: str, **fields: Any) -> Record:
    """The head of a benchmark's JSON: its name, command line, date, machine, commit and the
    load average before it ran, then ``fields``."""
    return {
        "benchmark": benchmark,
        "command": " ".join(sys.orig_argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_info(),
        "load_before": os.getloadavg(),
        **fields,
    }


def write_record(path: Path, record: Record) -> None:
    """Add the load average after the run to ``record`` and write it to ``path`` as JSON."""
    record["load_after"] = os.getloadavg()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports the OS calls free now (held together, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring_spec_toml(name: str, ports: Sequence[int], latency_ms: float) -> str:
    """``specs/local.toml`` / ``specs/wan-sim.toml`` with other ports, stages and latency, and
    no drafting (those specs now speculate)."""
    lines = [
        "[swarm]",
        f'name = "{name}"',
        'model = "smollm2"',
        'dtype = "float32"',
        "insecure = true",
        "",
        "[limits]",
        "max_sessions = 16\nmax_len = 2048\nprefill_chunk = 128",
        "max_message_mib = 64\nconnect_timeout_s = 10.0",
        "",
        "[coordinator]",
        'name = "coord"',
        f'listen = "127.0.0.1:{ports[0]}"',
    ]
    for i, port in enumerate(ports[1:]):
        lines += ["", "[[stage]]", f'name = "s{i}"', f'listen = "127.0.0.1:{port}"']
        lines += ['layers = "auto"']
    lines += ["", "[links]", f"latency_ms = {latency_ms:g}", "bandwidth_mbps = 0"]
    lines += ["", "[speculation]", 'draft = "none"  # plain decoding: the baseline', ""]
    return "\n".join(lines)


# -- single process --------------------------------------------------------------------------


class SingleProcess:
    """The whole model in this process: the reference every ring mode is compared with."""

    def __init__(self, model_dir: Path) -> None:
        from shard.model.loader import load_stage

        config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self._eos = tuple(dict.fromkeys((*config.eos_token_ids, *self.tokenizer.eos_ids)))
        began = time.perf_counter()
        self._model = load_stage(model_dir, 0, config.n_layers)
        self.startup_s = time.perf_counter() - began

    def run(self, prompt: Prompt, max_tokens: int) -> Record:
        """Generate (blocking: call it in a worker thread) and record one prompt."""
        from shard.decode.reference import generate_reference

        req = GenerateRequest(0, prompt.text, max_tokens, chat=prompt.chat)
        ids = prompt_ids(self.tokenizer, req)
        result = generate_reference(self._model, ids, max_tokens=max_tokens, eos_ids=self._eos)
        record = _run_record(prompt, len(ids), result.token_ids, result.finish_reason)
        record.update(_stats_record(result.stats))
        record["compute_per_token_s"] = result.stats.mean_lap_s
        record["text"] = self.tokenizer.decode(result.token_ids)
        return record


def _run_record(prompt: Prompt, n_prompt: int | None, ids: Sequence[int], finish: str) -> Record:
    """What every mode records per prompt (the ring's client never sees the prompt's ids:
    ``n_prompt`` is None there and filled in from ``single``)."""
    return {
        "prompt": prompt.name,
        "chat": prompt.chat,
        "prompt_tokens": n_prompt,
        "token_ids": list(ids),
        "finish_reason": finish,
    }


def _stats_record(stats: RunStats) -> Record:
    lap = stats.mean_lap_s
    return {
        "tokens": stats.tokens,
        "seconds": stats.seconds,
        "tok_s": stats.tok_s,
        "decode_tok_s": 1.0 / lap if lap > 0 else None,
        "prefill_s": stats.prefill_s,
        "laps": stats.laps,
        "mean_lap_s": lap,
    }


# -- the ring --------------------------------------------------------------------------------


@attrs.frozen
class Ring:
    """A running ring of processes (``shard.nodes.launcher.launch``) and what it was started
    from: its swarm name, its hops (each edge's emulated latency) and its spec's text."""

    mode: str
    latency_ms: float
    swarm: str
    hops: tuple[EdgeSpec, ...]
    spec_text: str
    coordinator: str
    relays: tuple[str, ...]
    startup_s: float

    @property
    def latency_s(self) -> dict[tuple[str, str], float]:
        return {(e.src, e.dst): e.latency_ms / 1000.0 for e in self.hops}


async def start_ring(
    nursery: trio.Nursery, model_dir: Path, stages: int, latency_ms: float, workdir: Path
) -> Ring:
    """Launch a ring with ``latency_ms`` on every edge in ``nursery``; returns once it serves."""
    from shard.nodes.launcher import launch

    mode = f"ring-{latency_ms:g}ms"
    path = workdir / f"{mode}.toml"
    name = f"bench-{latency_ms:g}ms".replace(".", "_")
    path.write_text(ring_spec_toml(name, free_ports(stages + 1), latency_ms))
    spec = load_spec(path)
    began = trio.current_time()
    handle = await nursery.start(
        lambda task_status: launch(path, spec, model_dir=model_dir, task_status=task_status)
    )
    startup_s = trio.current_time() - began
    _progress(f"{mode} up in {startup_s:.1f} s")
    return Ring(
        mode,
        latency_ms,
        spec.name,
        spec.hops(),
        path.read_text(),
        handle.coordinator,
        handle.relays,
        startup_s,
    )


async def ask(
    network: Network, ring: Ring, prompt: Prompt, max_tokens: int, *, timeout_s: float, rid: int
) -> GenerateDone:
    """One request on ``ring``; a request the ring fails is an error, not a data point."""
    from shard.coordinator.client import request

    req = GenerateRequest(rid, prompt.text, max_tokens, chat=prompt.chat, k=0)  # k=0: plain
    with trio.fail_after(timeout_s):
        done = await request(network, ring.coordinator, req, swarm=ring.swarm)
    if done.finish_reason == "error":
        raise RuntimeError(f"{ring.mode}: {prompt.name}: {done.error}")
    return done


def _ring_record(
    prompt: Prompt,
    probe: GenerateDone,
    done: GenerateDone,
    latency_s: dict[tuple[str, str], float],
) -> Record:
    """Per-prompt numbers, with decode-only compute and transit: the full run minus the
    prefill-only probe of the same prompt (None when the run stopped at its first token)."""
    record = _run_record(prompt, None, done.token_ids, done.finish_reason)
    record.update(_stats_record(done.stats))
    record.update(drafted=done.stats.drafted, tokens_per_lap=done.stats.tokens_per_lap)
    record["text"] = done.text
    probe_nodes = {n.node: n for n in probe.stats.nodes}
    probe_edges = {(e.src, e.dst): e for e in probe.stats.edges}
    decode_laps = done.stats.laps - probe.stats.laps
    nodes, edges = [], []
    for n in done.stats.nodes:
        pn = probe_nodes[n.node]
        per_token = (n.compute_s - pn.compute_s) / decode_laps if decode_laps > 0 else None
        nodes.append({**attrs.asdict(n), "decode_compute_per_token_s": per_token})
    for e in done.stats.edges:
        pe = probe_edges[(e.src, e.dst)]
        total = e.mean_s * done.stats.laps - pe.mean_s * probe.stats.laps
        decode = total / decode_laps if decode_laps > 0 else None
        lat = latency_s[(e.src, e.dst)]
        edges.append({**attrs.asdict(e), "decode_mean_s": decode, "latency_s": lat})
    record.update(nodes=nodes, edges=edges, bound=_bound(done.stats.mean_lap_s, nodes, edges))
    return record


def _bound(lap: float, nodes: list[Record], edges: list[Record]) -> Record | None:
    """lap ~ sum(compute per token) + sum(latency) + overhead; split the overhead into what the
    edges show (serialization, sockets, relays) and the rest (inside the nodes, off-compute)."""
    per_token = [n["decode_compute_per_token_s"] for n in nodes]
    transit = [e["decode_mean_s"] for e in edges]
    if None in per_token or None in transit or lap <= 0:
        return None
    compute = sum(per_token)
    latency = sum(e["latency_s"] for e in edges)
    lap_bound = compute + latency
    return {
        "compute_s": compute,
        "latency_s": latency,
        "lap_s": lap_bound,
        "tok_s": 1.0 / lap_bound,
        "lap_over_bound": lap / lap_bound,
        "overhead_s": lap - lap_bound,
        "edge_overhead_s": sum(transit) - latency,
        "other_overhead_s": lap - compute - sum(transit),
    }


# -- the run -------------------------------------------------------------------------------


async def run_all(
    single: SingleProcess,
    model_dir: Path,
    prompts: Sequence[Prompt],
    args: argparse.Namespace,
    latencies: Sequence[float],
    workdir: Path,
) -> list[Record]:
    """Every mode on every prompt, interleaved (prompt by prompt, mode by mode) so that a drift
    in the machine's load hits every mode alike; one discarded warm-up per mode first."""
    from shard.transport import WebSocketNetwork

    rids = itertools.count(1)
    async with trio.open_nursery() as nursery:
        rings = [
            await start_ring(nursery, model_dir, args.stages, lat, workdir) for lat in latencies
        ]
        modes = [_mode_record("single", None, single.startup_s)]
        modes += [_mode_record(r.mode, r.latency_ms, r.startup_s, r) for r in rings]
        async with WebSocketNetwork() as network:

            async def one(ring: Ring, prompt: Prompt, n: int) -> GenerateDone:
                timeout_s = args.request_timeout
                return await ask(network, ring, prompt, n, timeout_s=timeout_s, rid=next(rids))

            await trio.to_thread.run_sync(single.run, prompts[0], 4)
            for ring in rings:
                await one(ring, prompts[0], 4)
            for prompt in prompts:
                runs = [await trio.to_thread.run_sync(single.run, prompt, args.max_tokens)]
                for ring in rings:
                    probe = await one(ring, prompt, 1)
                    done = await one(ring, prompt, args.max_tokens)
                    runs.append(_ring_record(prompt, probe, done, ring.latency_s))
                for mode, run in zip(modes, runs, strict=True):
                    run["loadavg_1min"] = os.getloadavg()[0]
                    mode["runs"].append(run)
                tok_s = "  ".join(f"{m['mode']} {m['runs'][-1]['tok_s']:.2f}" for m in modes)
                _progress(f"{prompt.name}: tok/s {tok_s}")
        nursery.cancel_scope.cancel()
    return modes


def _mode_record(
    mode: str, latency_ms: float | None, startup_s: float, ring: Ring | None = None
) -> Record:
    record: Record = {"mode": mode, "latency_ms": latency_ms, "startup_s": startup_s}
    if ring is not None:
        record.update(relays=list(ring.relays), spec=ring.spec_text)
    record["runs"] = []
    return record


# -- summary ---------------------------------------------------------------------------------


def summarize(modes: Sequence[Record]) -> list[Record]:
    """Medians over prompts per mode, ratios of medians vs ``single``, token identity."""
    single = modes[0]
    reference = {r["prompt"]: r["token_ids"] for r in single["runs"]}
    base = _median(single["runs"], "tok_s")
    base_decode = _median(single["runs"], "decode_tok_s")
    base_lap = _median(single["runs"], "mean_lap_s")
    rows = []
    for mode in modes:
        runs = mode["runs"]
        for r in runs:
            r["identical"] = r["token_ids"] == reference[r["prompt"]]
        row: Record = {"mode": mode["mode"], "latency_ms": mode["latency_ms"]}
        for key in ("tok_s", "decode_tok_s", "mean_lap_s", "prefill_s"):
            row[f"median_{key}"] = _median(runs, key)
        row["ratio_tok_s"] = row["median_tok_s"] / base
        row["ratio_decode_tok_s"] = row["median_decode_tok_s"] / base_decode
        row["identical"] = f"{sum(r['identical'] for r in runs)}/{len(runs)}"
        if mode["latency_ms"] is not None:
            bounds = [r["bound"] for r in runs if r["bound"] is not None]
            for key in ("compute_s", "lap_s", "tok_s", "lap_over_bound", "overhead_s"):
                row[f"median_bound_{key}"] = _median(bounds, key)
            for key in ("edge_overhead_s", "other_overhead_s"):
                row[f"median_{key}"] = _median(bounds, key)
            hops = len(runs[0]["edges"])
            row["predicted_lap_from_single_s"] = base_lap + hops * mode["latency_ms"] / 1000.0
            row["median_edge_s"] = _median_by(runs, "edges", ("src", "dst"), "decode_mean_s")
            row["median_node_compute_per_token_s"] = _median_by(
                runs, "nodes", ("node",), "decode_compute_per_token_s"
            )
        rows.append(row)
    return rows


def _median(records: Sequence[Record], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _median_by(runs: Sequence[Record], part: str, key: tuple[str, ...], value: str) -> Record:
    groups: dict[str, list[float]] = {}
    for r in runs:
        for item in r[part]:
            if item[value] is not None:
                groups.setdefault("->".join(item[k] for k in key), []).append(item[value])
    return {k: statistics.median(v) for k, v in groups.items()}


def table(rows: Sequence[Record]) -> str:
    """The summary as Markdown: medians over prompts, times in ms."""

    def ms(x: float | None) -> str:
        return "–" if x is None else f"{1000 * x:.1f}"

    out = [
        "| mode | tok/s | decode tok/s | × single | prefill | lap | Σ compute | bound | "
        "lap/bound | from single | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.get("median_bound_lap_over_bound")
        out.append(
            f"| {r['mode']} | {r['median_tok_s']:.2f} | {r['median_decode_tok_s']:.2f} | "
            f"{r['ratio_tok_s']:.2f} | {ms(r['median_prefill_s'])} | "
            f"{ms(r['median_mean_lap_s'])} | {ms(r.get('median_bound_compute_s'))} | "
            f"{ms(r.get('median_bound_lap_s'))} | {'–' if ratio is None else f'{ratio:.2f}'} | "
            f"{ms(r.get('predicted_lap_from_single_s'))} | {r['identical']} |"
        )
    return "\n".join(out)


def _progress(line: str) -> None:
    print(f"[plain_ring] {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # before --threads changes this process
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    prompts = [Prompt.from_file(p) for p in sorted(args.prompts.glob("*.txt"))]
    if not prompts:
        print(f"plain_ring: no *.txt prompts in {args.prompts}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    began = time.perf_counter()
    load_start = os.getloadavg()
    single = SingleProcess(model_dir)
    with tempfile.TemporaryDirectory(prefix="shard-bench-") as tmp:
        modes = trio.run(run_all, single, model_dir, prompts, args, latencies, Path(tmp))
    n_prompt = {r["prompt"]: r["prompt_tokens"] for r in modes[0]["runs"]}
    for mode in modes[1:]:
        for r in mode["runs"]:
            r["prompt_tokens"] = n_prompt[r["prompt"]]
    rows = summarize(modes)
    result = {
        "benchmark": "plain_ring",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "wall_s": time.perf_counter() - began,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "git": git_info(),
        "machine": machine,
        "config": _config(args, latencies, prompts),
        "expectation": EXPECTATION,
        "summary": rows,
        "modes": modes,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(table(rows))
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


def _config(args: argparse.Namespace, latencies: list[float], prompts: list[Prompt]) -> Record:
    return {
        "model": args.model,
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "stages": args.stages,
        "latencies_ms": latencies,
        "prompts": [p.name for p in prompts],
        "sampling": "greedy (temperature 0)",
        "threads_single": args.threads or "torch default",
        # what shard.nodes.launcher.launch passes each node as ``shard up --threads``
        "threads_per_ring_node": max(1, (os.cpu_count() or 1) // (args.stages + 1)),
        "order": "interleaved: per prompt, single then each ring; warm-ups discarded",
    }


if __name__ == "__main__":
    sys.exit(main())
