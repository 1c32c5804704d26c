"""What a stage's forward costs on this machine by rows per forward, and what two threads add.

The batched ring's lap at N streams is bounded below by its links and by its stages' N-row
forwards run one after another (one convoy of N sessions rides the ring); this measures the
second term in one process, with nothing else running:

- per block of the bundled SmolLM2 split as a 3-stage ring splits it (``layers = "auto"``:
  10/10/10, the tail with the head), the packed forward (``shard.model.packed``, each row a
  decode step of its own session at positions ~100) for 1, 2, 4, 8, 16 and 32 rows: the
  median of ``--runs`` timed runs after two warm-ups, at 1 and at 2 torch threads;
- a plain GEMM the shape of SmolLM2's MLP (64 rows): GFLOP/s at 1 and 2 threads, which
  says how much floating-point throughput the machine's second core really adds (on a VM
  the two "cores" may share one physical core's vector units).

``--dtype bfloat16`` runs both in bf16 (weights and activations, as a spec's ``dtype`` does;
fp32 by default).

Writes JSON (``--json``). A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from plain_ring import REPO, git_info, machine_info
from shard.convert.bundled import resolve_model
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.packed import Segment, forward_packed

BLOCKS = ((0, 10), (10, 20), (20, 30))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled model name or a checkpoint dir")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="rows per forward")
    p.add_argument("--threads", default="1,2", help="torch thread counts")
    p.add_argument("--runs", type=int, default=9, help="timed runs per point (median)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and activations",
    )
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "forward_rows.json")
    return p.parse_args(argv)


def median_ms(fn: Callable[[], object], runs: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def gemm_gflops(threads: int, runs: int, dtype: torch.dtype = torch.float32) -> float:
    torch.set_num_threads(threads)
    w = torch.randn(4 * 1536, 576, dtype=dtype)
    x = torch.randn(64, 576, dtype=dtype)
    ms = median_ms(lambda: [x @ w.T for _ in range(20)], runs) / 20
    return 2 * 64 * 576 * w.shape[0] / (ms * 1e-3) / 1e9


def block_times(
    model_dir: Path,
    first: int,
    last: int,
    rows: Sequence[int],
    threads: int,
    runs: int,
    dtype: torch.dtype = torch.float32,
) -> dict[int, float]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_stage(model_dir, first, last, dtype=dtype)
    return {n: median_ms(forward_of(model, n), runs) for n in rows}


def forward_of(model: StageModel, n: int) -> Callable[[], object]:
    """One forward of ``n`` decode rows, each its own session's at positions ~100: a lone
    chunk as ``StageModel.forward`` (what ``shard.stage.batch`` runs for one), else packed."""
    caches = [model.new_cache(256) for _ in range(n)]
    starts = [96 + i for i in range(n)]
    d = model.config.hidden_size
    x = (
        torch.randint(0, 1000, (1, n))
        if model.is_first
        else torch.randn(1, n, d, dtype=model.dtype)
    )
    segments = [Segment(s, 1, c) for s, c in zip(starts, caches, strict=True)]

    def run() -> object:
        with torch.inference_mode():
            if n == 1:
                return model(x, starts[0], caches[0], head_rows=1 if model.is_last else None)
            return forward_packed(model, x, segments, head_rows=[1] * n if model.is_last else None)

    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    model_dir = resolve_model(args.model)
    began = time.perf_counter()
    machine = machine_info()
    gemm = {t: gemm_gflops(t, args.runs, getattr(torch, args.dtype)) for t in threads}
    print(f"[forward_rows] GEMM GFLOP/s by threads: {gemm}", file=sys.stderr, flush=True)
    blocks: list[dict[str, Any]] = []
    for first, last in BLOCKS:
        for t in threads:
            ms = block_times(model_dir, first, last, rows, t, args.runs, getattr(torch, args.dtype))
            blocks.append({"layers": [first, last], "threads": t, "ms_by_rows": ms})
            print(f"[forward_rows] [{first}, {last}) x{t}: {ms}", file=sys.stderr, flush=True)
    convoy = {
        t: {n: sum(b["ms_by_rows"][n] for b in blocks if b["threads"] == t) for n in rows}
        for t in threads
    }
    result = {
        "benchmark": "forward_rows",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "wall_s": time.perf_counter() - began,
        "git": git_info(),
        "machine": machine,
        "dtype": args.dtype,
        "gemm_gflops_by_threads": gemm,
        "blocks": blocks,
        # The three blocks' forwards one after another: a convoy's compute per lap.
        "convoy_ms_by_threads_and_rows": convoy,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"gemm": gemm, "convoy_ms": convoy}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
