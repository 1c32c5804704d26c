"""Whether the EAGLE-3 head's confidence says when to stop drafting (issue 39's recipe:
"drafting that stops when the head's confidence drops"), measured offline along SmolLM2's
greedy continuations of the held-out chat and prose and of the code prompts of
``copy_code_fresh.toml`` and ``copy_code_more.toml``, through ``HeadProposer`` as the
coordinator drafts (chains of 4, states from a bf16 copy of the target as in
``bench/eagle3_alpha.py``). Per drafted token still in a right chain: the head's top-1
probability over its readout and whether the target took it; then, per threshold, the drafts
a stop at the first one below it would keep and the right ones it would lose. No timing.

    .venv/bin/python bench/head_confidence.py [--json bench/results/head_confidence.json]
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path

import torch

from shard.convert.bundled import resolve_model
from shard.decode.head.eagle3 import Eagle3Head, target_embedding
from shard.decode.head.proposer import HeadProposer
from shard.decode.head.shipped import shipped_head
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.eagle3.data import sample_batch

ROOT = Path(__file__).resolve().parents[1]
DEPTH = 4
TOKENS = 48
THRESHOLDS = (0.05, 0.1, 0.2, 0.3)
SETS = (
    ("prose and chat", "bench/prompts/heldout_prose.toml", None),
    ("code", "bench/prompts/copy_code_fresh.toml", "code"),
    ("code", "bench/prompts/copy_code_more.toml", "code"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    d = resolve_model("smollm2")
    tok = Tokenizer.from_dir(d)
    path = shipped_head("smollm2-eagle3")
    assert path is not None
    head = Eagle3Head.load(path, embedding=target_embedding(d))
    layers = head.config.layers_for(ModelConfig.from_dir(d).n_layers)
    sampler = load_stage(
        d, 0, ModelConfig.from_dir(d).n_layers, dtype=torch.bfloat16, weights="bfloat16"
    )
    probs: list[float] = []
    choose = HeadProposer._choose

    def spy(self: HeadProposer, g: torch.Tensor, *rest: object) -> tuple[int, object]:
        probs.append(float(torch.softmax(self._head.logits(g).float(), -1).max()))
        return choose(self, g, *rest)  # type: ignore[arg-type]

    HeadProposer._choose = spy  # type: ignore[method-assign]
    drafts: dict[str, list[list[tuple[float, bool]]]] = {}
    for group, file, only in SETS:
        for p in tomllib.loads((ROOT / file).read_text())["prompt"]:
            if only is not None and p["set"] != only:
                continue
            chat = [{"role": "user", "content": p["text"]}]
            ids = tok.encode(tok.apply_chat(chat) if p.get("chat") else p["text"])
            drafts.setdefault(group, []).extend(walk(head, sampler, tok, ids, layers, probs))
    results = {group: summary(rows) for group, rows in drafts.items()}
    for group, r in results.items():
        print(f"{group}: {r['chains']} chains, {r['judged']} drafts judged, {r['right']} right")
        for row in r["stops"]:
            print(
                f"  stop below {row['threshold']}: keeps {row['kept']:.2f} of the drafts and "
                f"{row['right_kept']} right ones; the draft a stop drops was right "
                f"{row['right_at_stop']} of {row['stopped']} times"
            )
    if args.json:
        args.json.write_text(json.dumps({"depth": DEPTH, "results": results}, indent=2) + "\n")


def walk(
    head: Eagle3Head,
    sampler: torch.nn.Module,
    tok: Tokenizer,
    ids: list[int],
    layers: Sequence[int],
    probs: list[float],
) -> list[list[tuple[float, bool]]]:
    """Per position of the prompt's greedy continuation, the chain drafted there: (top-1
    probability, right) of each draft up to the first wrong one."""
    b = sample_batch(
        sampler,
        [ids],
        layers=layers,
        seq_len=len(ids) + TOKENS,
        temperature=0.0,
        stop_ids=tok.eos_ids,
        generator=torch.Generator(),
    )
    m_end = int(b.valid[0].sum())
    stream = b.ids[0, :m_end].tolist()
    feats = b.states[0, :m_end].float()
    proposer = HeadProposer(head, max_len=len(stream) + DEPTH + 1, layers=layers)
    first = max(len(ids) - 1, 1)
    lo = max(0, first - 1 - head.feature_window)
    proposer.observe(lo, feats[lo : first - 1])
    out = []
    with torch.no_grad():
        for m in range(first, len(stream) - 1):
            if m - 1 >= first - 1:
                proposer.observe(m - 1, feats[m - 1 : m])
            probs.clear()
            guesses = proposer.propose(stream[: m + 1], DEPTH)
            chain = []
            for k, (token, p) in enumerate(zip(guesses, probs, strict=False), start=1):
                if m + k >= len(stream):
                    break
                right = token == stream[m + k]
                chain.append((p, right))
                if not right:
                    break
            out.append(chain)
    return out


def summary(chains: list[list[tuple[float, bool]]]) -> dict[str, object]:
    """A stop at the first draft below a threshold, the first draft always sent: the drafts
    it keeps (a fraction of those judged), the right ones it keeps, and how often the first
    draft it drops would have been right."""
    judged = sum(len(c) for c in chains)
    right = sum(r for c in chains for _, r in c)
    stops = []
    for t in THRESHOLDS:
        kept = right_kept = dropped = dropped_right = 0
        for chain in chains:
            cut = next((i for i, (p, _) in enumerate(chain) if i > 0 and p < t), len(chain))
            kept += cut
            right_kept += sum(r for _, r in chain[:cut])
            if cut < len(chain):
                dropped += 1
                dropped_right += chain[cut][1]
        stops.append(
            {
                "threshold": t,
                "kept": round(kept / max(judged, 1), 3),
                "right_kept": right_kept,
                "stopped": dropped,
                "right_at_stop": round(dropped_right / max(dropped, 1), 3),
            }
        )
    return {"chains": len(chains), "judged": judged, "right": right, "stops": stops}


if __name__ == "__main__":
    main()
