"""Chained acceptance of an EAGLE-3 head along SmolLM2's greedy continuations of prompt sets:
``bench/prompts/heldout_prose.toml`` (never trained on) and ``HELD_OUT`` (the training
command's own measure), through ``HeadProposer`` as the coordinator runs it. The states come
from a bf16 copy of the target, as the head's training text did. Acceptance does not depend
on the machine's load: no timing here.

    .venv/bin/python bench/eagle3_alpha.py [--head smollm2-eagle3] [--json out.json]
        [--prompts bench/prompts/copy_code_fresh.toml ...]   # more sets, grouped FILE:set
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import torch

from shard.convert.bundled import resolve_model
from shard.decode.head.eagle3 import Eagle3Head, target_embedding
from shard.decode.head.shipped import shipped_head
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.training.distill.train import HELD_OUT
from shard.training.eagle3.data import sample_batch
from shard.training.head.measure import chained_acceptance

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="smollm2-eagle3", help="a shipped name or a directory")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (64)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--prompts",
        type=Path,
        action="append",
        default=[],
        help="more prompt files (spec_ring.toml's format), each set grouped as FILE:set",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    d = resolve_model("smollm2")
    n = ModelConfig.from_dir(d).n_layers
    tok = Tokenizer.from_dir(d)
    table = target_embedding(d)
    path = shipped_head(args.head) or Path(args.head)
    head = Eagle3Head.load(path, embedding=table)
    layers = head.config.layers_for(n)
    sampler = load_stage(d, 0, n, dtype=torch.bfloat16, weights="bfloat16")
    held = tomllib.loads((ROOT / "bench/prompts/heldout_prose.toml").read_text())["prompt"]
    prompts = [(p["set"], bool(p.get("chat")), p["text"]) for p in held]
    prompts += [("HELD_OUT", kind == "chat", text) for kind, text in HELD_OUT]
    for f in args.prompts:
        more = tomllib.loads(f.read_text())["prompt"]
        prompts += [(f"{f.stem}:{p['set']}", bool(p.get("chat")), p["text"]) for p in more]
    refs: dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    for group, chat, text in prompts:
        s = tok.apply_chat([{"role": "user", "content": text}]) if chat else text
        ids = tok.encode(s)
        b = sample_batch(
            sampler,
            [ids],
            layers=layers,
            seq_len=len(ids) + args.tokens,
            temperature=0.0,
            stop_ids=tok.eos_ids,
            generator=torch.Generator(),
        )
        m = int(b.valid[0].sum())
        refs.setdefault(group, []).append((b.ids[0, :m], b.states[0, :m].float(), len(ids)))
    refs["heldout (chat + prose)"] = refs["chat"] + refs["prose"]
    out = {}
    with torch.no_grad():
        for group, rs in refs.items():
            starts, alpha, committed = chained_acceptance(head, rs)
            out[group] = {
                "prompts": len(rs),
                "starts": starts,
                "alpha": alpha,
                "committed": committed,
            }
            print(
                f"{group}: {len(rs)} prompts, {starts} starts, alpha {alpha}, "
                f"tokens per verify of K = 1..4 {committed}"
            )
    if args.json:
        args.json.write_text(json.dumps({"head": str(path), "results": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
