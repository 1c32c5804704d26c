"""The MTP block at the tail against the same block at the coordinator: the mechanics, on a
tiny checkpoint, in one run (issue 39, point 5).

No real MTP checkpoint fits this machine (the smallest, GLM-4.5-Air, has 106 B parameters),
so this measures mechanics only, on the tests' tiny GLM-4.5 with a random block in the
published layout (``tests/test_mtp.py``'s ``with_mtp_block``). Its drafts are rarely right:
tokens per lap stay near 1 and speculation costs more than it gives. What the figures show is
what each placement costs, never what MTP gains on real text.

1. **The return link's bytes per verdict**, from encoded frames (``shard.wire.encode``,
   uncompressed and zstd): a verdict carrying ``N`` draft ids (the tail's block; ``N`` = 16
   with the default ``k_max`` and ``depth_max``) against one carrying the features a
   coordinator-placed block reads (``a + 1`` committed rows of ``hidden x 2`` bytes), at
   SmolLM2's hidden (576) and DeepSeek-V3's (7168), for ``a`` = 0..3 accepted drafts.
2. **``shard bench``** through a 3-stage ring of processes at 25 ms per edge: plain, spec and
   pipelined with ``--drafts mtp,mtp_coordinator``, its JSON written beside this one's.

Writes JSON (``--json``, default ``bench/results/mtp_tail.json``) and prints Markdown.
Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from shard.compute.tensors import to_wire
from shard.decode.tail import tail_draft_count
from shard.messages import ChunkSeq, Epoch, SessionId, Verdict
from shard.wire import encode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoint is the tests' fixture

SPEC = """\
[swarm]
name = "mtp-bench"
model = "{model}"
dtype = "float32"
insecure = true

[limits]
max_len = 512
prefill_chunk = 64

[coordinator]
name = "coord"
listen = "127.0.0.1:9300"

[[stage]]
name = "s0"
listen = "127.0.0.1:9301"
layers = [0, 1]

[[stage]]
name = "s1"
listen = "127.0.0.1:9302"
layers = [1, 3]

[[stage]]
name = "s2"
listen = "127.0.0.1:9303"
layers = [3, 4]

[speculation]
draft = "mtp"
"""


def verdict_bytes(hidden: int, accepted: int, drafts: int) -> dict[str, int]:
    """Encoded sizes of one verify verdict (K = 3): with ``drafts`` ids, and with the
    ``accepted + 1`` feature rows in bfloat16 instead."""
    ids = tuple(range(4))
    base = Verdict(SessionId(1), Epoch(0), ChunkSeq(9), 100, ids, accepted)
    with_ids = Verdict(SessionId(1), Epoch(0), ChunkSeq(9), 100, ids, accepted,
                       drafts=tuple(range(1000, 1000 + drafts)))  # fmt: skip
    rows = torch.randn(accepted + 1, hidden, generator=torch.Generator().manual_seed(hidden))
    with_rows = Verdict(SessionId(1), Epoch(0), ChunkSeq(9), 100, ids, accepted,
                        features=to_wire(rows.to(torch.bfloat16)),
                        features_start=100)  # fmt: skip
    out = {}
    for name, msg in (("plain", base), ("tail_drafts", with_ids), ("features", with_rows)):
        out[name] = len(encode(msg, compress=False))
        out[f"{name}_zstd"] = len(encode(msg, compress=True))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/mtp_tail.json")
    parser.add_argument("--latency", default="25")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--per-set", type=int, default=2)
    args = parser.parse_args(argv)

    n = tail_draft_count(8, 4)
    wire = {f"hidden{h}_a{a}": verdict_bytes(h, a, n) for h in (576, 7168) for a in range(4)}
    print(f"| hidden | accepted | verdict, no drafts | + {n} draft ids | + features |")
    print("|---:|---:|---:|---:|---:|")
    for key, b in wire.items():
        h, a = key.removeprefix("hidden").split("_a")
        print(f"| {h} | {a} | {b['plain']} | {b['tail_drafts']} | {b['features']} |")

    from family_fixtures import family_dir
    from test_mtp import with_mtp_block

    ring_json = args.json.with_name(args.json.stem + "_ring.json")
    with tempfile.TemporaryDirectory() as tmp:
        model = with_mtp_block(family_dir("glm4_moe", Path(tmp) / "f"), Path(tmp) / "m")
        spec = Path(tmp) / "spec.toml"
        spec.write_text(SPEC.format(model=model))
        cmd = [sys.executable, "-m", "shard", "bench", str(spec), "--drafts", "mtp,mtp_coordinator",
               "--latencies", args.latency, "--max-tokens", str(args.max_tokens),
               "--per-set", str(args.per_set), "--json", str(ring_json), "--force"]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    record: dict[str, Any] = {
        "what": "MTP block at the tail vs at the coordinator: mechanics on a tiny checkpoint",
        "tail_drafts_per_verdict": n,
        "verdict_bytes": wire,
        "ring": str(ring_json.relative_to(ROOT)) if ring_json.is_relative_to(ROOT) else None,
        "load_average": os.getloadavg(),
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json} and {ring_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
