"""Peak resident memory per stage of Gemma 3 270M on three stages, stored against float32.

For each ``weights`` format (``stored``: the GGUF's Q4_K/Q5_0/Q8_0/Q6_K tensors as int4/int8
codes; ``float32``: dense) the model is cut as ``layers = "auto"`` cuts it for three stages in
that format (``shard.placement.split.byte_split`` over ``shard.nodes.sizes.sizes_of``, what
``shard plan specs/gemma.toml`` prints), and each stage runs in a fresh child process that
imports torch, loads its block (``load_stage``) and runs one forward of a 64-token prompt
through it (token ids into the first stage, hidden states into the others). The child
reports its peak resident set (``VmHWM`` of ``/proc/self/status``; exec resets it), its
resident set after the load, its weights' bytes (``footprint.measured``) and the baseline
resident set of an interpreter with torch imported (before the load).

Writes ``bench/results/gemma_memory.json``. ``.venv/bin/python bench/gemma_memory.py``
(the model converted once by ``resolve_model("gemma3-270m")``; ~2 min on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from shard.convert.bundled import resolve_model
from shard.model.config import ModelConfig
from shard.nodes.sizes import sizes_of
from shard.placement.split import blocks_of, byte_split

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "gemma_memory.json"

_CHILD = """
import json, sys
from pathlib import Path

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB

import torch
torch.set_num_threads(1)
from shard.model.footprint import measured
from shard.model.loader import load_stage

model_dir, weights, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = status("VmRSS")
stage = load_stage(Path(model_dir), first, last, weights=weights)
loaded = status("VmRSS")
cache = stage.new_cache(64)
x = torch.arange(2, 66)[None] if first == 0 else torch.randn(1, 64, stage.config.hidden_size)
with torch.no_grad():
    stage(x, 0, cache)
print(json.dumps({"baseline_rss_mib": round(base, 1), "rss_after_load_mib": round(loaded, 1),
                  "peak_rss_mib": round(status("VmHWM"), 1),
                  "weight_mib": round(measured(stage) / 2**20, 1)}))
"""


def one_stage(model_dir: Path, weights: str, first: int, last: int) -> dict[str, float]:
    """The child's figures for stage ``[first, last)`` held as ``weights``."""
    cmd = [sys.executable, "-c", _CHILD, str(model_dir), weights, str(first), str(last)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    model_dir = resolve_model("gemma3-270m", progress=False)
    config = ModelConfig.from_dir(model_dir)
    result: dict[str, object] = {"model": "gemma3-270m", "stages": 3}
    for weights in ("stored", "float32"):
        sizes = sizes_of(config, weights, "float32", model_dir)
        counts = byte_split([sizes] * 3)
        assert counts is not None
        rows = []
        for first, last in blocks_of(counts):
            row = {"layers": [first, last], **one_stage(model_dir, weights, first, last)}
            print(weights, row, flush=True)
            rows.append(row)
        result[weights] = rows
    stored, dense = result["stored"], result["float32"]
    assert isinstance(stored, list) and isinstance(dense, list)
    result["peak_ratio_stored_over_float32"] = [
        round(s["peak_rss_mib"] / d["peak_rss_mib"], 3) for s, d in zip(stored, dense, strict=True)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
