"""β: how often a draft head's runner-up would have rescued a miss — measured before any tree
(top-k) verification is built, as issue 16 asks.

Along the target's own greedy continuations of the held-out prompts
(``shard.training.distill.train.HELD_OUT``, 64 tokens each), at every position the head is fed
the target's real features up to it (``HeadProposer.observe``, as on the ring) and ranks its
first draft (``HeadProposer.ranked``). Reported: α₁ = P(top-1 is the target's token),
β = P(top-2 is | top-1 is not), and the top-k coverage for k = 1..8 (the acceptance a k-way
tree's first level would reach). And, for a sampled request at ``--temperature`` (0.7), the
first draft's expected acceptance two ways, exactly (no sampling noise): drawn from the
head's q and judged by the general rule, Σ min(p, q); the head's greedy token judged by the
one-hot rule, p(argmax q) — p the target's distribution at that temperature.
A tree verify pays only if β is large enough to buy back
the extra rows every verify chunk would carry: on this CPU, where a stage's compute grows
with rows (docs/benchmarks.md, batched stages), the first level of a k-wide tree costs
about what k - 1 more drafted tokens do.

    .venv/bin/python bench/head_beta.py --head DIR [--json bench/results/head_beta.json]

Writes JSON; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from shard.convert.bundled import resolve_model
from shard.decode.head.model import DraftHead
from shard.decode.head.proposer import HeadProposer
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT, reference_runs
from shard.training.head.train import reference_features

REPO = Path(__file__).resolve().parent.parent
TOP = 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--head", type=Path, required=True, help="a head directory (shard draft train)")
    p.add_argument("--model", default="smollm2", help="the target: bundled name or directory")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "head_beta.json")
    p.add_argument("--temperature", type=float, default=0.7, help="for the sampled acceptance")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target_dir = resolve_model(args.model)
    target = load_stage(target_dir, 0, ModelConfig.from_dir(target_dir).n_layers)
    head = DraftHead.load(args.head)
    refs = reference_features(
        target, reference_runs(target, Tokenizer.from_dir(target_dir), prompts=HELD_OUT)
    )
    within = [0] * TOP  # the target's token among the head's top k, k = 1..TOP
    positions = 0
    with_q = one_hot = 0.0  # expected first-draft acceptance at the temperature, summed
    assert target.lm_head is not None
    for ids, feats, prompt_len in refs:
        stream = ids.tolist()
        proposer = HeadProposer(head, max_len=len(stream) + 2)
        first = max(prompt_len - 1, 1)
        lo = max(0, first - 1 - head.config.window)
        proposer.observe(lo, feats[lo : first - 1])
        for m in range(first, len(stream) - 1):
            proposer.observe(m - 1, feats[m - 1 : m])
            ranked = proposer.ranked(stream[: m + 1], TOP)
            q = proposer.first_q(stream[: m + 1], args.temperature)
            with torch.inference_mode():
                p_logits = target.lm_head(feats[m]).float() / args.temperature  # [V]
            p = torch.softmax(p_logits, dim=-1)
            if q is not None:
                ids, probs = q
                with_q += float(torch.minimum(p[ids], probs).sum())
                one_hot += float(p[ranked[0]])
            positions += 1
            if stream[m + 1] in ranked:
                for k in range(ranked.index(stream[m + 1]), TOP):
                    within[k] += 1
    alpha1 = within[0] / positions
    beta = (within[1] - within[0]) / max(positions - within[0], 1)
    result = {
        "benchmark": "head_beta",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.orig_argv),
        "head": str(args.head),
        "head_report": json.loads((args.head / "train.json").read_text())
        if (args.head / "train.json").is_file()
        else None,
        "prompts": len(refs),
        "positions": positions,
        "alpha1": round(alpha1, 4),
        "beta": round(beta, 4),
        "top_k_coverage": {k + 1: round(within[k] / positions, 4) for k in range(TOP)},
        "temperature": args.temperature,
        "sampled_acceptance_with_q": round(with_q / positions, 4),
        "sampled_acceptance_one_hot": round(one_hot / positions, 4),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    keys = ("positions", "alpha1", "beta", "top_k_coverage", "sampled_acceptance_with_q")
    print(json.dumps({k: result[k] for k in (*keys, "sampled_acceptance_one_hot")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
