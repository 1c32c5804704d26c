"""K-quant weights held dequantized against dequantized per call (issue 42), side by side.

For each bundled model (``--models``) and thread count (``--threads``), in this one process,
two whole-model stages of the cache entry held as stored: ``held`` as ``load_stage`` builds
it (siblings joined, K-quant weights held dequantized: ``shard.model.held``), and
``per-call`` loaded with ``join=False`` and then joined (``shard.model.fused``), which is
what ``load_stage`` built before weights were held. Each repetition (``--reps``, the order
reversed every other one) times ``--tokens`` decode steps of each after an 8-token prompt
and 4 untimed steps, and a 9-row verify chunk (median of ``--runs``); the logits of both
must be equal bit for bit (recorded, and the run stops if not). Writes
``bench/results/held_ab.json``: every repetition, the medians, the ratio per-call / held,
the bytes each stage holds and the load average before and after. A benchmark, not a test:
run it alone.

    .venv/bin/python bench/held_ab.py [--models gemma3-270m,smollm2] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from plain_ring import REPO, run_record, write_record
from quant_bench import timed_ms

K = 8  # drafted tokens in a verify chunk


def stages(model: str) -> dict[str, Any]:
    """The two stages of ``model`` (module docstring), and the paths their layers took."""
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.fused import join_siblings
    from shard.model.loader import load_stage

    model_dir = resolve_model(model, progress=False)
    n = ModelConfig.from_dir(model_dir).n_layers
    per_call = load_stage(model_dir, 0, n, weights="stored", join=False)
    join_siblings(per_call)
    return {"held": load_stage(model_dir, 0, n, weights="stored"), "per-call": per_call}


def decode(stage: Any, tokens: int) -> tuple[float, torch.Tensor]:
    """ms per decode step over ``tokens`` steps, and their logits."""
    cache = stage.new_cache(256)
    logits = stage(torch.arange(1, 9).unsqueeze(0), 0, cache, head_rows=1)
    for pos in range(8, 12):
        logits = stage(logits[0, -1].argmax().view(1, 1), pos, cache, head_rows=1)
    outs, t0 = [], time.perf_counter()
    for pos in range(12, 12 + tokens):
        logits = stage(logits[0, -1].argmax().view(1, 1), pos, cache, head_rows=1)
        outs.append(logits)
    ms = (time.perf_counter() - t0) * 1e3 / tokens
    nine = torch.arange(1, K + 2).unsqueeze(0)
    outs.append(stage(nine, 100, cache, head_rows=K + 1))
    return ms, torch.cat([o.reshape(-1) for o in outs])


def verify_ms(stage: Any, runs: int) -> float:
    """Median ms of a 9-row verify chunk at position 100, the head on every row."""
    nine, cache = torch.arange(1, K + 2).unsqueeze(0), stage.new_cache(256)
    return timed_ms(lambda: stage(nine, 100, cache, head_rows=K + 1), runs)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma3-270m,smollm2")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=9, help="timed verify chunks per repetition")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "held_ab.json")
    args = p.parse_args(argv)
    from shard.model.footprint import measured
    from shard.model.quant import QuantLinear

    result = run_record("held_ab", models={})
    for model in args.models.split(","):
        two = stages(model)
        entry: dict[str, Any] = {
            name: {
                "weight_bytes": measured(stage),
                "held_weights": sum(
                    isinstance(m, QuantLinear) and m.path == "held" for m in stage.modules()
                ),
            }
            for name, stage in two.items()
        }
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            reps: dict[str, list[dict[str, float]]] = {"held": [], "per-call": []}
            with torch.inference_mode():
                for rep in range(args.reps):
                    order = ["per-call", "held"] if rep % 2 == 0 else ["held", "per-call"]
                    logits = {}
                    for name in order:
                        stage = two[name]
                        ms, logits[name] = decode(stage, args.tokens)
                        verify = verify_ms(stage, args.runs)
                        reps[name].append({"decode_ms": ms, "verify9_ms": verify})
                    if not torch.equal(logits["held"], logits["per-call"]):
                        print(f"{model}: held and per-call logits differ", file=sys.stderr)
                        return 1
            med = {
                name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                for name, rows in reps.items()
            }
            entry[f"threads_{threads}"] = {
                "reps": reps,
                "median": med,
                "per_call_over_held_decode": med["per-call"]["decode_ms"]
                / med["held"]["decode_ms"],
                "per_call_over_held_verify9": med["per-call"]["verify9_ms"]
                / med["held"]["verify9_ms"],
                "logits_equal": True,
            }
            print(
                f"{model} t={threads}: decode {med['per-call']['decode_ms']:.1f} -> "
                f"{med['held']['decode_ms']:.1f} ms a step, verify9 "
                f"{med['per-call']['verify9_ms']:.1f} -> {med['held']['verify9_ms']:.1f} ms; "
                f"logits equal"
            )
        result["models"][model] = entry
    write_record(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
