"""Where should the hybrid draft trust prompt lookup over the head? Measured, per match length.

Along the target's own greedy continuations (64 tokens) of the speculative ring benchmark's
prompts (``bench/prompts/spec_ring.toml``: copy, code, prose, chat) and of the head's held-out
prompts (``shard.training.distill.train.HELD_OUT``), at every position: how many context tokens
the n-gram lookup lines up (``NGramProposer.lookup``, the confidence ``HybridProposer``
reads; capped at 8, the lookup's window), whether its first guess is the target's next token,
and whether the head's (fed the target's real features up to that position, as on the ring)
is. The hybrid's ``min_match`` should be the shortest match at which lookup is right more
often than the head.

    .venv/bin/python bench/hybrid_match.py --head DIR [--json bench/results/hybrid_match.json]

Writes JSON (per set and over all: positions, lookup precision, head precision, by match
length); a benchmark, not a test. Small counts at some lengths: read the "n" beside each rate.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import torch

from shard.convert.bundled import resolve_model
from shard.decode.draft import NGramProposer
from shard.decode.head.eagle3 import Eagle3Head, target_embedding
from shard.decode.head.eagle3_check import target_states
from shard.decode.head.model import DraftHead
from shard.decode.head.proposer import HeadProposer
from shard.decode.head.shipped import is_eagle3_dir, shipped_head
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT, reference_runs
from shard.training.head.train import reference_features

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "bench" / "prompts" / "spec_ring.toml"
CAP = 8  # the lookup's window: a match never lines up more tokens than this


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--head",
        required=True,
        help="a head directory (shard draft train), or an EAGLE-3 head's (or a shipped name: "
        "smollm2-eagle3)",
    )
    p.add_argument("--model", default="smollm2", help="the target: bundled name or directory")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "hybrid_match.json")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target_dir = resolve_model(args.model)
    target = load_stage(target_dir, 0, ModelConfig.from_dir(target_dir).n_layers)
    head, layers = _head(args.head, target_dir, target.config.n_layers)
    bench = tomllib.loads(PROMPTS.read_text())["prompt"]
    prompts = [("chat" if b.get("chat") else "plain", b["text"], b["set"]) for b in bench]
    prompts += [(kind, text, "held-out") for kind, text in HELD_OUT]
    runs = reference_runs(
        target,
        Tokenizer.from_dir(target_dir),
        prompts=[(kind, text) for kind, text, _ in prompts],
        tokens=args.tokens,
    )
    lookup = NGramProposer()
    # set -> match length -> [positions, lookup right, head right]
    counts: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    if layers:  # an EAGLE-3 head reads the states entering its layers
        with torch.inference_mode():
            refs = [
                (ids, target_states(target, ids, layers)[0].float(), p)
                for ids, _, p in reference_features(target, runs)
            ]
    else:
        refs = reference_features(target, runs)
    for (_, _, group), (ids, feats, prompt_len) in zip(prompts, refs, strict=True):
        stream, proposer, first = primed(head, ids, feats, prompt_len)
        for m in range(first, len(stream) - 1):
            proposer.observe(m - 1, feats[m - 1 : m])
            context = stream[: m + 1]
            span, matched = lookup.lookup(context, 1)
            guess = proposer.ranked(context, 1)
            truth = stream[m + 1]
            for key in (group, "all"):
                row = counts[key][min(matched, CAP)]
                row[0] += 1
                row[1] += int(bool(span) and span[0] == truth)
                row[2] += int(bool(guess) and guess[0] == truth)
    by_set = {
        group: {
            str(length): {
                "n": n,
                "lookup": round(right / n, 3),
                "head": round(head_right / n, 3),
            }
            for length, (n, right, head_right) in sorted(rows.items())
        }
        for group, rows in counts.items()
    }
    overall = counts["all"]
    wins = [
        length
        for length, (n, right, head_right) in sorted(overall.items())
        if length > 0 and right > head_right
    ]
    result = {
        "benchmark": "hybrid_match",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.orig_argv),
        "head": str(args.head),
        "tokens_per_prompt": args.tokens,
        "prompts": len(prompts),
        "shortest_match_where_lookup_wins": min(wins) if wins else None,
        "by_set": by_set,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for group, rows in by_set.items():
        cells = " ".join(
            f"{length}:{r['lookup']:.2f}/{r['head']:.2f}(n={r['n']})" for length, r in rows.items()
        )
        print(f"{group:9s} {cells}")
    print("shortest match where lookup beats the head:", result["shortest_match_where_lookup_wins"])
    return 0


def primed(
    head: DraftHead | Eagle3Head, ids: torch.Tensor, feats: torch.Tensor, prompt_len: int
) -> tuple[list[int], HeadProposer, int]:
    """A reference run's stream, a proposer over ``head`` that has observed the prompt's
    last features (its window), and the first position to draft at."""
    stream = ids.tolist()
    proposer = HeadProposer(head, max_len=len(stream) + 2)
    first = max(prompt_len - 1, 1)
    lo = max(0, first - 1 - head.feature_window)
    proposer.observe(lo, feats[lo : first - 1])
    return stream, proposer, first


def _head(
    name: str, target_dir: Path, n_layers: int
) -> tuple[DraftHead | Eagle3Head, tuple[int, ...]]:
    """The head and, for an EAGLE-3 head, the target layers it reads (else none)."""
    path = shipped_head(name) or Path(name)
    if not is_eagle3_dir(path):
        return DraftHead.load(path), ()
    table = target_embedding(target_dir)
    head = Eagle3Head.load(path, embedding=table)
    return head, head.config.layers_for(n_layers)


if __name__ == "__main__":
    sys.exit(main())
