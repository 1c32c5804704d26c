"""Weights that stay quantized, side by side: what each ``weights`` format costs a stage and a ring.

In one run, on the bundled SmolLM2 (its cache holds the GGUF's Q4_1 layers and Q8_0
embedding as stored), CPU:

1. **Stages.** Per format (``--formats``: ``float32``, ``bfloat16`` with ``dtype = bfloat16``,
   ``int8`` and ``int4`` quantized at load, ``stored``; the quantized ones with float32
   activations, the default ``dtype``) and per block of a 3-stage ring split into equal layer
   counts (``SwarmSpec.blocks`` without the model's sizes: 10/10/10, the same blocks for
   every format), a fresh child process with one torch
   thread loads the block with ``load_stage(..., weights=...)`` and measures: the weight bytes it
   holds (``shard.model.footprint.measured``) and per parameter (parameters counted on the
   meta device), its resident memory before and after the load (``VmRSS``; peak ``VmHWM``),
   the load time (page cache warm after the first format), and the forward of 1 token
   (a decode step) and of K + 1 tokens (a verify chunk, K = ``SpeculationConfig().k_max`` = 8,
   the most the adaptive controller drafts by default; the tail's head on every row), each
   the median of ``--runs`` after 3 warm-ups, at position ~100 of a 256-position cache.
2. **Rings.** For ``--ring-weights`` (``float32``, ``stored``) at ``--latencies`` (0 and 25 ms
   one way per edge, emulated in user space by the launcher's delaying relays, as in
   ``plain_ring.py`` / ``specs/wan-sim.toml``): a 3-stage ring of processes (generated spec,
   free loopback ports, ``[swarm] weights``, ``[speculation] draft = "ngram"``, batching on),
   every ring up at once. Per repeat (the rings' order reversed every other repeat), per
   prompt, every ring: a plain request (``k = 0``) and a speculative one (the swarm's
   adaptive K/D policy), then every ring: ``--streams`` (16) plain streams at once.
   Every request makes exactly ``--max-tokens`` (``ignore_eos``).

Writes ``bench/results/quant_bench.json`` and, when matplotlib imports, a PNG beside it:
medians and ratios against float32, the host's CPU flags, torch's version and threads, and the
load average throughout (every process shares this CPU; on a busy host the figures move).
A benchmark, not a test: nothing here asserts a speed. ``--help`` for the knobs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import trio

from batch_streams import stage_rss_mib
from plain_ring import REPO, Prompt, free_ports, git_info, machine_info, ring_spec_toml
from shard.convert.bundled import resolve_model
from shard.decode.control import SpeculationConfig
from shard.messages import GenerateDone, GenerateRequest
from shard.model.config import ModelConfig
from shard.spec.swarm import load_spec
from shard.transport import Network

Record = dict[str, Any]
K = SpeculationConfig().k_max
DTYPE_OF = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled model name or a checkpoint dir")
    p.add_argument("--formats", default="float32,bfloat16,int8,int4,stored")
    p.add_argument("--runs", type=int, default=15, help="timed forwards per point (median)")
    p.add_argument("--ring-weights", default="float32,stored")
    p.add_argument("--latencies", default="0,25", help="emulated one-way ms per edge")
    p.add_argument("--prompts", default="01-copy,03-prose", help="names in bench/prompts/")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request")
    p.add_argument("--streams", type=int, default=16, help="concurrent plain streams")
    p.add_argument("--repeats", type=int, default=3, help="ring rounds (medians over them)")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request or point")
    p.add_argument("--skip-stages", action="store_true")
    p.add_argument("--skip-rings", action="store_true")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "quant_bench.json")
    p.add_argument("--child", nargs=3, metavar=("WEIGHTS", "FIRST", "LAST"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _progress(line: str) -> None:
    print(f"[quant_bench] {line}", file=sys.stderr, flush=True)


# -- the host --------------------------------------------------------------------------------


def host_info() -> Record:
    """``machine_info`` plus the CPU flags that decide the kernels' paths."""
    from shard.model.device import cpu_has_bf16
    from shard.model.quant import kernel_dtype

    with open("/proc/cpuinfo", encoding="utf-8") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "flags :")
    have = set(line.split(":", 1)[1].split())
    return {
        **machine_info(),
        "cpu_flags": {flag: flag in have for flag in FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_has_bf16": cpu_has_bf16(),
        "quant_kernel_dtype": str(kernel_dtype(torch.device("cpu"))).removeprefix("torch."),
    }


# -- one stage, in a child process -----------------------------------------------------------


def _status_kb(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith(key)))


def timed_ms(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median and fastest ms of ``runs`` calls after 3 warm-ups (the fastest: the least
    disturbed by other processes on a shared CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def child(model: str, weights: str, first: int, last: int, runs: int) -> Record:
    """Load ``[first, last)`` held as ``weights`` in this (fresh) process and time it."""
    from shard.model.footprint import measured
    from shard.model.llama import StageModel
    from shard.model.loader import load_stage

    torch.set_num_threads(1)
    model_dir = resolve_model(model, progress=False)
    config = ModelConfig.from_dir(model_dir)
    dtype = getattr(torch, DTYPE_OF.get(weights, "float32"))
    with torch.device("meta"):
        meta = StageModel(config, first, last)
    params = sum(p.numel() for p in meta.parameters())
    torch.zeros(64, 64) @ torch.zeros(64, 64)  # torch's own lazy setup before the baseline
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    stage = load_stage(model_dir, first, last, dtype=dtype, weights=weights)
    load_s = time.perf_counter() - t0
    rss1, hwm = _status_kb("VmRSS"), _status_kb("VmHWM")
    held = measured(stage)
    cache = stage.new_cache(256)
    forward, fastest = {}, {}
    for rows in (1, K + 1):
        x = (
            torch.randint(0, 1000, (1, rows))
            if stage.is_first
            else torch.randn(1, rows, config.hidden_size, dtype=dtype)
        )
        head = rows if stage.is_last else None

        def run(x: torch.Tensor = x, head: int | None = head) -> object:
            with torch.inference_mode():
                return stage(x, 100, cache, head_rows=head)

        forward[str(rows)], fastest[str(rows)] = timed_ms(run, runs)
    return {"weights": weights, "dtype": str(dtype).removeprefix("torch."),
            "layers": [first, last], "params": params, "weight_bytes": held,
            "bytes_per_param": held / params, "load_s": load_s, "rss_before_mib": rss0 / 1024,
            "rss_after_mib": rss1 / 1024, "rss_added_mib": (rss1 - rss0) / 1024,
            "peak_rss_mib": hwm / 1024, "forward_ms": forward,
            "forward_ms_min": fastest}  # fmt: skip


def stages(args: argparse.Namespace, blocks: Sequence[tuple[int, int]]) -> list[Record]:
    """Every (block, format) in its own child process, formats interleaved block by block."""
    out = []
    for first, last in blocks:
        for weights in _split(args.formats):
            cmd = [sys.executable, __file__, "--model", args.model, "--runs", str(args.runs),
                   "--child", weights, str(first), str(last)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rec = json.loads(done.stdout.strip().splitlines()[-1])
            rec["loadavg_after"] = list(os.getloadavg())
            _progress(
                f"[{first}, {last}) {weights}: {rec['weight_bytes'] / 2**20:.1f} MiB "
                f"({rec['bytes_per_param']:.3f} B/param), load {rec['load_s']:.2f} s, "
                f"forward 1: {rec['forward_ms']['1']:.2f} ms, {K + 1}: "
                f"{rec['forward_ms'][str(K + 1)]:.2f} ms"
            )
            out.append(rec)
    return out


def stage_summary(recs: Sequence[Record]) -> list[Record]:
    """Per format, the blocks summed (a lap's compute, the ring's bytes) and its ratios."""
    rows = []
    for weights in dict.fromkeys(r["weights"] for r in recs):
        mine = [r for r in recs if r["weights"] == weights]
        total = sum(r["weight_bytes"] for r in mine)
        rows.append({
            "weights": weights,
            "weight_mib_per_stage": [round(r["weight_bytes"] / 2**20, 2) for r in mine],
            "weight_mib": total / 2**20,
            "bytes_per_param": total / sum(r["params"] for r in mine),
            "rss_added_mib_per_stage": [round(r["rss_added_mib"], 1) for r in mine],
            "load_s": sum(r["load_s"] for r in mine),
            "forward_ms_1": sum(r["forward_ms"]["1"] for r in mine),
            f"forward_ms_{K + 1}": sum(r["forward_ms"][str(K + 1)] for r in mine),
            "forward_ms_1_fastest": sum(r["forward_ms_min"]["1"] for r in mine),
            f"forward_ms_{K + 1}_fastest": sum(r["forward_ms_min"][str(K + 1)] for r in mine),
        })  # fmt: skip
    base = next((r for r in rows if r["weights"] == "float32"), None)
    for r in rows:
        for key in ("weight_mib", "load_s", "forward_ms_1", f"forward_ms_{K + 1}",
                    "forward_ms_1_fastest", f"forward_ms_{K + 1}_fastest"):  # fmt: skip
            r[f"{key}_vs_float32"] = r[key] / base[key] if base and base[key] else None
    return rows


# -- rings -----------------------------------------------------------------------------------


def ring_toml(name: str, ports: Sequence[int], latency_ms: float, weights: str) -> str:
    text = ring_spec_toml(name, ports, latency_ms)
    text = text.replace('dtype = "float32"\n', f'dtype = "float32"\nweights = "{weights}"\n', 1)
    return text.replace('draft = "none"  # plain decoding: the baseline', 'draft = "ngram"', 1)


async def start(nursery: trio.Nursery, model_dir: Path, workdir: Path, weights: str,
                latency: float, stages_n: int) -> Record:  # fmt: skip
    from shard.nodes.launcher import launch

    label = f"{weights}-{latency:g}ms"
    path = workdir / f"{label}.toml"
    path.write_text(ring_toml(f"quant-{label}", free_ports(stages_n + 1), latency, weights))
    spec = load_spec(path)
    began = trio.current_time()
    handle = await nursery.start(
        lambda task_status: launch(path, spec, model_dir=model_dir, task_status=task_status)
    )
    up = trio.current_time() - began
    _progress(f"ring {label} up in {up:.1f} s")
    return {"label": label, "weights": weights, "latency_ms": latency, "spec": spec, "path": path,
            "coordinator": handle.coordinator, "startup_s": up}  # fmt: skip


async def ask(
    network: Network, ring: Record, prompt: Prompt, n: int, k: int, rid: int, limit_s: float
) -> GenerateDone:
    from shard.coordinator.client import request

    req = GenerateRequest(rid, prompt.text, n, chat=prompt.chat, k=k, ignore_eos=True)
    with trio.fail_after(limit_s):
        done = await request(network, ring["coordinator"], req, swarm=ring["spec"].name)
    if done.finish_reason == "error":
        raise RuntimeError(f"{ring['label']}: {prompt.name}: {done.error}")
    return done


def _single(ring: Record, mode: str, prompt: Prompt, done: GenerateDone, rep: int) -> Record:
    s = done.stats
    decode_s = s.seconds - s.prefill_s
    return {"ring": ring["label"], "weights": ring["weights"], "latency_ms": ring["latency_ms"],
            "mode": mode, "prompt": prompt.name, "repeat": rep, "tokens": s.tokens,
            "tok_s": s.tok_s,
            "decode_tok_s": (s.tokens - 1) / decode_s if decode_s > 0 else None, "laps": s.laps,
            "drafted": s.drafted, "accepted": s.accepted, "token_ids": list(done.token_ids),
            "loadavg_after": list(os.getloadavg())}  # fmt: skip


async def streams_point(
    network: Network, ring: Record, prompts: Sequence[Prompt], args: argparse.Namespace, rep: int
) -> Record:
    done: list[GenerateDone | None] = [None] * args.streams

    async def one(i: int) -> None:
        p = prompts[i % len(prompts)]
        done[i] = await ask(network, ring, p, args.max_tokens, 0, i, args.timeout)

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(args.streams):
            nursery.start_soon(one, i)
    wall = trio.current_time() - began
    runs = [d for d in done if d is not None]
    return {"ring": ring["label"], "weights": ring["weights"], "latency_ms": ring["latency_ms"],
            "mode": f"streams{args.streams}", "repeat": rep, "wall_s": wall,
            "tok_s": sum(d.stats.tokens for d in runs) / wall,
            "per_stream_tok_s": statistics.median(d.stats.tok_s for d in runs),
            "token_ids": [list(d.token_ids) for d in runs],
            "stage_rss_mib": stage_rss_mib(ring["path"]),
            "loadavg_after": list(os.getloadavg())}  # fmt: skip


async def rings(model_dir: Path, prompts: list[Prompt], args: argparse.Namespace) -> Record:
    """Every ring up at once, a discarded warm-up on each, then ``--repeats`` rounds."""
    from shard.transport import WebSocketNetwork

    out: Record = {"runs": [], "rings": []}
    with tempfile.TemporaryDirectory(prefix="shard-quant-") as tmp:
        async with trio.open_nursery() as nursery:
            up = [await start(nursery, model_dir, Path(tmp), w, lat, args.stages)
                  for lat in map(float, _split(args.latencies))
                  for w in _split(args.ring_weights)]  # fmt: skip
            out["rings"] = [{"label": r["label"], "startup_s": r["startup_s"],
                             "spec": r["path"].read_text()} for r in up]  # fmt: skip
            async with WebSocketNetwork() as net:
                for ring in up:  # warm-up, discarded: plain and speculative
                    for k in (0, -1):
                        await ask(net, ring, prompts[0], 4, k, 0, args.timeout)
                for rep in range(args.repeats):
                    order = up if rep % 2 == 0 else up[::-1]
                    out["runs"] += await one_round(net, order, prompts, args, rep)
            nursery.cancel_scope.cancel()
    return out


async def one_round(net: Network, order: Sequence[Record], prompts: Sequence[Prompt],
                    args: argparse.Namespace, rep: int) -> list[Record]:  # fmt: skip
    """Per prompt, per ring: plain then speculative; then per ring the concurrent streams."""
    runs = []
    for prompt in prompts:
        for ring in order:
            for mode, k in (("plain", 0), ("spec", -1)):
                done = await ask(net, ring, prompt, args.max_tokens, k, 1, args.timeout)
                runs.append(_single(ring, mode, prompt, done, rep))
    for ring in order:
        with trio.fail_after(args.timeout):
            rec = await streams_point(net, ring, prompts, args, rep)
        runs.append(rec)
        _progress(f"round {rep + 1}/{args.repeats} {ring['label']}: {args.streams} streams "
                  f"{rec['tok_s']:.1f} tok/s")  # fmt: skip
    return runs


def ring_summary(runs: Sequence[Record]) -> list[Record]:
    """Per (latency, mode), each ring weights' median tok/s and its ratio to float32's."""
    rows = []
    for lat, mode in dict.fromkeys((r["latency_ms"], r["mode"]) for r in runs):
        row: Record = {"latency_ms": lat, "mode": mode}
        for w in dict.fromkeys(r["weights"] for r in runs):
            mine = [r for r in runs if (r["latency_ms"], r["mode"], r["weights"]) == (lat, mode, w)]
            row[w] = statistics.median(r["tok_s"] for r in mine)
            row[f"{w}_runs"] = [round(r["tok_s"], 2) for r in mine]
            if mode in ("plain", "spec"):
                row[f"{w}_decode"] = statistics.median(r["decode_tok_s"] for r in mine)
            if mode in ("plain", "spec"):
                row[f"{w}_decode_by_prompt"] = {
                    p: statistics.median(r["decode_tok_s"] for r in mine if r["prompt"] == p)
                    for p in dict.fromkeys(r["prompt"] for r in mine)
                }
            if mode == "spec":
                row[f"{w}_accepted_of_drafted"] = [(r["accepted"], r["drafted"]) for r in mine]
        if "float32" in row:
            for w in [k for k in row if k in ("stored", "int8", "int4", "bfloat16")]:
                row[f"{w}_vs_float32"] = row[w] / row["float32"]
                if f"{w}_decode" in row:
                    row[f"{w}_decode_vs_float32"] = row[f"{w}_decode"] / row["float32_decode"]
        rows.append(row)
    return rows


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def identity(runs: Sequence[Record]) -> Record:
    """Per ring (reported, never asserted): each speculative run's output against the plain
    run of its prompt in the same round (where the first differing token is, when one does),
    plain runs equal round to round, each concurrent stream equal to the lone plain run of its
    prompt; and its stage processes' resident memory after its last concurrent point."""
    out: Record = {}
    for ring in dict.fromkeys(r["ring"] for r in runs):
        mine = [r for r in runs if r["ring"] == ring]
        plain = {(r["prompt"], r["repeat"]): r["token_ids"] for r in mine if r["mode"] == "plain"}
        spec = {(r["prompt"], r["repeat"]): _first_difference(r["token_ids"], plain[r["prompt"],
                r["repeat"]]) for r in mine if r["mode"] == "spec"}  # fmt: skip
        order = list(dict.fromkeys(p for p, _ in plain))
        first = {p: plain[p, 0] for p in order}
        streams = [ids == first[order[i % len(order)]]
                   for r in mine if r["mode"].startswith("streams")
                   for i, ids in enumerate(r["token_ids"])]  # fmt: skip
        rss = [r["stage_rss_mib"] for r in mine if "stage_rss_mib" in r]
        out[ring] = {
            "spec_equals_plain": f"{sum(d is None for d in spec.values())}/{len(spec)}",
            "spec_first_difference": {
                f"{p} round {r}": d for (p, r), d in spec.items() if d is not None
            },
            "plain_same_every_round": all(ids == first[p] for (p, _), ids in plain.items()),
            "streams_equal_lone": f"{sum(streams)}/{len(streams)}",
            "stage_rss_mib_last": [round(x, 1) for x in rss[-1]] if rss else None,
        }
    return out


# -- the plot and main ------------------------------------------------------------------------


def _bars(ax: Any, labels: Sequence[str], series: dict[str, list[float]], ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series."""
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [x + (j - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)


def plot(result: Record, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    rows = result["stages"]["summary"]
    names = [r["weights"] for r in rows]
    per_stage = {f"stage {i}": [r["weight_mib_per_stage"][i] for r in rows]
                 for i in range(len(result["blocks"]))}  # fmt: skip
    _bars(axes[0][0], names, per_stage, "weights held per stage (MiB)")
    for x, r in enumerate(rows):
        top = max(r["weight_mib_per_stage"])
        axes[0][0].annotate(f"{r['bytes_per_param']:.2f} B/param", (x, top), ha="center",
                            va="bottom", fontsize=8)  # fmt: skip
    forward = {
        f"{n} token" + "s" * (n > 1): [r[f"forward_ms_{n}"] for r in rows] for n in (1, K + 1)
    }
    _bars(axes[0][1], names, forward, "forward ms, 3 stages summed (1 thread)")
    _bars(axes[1][0], names, {"load": [r["load_s"] for r in rows]}, "load s, 3 stages summed")
    ring = result["rings"]["summary"]
    labels = [f"{r['mode']}\n{r['latency_ms']:g} ms/edge" for r in ring]
    tok = {w: [r.get(w, 0.0) for r in ring] for w in _split(result["config"]["ring_weights"])}
    _bars(axes[1][1], labels, tok, "3-stage ring tok/s (median)")
    fig.suptitle(f"SmolLM2 weights formats, {result['date']} (shared 2-core CPU: noisy)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        weights, first, last = args.child
        print(json.dumps(child(args.model, weights, int(first), int(last), args.runs)))
        return 0
    began, load_start = time.perf_counter(), os.getloadavg()
    host = host_info()
    _progress(
        f"host: {host['cpu']}; flags {[f for f, on in host['cpu_flags'].items() if on]}; "
        f"torch {host['torch']}, {host['torch_threads']} threads"
    )
    model_dir = resolve_model(args.model)
    config = ModelConfig.from_dir(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "split.toml"
        path.write_text(ring_toml("split", free_ports(args.stages + 1), 0, "float32"))
        blocks = load_spec(path).blocks(config.n_layers)
    result: Record = {
        "benchmark": "quant_bench",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "git": git_info(),
        "machine": host,
        "config": {k: str(v) for k, v in vars(args).items() if k != "child"},
        "k_plus_1": K + 1,
        "blocks": [list(b) for b in blocks],
        "noise": "every helper session shares this 2-core CPU: load average recorded throughout",
        "loadavg_start": load_start,
    }
    if not args.skip_stages:
        recs = stages(args, blocks)
        result["stages"] = {"summary": stage_summary(recs), "points": recs}
    if not args.skip_rings:
        names = _split(args.prompts)
        prompts = [Prompt.from_file(REPO / "bench" / "prompts" / f"{n}.txt") for n in names]
        ring = trio.run(rings, model_dir, prompts, args)
        ring["summary"] = ring_summary(ring["runs"])
        ring["identical"] = identity(ring["runs"])
        result["rings"] = ring
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - began
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    for part in ("stages", "rings"):
        for row in result.get(part, {}).get("summary", []):
            print(json.dumps(row))
    if "stages" in result and "rings" in result:
        try:
            plot(result, args.json.with_suffix(".png"))
        except ImportError:
            _progress("matplotlib not installed: no PNG")
    _progress(f"wrote {args.json} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
