"""Could the hybrid trust a short lookup match where the head is unsure, or where the text was
being copied a moment ago? Measured at lookup match lengths 1 and 2.

Along the target's greedy continuations (64 tokens) of ``bench/hybrid_match.py``'s prompts and
of ``bench/prompts/heldout_prose.toml``, at every position where the n-gram lookup lines up
one or two context tokens: whether its first guess is the target's next token, and whether
the head's is (fed the target's real features, as on the ring), split two ways:

- ``confidence``: the head's top-1 probability (its q at temperature 1) below or above
  ``--confidence`` (0.3);
- ``recent``: whether the lookup lined up at least ``--long`` (4) tokens at one of the
  previous ``--window`` (8) positions (the text was being copied just before);
- ``vetted``: the head's probability of the lookup's guess over its own top-1's (>= 0.5,
  >= 0.1, < 0.1): whether the head finds the copy plausible;
- ``unique``: whether the matched suffix occurs once before in the context (one candidate
  continuation) or more often (the lookup picks the latest of several).

Beside whose first guess is right, the mean run each would have had accepted: the lookup's
draft of ``--k`` (8) tokens, and the hybrid's from the same position (nothing settled, so
no match shorter than 2 goes first).
A gate pays where the lookup's run beats the hybrid's in its split. Written for the one copy
prompt on which the hybrid needs a lap more than the n-gram (docs/benchmarks.md).

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
from shard.decode.hybrid import HybridProposer
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
    p.add_argument("--k", type=int, default=8, help="draft length for the run columns")
    p.add_argument(
        "--prompts",
        type=Path,
        action="append",
        default=[],
        help="more prompt files (spec_ring.toml's format), each prompt under its own set",
    )
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
    prompts += [
        ("chat" if b.get("chat") else "plain", b["text"], f"{path.stem}:{b['set']}")
        for path in args.prompts
        for b in tomllib.loads(path.read_text())["prompt"]
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
    # (split, value, set, match length) -> [positions, lookup right, head right,
    #  tokens the lookup's draft of K has right in a row, tokens the hybrid's has]
    counts: dict[tuple[str, str, str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for (_, _, group), (ids, feats, prompt_len) in zip(prompts, refs, strict=True):
        stream, proposer, first = hybrid_match.primed(head, ids, feats, prompt_len)
        hybrid = HybridProposer(proposer)
        lined_up: dict[int, int] = {}
        copied: dict[int, bool] = {}  # output positions: a trusted match guessed right
        for m in range(first, len(stream) - 1):
            proposer.observe(m - 1, feats[m - 1 : m])
            context = stream[: m + 1]
            span, matched = lookup.lookup(context, args.k)
            lined_up[m] = matched
            copied[m] = m >= prompt_len and matched >= 2 and span[0] == stream[m + 1]
            if matched not in (1, 2):
                continue
            guess = proposer.ranked(context, 1)
            q = proposer.first_q(context, 1.0)
            top = float(q[1].max()) if q is not None else 0.0
            recent = any(lined_up.get(m - j, 0) >= args.long for j in range(1, args.window + 1))
            window = [copied[m - j] for j in range(1, args.window + 1) if m - j >= prompt_len]
            output = (
                "early" if len(window) < args.window
                else "copying" if sum(window) >= args.window - 2 else "not"
            )  # fmt: skip
            so_far = [copied[j] for j in range(prompt_len, m)]
            share = (
                "early" if len(so_far) < args.window
                else "copy-task" if sum(so_far) >= len(so_far) / 2 else "other"
            )  # fmt: skip
            truth = stream[m + 1]
            ahead = stream[m + 1 : m + 1 + args.k]
            drafted = hybrid.propose(context, min(args.k, len(ahead)))
            vetted = _vetted(q, span[0]) / top if span and top > 0 else 0.0
            suffix = context[-matched:]
            places = sum(
                1 for at in range(matched, len(context)) if context[at - matched : at] == suffix
            )
            splits = (
                ("unique", "once" if places == 1 else "several"),
                ("confidence", "low" if top < args.confidence else "high"),
                ("vetted", ">=0.5" if vetted >= 0.5 else ">=0.1" if vetted >= 0.1 else "<0.1"),
                ("recent", "copying" if recent else "not"),
                ("output", output),
                ("share", share),
            )
            for split, value in splits:
                for key in (group, "all"):
                    row = counts[(split, value, key, matched)]
                    row[0] += 1
                    row[1] += int(bool(span) and span[0] == truth)
                    row[2] += int(bool(guess) and guess[0] == truth)
                    row[3] += _run(span, ahead)
                    row[4] += _run(drafted, ahead)
    rows = [
        {"split": s, "value": v, "set": g, "match": m, "n": n,
         "lookup": round(lr / n, 3), "head": round(hr / n, 3),
         "lookup_run": round(lrun / n, 3), "hybrid_run": round(hrun / n, 3)}
        for (s, v, g, m), (n, lr, hr, lrun, hrun) in sorted(counts.items())
    ]  # fmt: skip
    result = {
        "benchmark": "hybrid_gate",
        "command": " ".join(sys.orig_argv),
        "head": args.head,
        "confidence": args.confidence,
        "long": args.long,
        "window": args.window,
        "k": args.k,
        "prompts": len(prompts),
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| split | value | set | match | n | lookup right | head right | lookup run | hybrid run |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["set"] in ("all", "copy", "heldout-prose") or ":" in r["set"]:
            print(
                f"| {r['split']} | {r['value']} | {r['set']} | {r['match']} | {r['n']} | "
                f"{r['lookup']:.2f} | {r['head']:.2f} | {r['lookup_run']:.2f} | "
                f"{r['hybrid_run']:.2f} |"
            )
    return 0


def _vetted(q: tuple[torch.Tensor, torch.Tensor] | None, token: int) -> float:
    """The head's probability of ``token`` in its sparse q (0 where the q leaves it out)."""
    if q is None:
        return 0.0
    hit = (q[0] == token).nonzero()
    return float(q[1][hit[0, 0]]) if len(hit) else 0.0


def _run(draft: list[int], truth: list[int]) -> int:
    """How many of ``draft`` match ``truth`` from the start (what a verify would accept)."""
    n = 0
    for d, t in zip(draft, truth, strict=False):
        if d != t:
            break
        n += 1
    return n


if __name__ == "__main__":
    sys.exit(main())
