"""Stored weights against float32 on SmolLM2: quality, and peak memory of `generate --local`.

Quality: teacher-forced over a fixed text (``bench/data/gpl-3.txt``, the first 14,000 bytes
of the GPL version 3, ~3,000 tokens; a license text may be copied verbatim), the fraction of
positions where the model with ``--weights stored`` picks the same greedy next token as the
float32 model (top-1 agreement), and the perplexity of each on the text. The text runs in
chunks of 256 positions through one KV cache (``--context``, default 2,048: the text is cut
into windows that long).

Memory: the peak resident set (``VmHWM`` of ``/proc/self/status``, which exec resets;
``ru_maxrss`` would carry the forking parent's peak over) of ``shard generate --local`` with
``--weights float32`` and ``--weights stored`` (each a fresh child process, 16 tokens), and
their ratio, the median of five runs each, and the worst case (the largest stored peak over
the smallest float32 one). ``--rss-only`` measures only that and updates an existing result.

Writes ``bench/results/quant_quality.json``. ``.venv/bin/python bench/quant_quality.py``
(~2 min on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from shard.convert.bundled import resolve_model
from shard.model.config import ModelConfig
from shard.model.device import cpu_has_bf16
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "gpl-3.txt"
CHUNK = 256


def teacher_forced(
    model: StageModel, ids: list[int], context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy next-token choices ``[N-1]`` and log-probabilities of the true next tokens."""
    picks, logps = [], []
    for w in range(0, len(ids) - 1, context):
        window = ids[w : w + context + 1]
        cache = model.new_cache(len(window))
        for start in range(0, len(window) - 1, CHUNK):
            x = torch.tensor([window[start : min(start + CHUNK, len(window) - 1)]])
            logits = model(x, start, cache)[0]  # [S, V] fp32
            nxt = torch.tensor(window[start + 1 : start + 1 + x.shape[1]])
            picks.append(logits.argmax(-1))
            logps.append(torch.log_softmax(logits, -1).gather(1, nxt[:, None])[:, 0])
    return torch.cat(picks), torch.cat(logps)


def peak_rss_mb(weights: str, model: str) -> float:
    """Peak RSS (VmHWM) of one `shard generate --local` child process."""
    code = (
        "import sys\n"
        "from shard.cli import main\n"
        f"rc = main(['generate', '--local', '--model', {model!r}, '--weights', {weights!r}, "
        "'--max-tokens', '16', '--ignore-eos', '--json', 'The capital of France is'])\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
        "print('RSS', hwm.split()[1])\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kb = int(out.stdout.rsplit("RSS", 1)[1].split()[0])
    return kb / 1024


def _rss(result: dict[str, object], model_dir: Path, repeats: int = 5) -> None:
    """Median peak RSS of ``repeats`` runs each (the load's temporaries make it vary)."""
    runs: dict[str, list[float]] = {"float32": [], "stored": []}
    for _ in range(repeats):
        for weights, seen in runs.items():
            seen.append(round(peak_rss_mb(weights, str(model_dir)), 1))
    rss = {w: statistics.median(seen) for w, seen in runs.items()}
    result["peak_rss_mb_generate_local"] = rss
    result["peak_rss_mb_runs"] = runs
    result["peak_rss_ratio"] = round(rss["stored"] / rss["float32"], 3)
    result["peak_rss_ratio_worst"] = round(max(runs["stored"]) / min(runs["float32"]), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "quant_quality.json")
    parser.add_argument("--rss-only", action="store_true", help="update only the RSS figures")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2", progress=False)
    if args.rss_only:
        result = json.loads(args.out.read_text())
        _rss(result, model_dir)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    config = ModelConfig.from_dir(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode(TEXT.read_text(encoding="utf-8"))
    runs = {}
    for weights in ("float32", "stored"):
        t0 = time.perf_counter()
        model = load_stage(model_dir, 0, config.n_layers, weights=weights)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        picks, logps = teacher_forced(model, ids, args.context)
        runs[weights] = (picks, logps, load_s, time.perf_counter() - t0)
        del model
    f_picks, f_logps = runs["float32"][:2]
    s_picks, s_logps = runs["stored"][:2]
    result = {
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF: Q4_1 layers, Q8_0 embedding)",
        "text": str(TEXT.relative_to(ROOT.parent)),
        "tokens": len(ids),
        "positions": int(f_picks.numel()),
        "context": args.context,
        "top1_agreement": float((f_picks == s_picks).float().mean()),
        "perplexity": {
            "float32": math.exp(-float(f_logps.mean())),
            "stored": math.exp(-float(s_logps.mean())),
        },
        "load_s": {w: round(r[2], 2) for w, r in runs.items()},
        "forward_s": {w: round(r[3], 2) for w, r in runs.items()},
        "threads": args.threads,
        "cpu_bf16": cpu_has_bf16(),
        "cache_entry_mb": round(sum(p.stat().st_size for p in model_dir.iterdir()) / 2**20, 1),
    }
    _rss(result, model_dir)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
