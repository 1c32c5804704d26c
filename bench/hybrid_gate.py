"""Could the hybrid trust a short lookup match where the head is unsure, or where the text was
being copied a moment ago? Measured at lookup match lengths 1 and 2.

Along the target's greedy continuations (64 tokens) of ``bench/hybrid_match.py``'s prompts and
of ``bench/prompts/heldout_prose.toml``, at every position where the n-gram lookup lines up
one or two context tokens: whether its first guess is the target's next token, and whether
the head's is (fed the target's real features, as on the ring), split two ways:

- ``confidence``: the head's top-1 probability (its q at temperature 1) below or above
  ``--confidence`` (0.3);
- ``recent``: whether the lookup lined up at least ``--long`` (4) tokens at one of the
  previous ``--window`` (8) positions (the text was being copied just before).

A gate pays where the lookup is right more often than the head in its split. Written for the
one copy prompt on which the hybrid needs a lap more than the n-gram (docs/benchmarks.md).

    .venv/bin/python bench/hybrid_gate.py [--json bench/results/hybrid_gate.json]

A benchmark, not a test: no timing, so the load does not matter.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import torch

import hybrid_match
from shard.convert.bundled import resolve_model
from shard.decode.draft import NGramProposer
from shard.decode.head.eagle3_check import target_states
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT, reference_runs
from shard.training.head.train import reference_features

REPO = Path(__file__).resolve().parent.parent
HELD_OUT_PROSE = REPO / "bench" / "prompts" / "heldout_prose.toml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--head", default="smollm2-eagle3")
    p.add_argument("--confidence", type=float, default=0.3)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "hybrid_gate.json")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    target_dir = resolve_model("smollm2")
    target = load_stage(target_dir, 0, ModelConfig.from_dir(target_dir).n_layers)
    head, layers = hybrid_match._head(args.head, target_dir, target.config.n_layers)
    prompts = [
        ("chat" if b.get("chat") else "plain", b["text"], b["set"])
        for b in tomllib.loads(hybrid_match.PROMPTS.read_text())["prompt"]
    ]
    prompts += [(kind, text, "held-out") for kind, text in HELD_OUT]
    prompts += [
        ("chat" if b.get("chat") else "plain", b["text"], "heldout-prose")
        for b in tomllib.loads(HELD_OUT_PROSE.read_text())["prompt"]
    ]
    runs = reference_runs(
        target, Tokenizer.from_dir(target_dir), prompts=[(k, t) for k, t, _ in prompts], tokens=64
    )
    with torch.inference_mode():
        refs = [
            (ids, target_states(target, ids, layers)[0].float(), n)
            for ids, _, n in reference_features(target, runs)
        ]
    lookup = NGramProposer()
    # (split, value, set, match length) -> [positions, lookup right, head right]
    counts: dict[tuple[str, str, str, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for (_, _, group), (ids, feats, prompt_len) in zip(prompts, refs, strict=True):
        stream, proposer, first = hybrid_match.primed(head, ids, feats, prompt_len)
        lined_up: dict[int, int] = {}
        for m in range(first, len(stream) - 1):
            proposer.observe(m - 1, feats[m - 1 : m])
            context = stream[: m + 1]
            span, matched = lookup.lookup(context, 1)
            lined_up[m] = matched
            if matched not in (1, 2):
                continue
            guess = proposer.ranked(context, 1)
            q = proposer.first_q(context, 1.0)
            top = float(q[1].max()) if q is not None else 0.0
            recent = any(lined_up.get(m - j, 0) >= args.long for j in range(1, args.window + 1))
            truth = stream[m + 1]
            splits = (
                ("confidence", "low" if top < args.confidence else "high"),
                ("recent", "copying" if recent else "not"),
            )
            for split, value in splits:
                for key in (group, "all"):
                    row = counts[(split, value, key, matched)]
                    row[0] += 1
                    row[1] += int(bool(span) and span[0] == truth)
                    row[2] += int(bool(guess) and guess[0] == truth)
    rows = [
        {"split": s, "value": v, "set": g, "match": m, "n": n,
         "lookup": round(lr / n, 3), "head": round(hr / n, 3)}
        for (s, v, g, m), (n, lr, hr) in sorted(counts.items())
    ]  # fmt: skip
    result = {
        "benchmark": "hybrid_gate",
        "command": " ".join(sys.orig_argv),
        "head": args.head,
        "confidence": args.confidence,
        "long": args.long,
        "window": args.window,
        "prompts": len(prompts),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print("| split | value | set | match | n | lookup right | head right |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if r["set"] in ("all", "copy", "heldout-prose"):
            print(
                f"| {r['split']} | {r['value']} | {r['set']} | {r['match']} | {r['n']} | "
                f"{r['lookup']:.2f} | {r['head']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
