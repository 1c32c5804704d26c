"""The q8 product against the two int4 products it replaced (issue 42), side by side.

An int8 weight in groups of 32 (GGUF's Q8_0) ran on a CPU as two int4 products (``code = 16
hi + lo``, path ``int8-split``: bf16 activations, two torch int4 kernel calls, their sum in
float32) until session 35; it now runs on ``shard.model.q8`` (path ``int8-group``: the codes
packed once, the rows rounded to 16-bit integers per group, one call of shard's own kernel;
session 35's version kept the rows in float32, docs/benchmarks.md has its figures). This
times both on random codes of the bundled models' int8 shapes (Gemma 3 270M's and SmolLM2's
tied heads, Gemma's joined gate/up and q/k/v), at 1 and 9 rows and 1 and 2 threads, calls
interleaved, medians of ``--reps``, and writes the records and each ratio
(``split_over_group``: above 1, the q8 product is faster).
Kernel calls only, cache as it falls: a benchmark, not a test; run it alone.

    .venv/bin/python bench/q8_products.py --json bench/results/q8_products.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shard.model import q8
from shard.model.quant import quantize_int8, split_int8

SHAPES = [
    ("gemma3-270m head", 262144, 640),
    ("smollm2 head", 49152, 576),
    ("gemma3-270m gate_up", 4096, 640),
    ("gemma3-270m qkv", 1536, 640),
]


def products(n: int, k: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    q = quantize_int8(torch.randn(n, k), 32)
    parts = split_int8(q, torch.bfloat16)
    packed = q8.Int8Group(q.codes, q.scale, None, 32)

    def split(x: torch.Tensor) -> torch.Tensor:  # QuantLinear's int8-split forward
        rows = x.to(torch.bfloat16)
        a, b = (p.mm(rows) for p in parts)
        return a.float() + b.float()

    def group(x: torch.Tensor) -> torch.Tensor:
        return q8.q8_mm(x, packed)

    return split, group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="timed calls of each, interleaved")
    ap.add_argument("--json", type=Path, default=Path("bench/results/q8_products.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    records = []
    load = os.getloadavg()
    for name, n, k in SHAPES:
        split, group = products(n, k)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 9):
                x = torch.randn(rows, k)
                times: dict[str, list[float]] = {"split": [], "group": []}
                for f in (split, group, split, group):  # warm-up
                    f(x)
                reps = args.reps if n > 10_000 else 20 * args.reps
                for _ in range(reps):
                    for key, f in (("split", split), ("group", group)):
                        t = time.perf_counter()
                        f(x)
                        times[key].append(time.perf_counter() - t)
                s, g = (statistics.median(times[key]) * 1e3 for key in ("split", "group"))
                rec = {"shape": name, "n": n, "k": k, "threads": threads, "rows": rows,
                       "split_ms": s, "group_ms": g, "split_over_group": s / g}  # fmt: skip
                records.append(rec)
                print(json.dumps(rec))
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "loadavg_before": load, "loadavg_after": os.getloadavg()}  # fmt: skip
    args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
