"""The cost of ``[audit] mode = "hold"``, side by side: the same in-process ring (a
coordinator, three stages, a dedicated auditor for each stage's block, batching on) run with
``mode = "sample"`` (the default: audits at ``rate``, tokens released as committed) and with
``mode = "hold"`` (every chunk of every stage audited, a verdict's tokens released only once
every stage's part of it is confirmed), both up at once in one process, rounds interleaved
(sample, hold, sample, ...), each round every prompt at once.

Per request: end-to-end tok/s (tokens / wall seconds from the call to its return) and the
time to the first token the client is sent; medians per mode and the ratio hold / sample.
Everything shares this machine's CPU — the auditors recompute on the cores the ring runs on
(on a real swarm an auditor is another machine), so the hold figure is a pessimistic bound:
it includes every recomputation, serialised behind the ring's own forwards.

Writes JSON (``--json``). A benchmark, not a test: nothing here asserts a speed.

    .venv/bin/python bench/audit_hold.py                    # SmolLM2 fp32, ~5 min on 2 cores
    .venv/bin/python bench/audit_hold.py --model tiny       # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]

from shard.convert.bundled import resolve_model  # noqa: E402
from shard.model.config import ModelConfig  # noqa: E402
from shard.nodes.inprocess import run_swarm  # noqa: E402
from shard.spec.swarm import SwarmSpec  # noqa: E402
from shard.testing import generate_watching, make_tiny_checkpoint  # noqa: E402
from shard.transport import MemoryNetwork  # noqa: E402

MODES = ("sample", "hold")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, checkpoint dir, or tiny")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (interleaved)")
    p.add_argument("--prompts", type=int, default=3, help="requests per round, at once")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", type=Path, default=REPO / "bench/results/audit_hold.json")
    return p.parse_args(argv)


def spec_for(model_dir: Path, n_layers: int, mode: str) -> SwarmSpec:
    cut = [0, n_layers // 3, 2 * n_layers // 3, n_layers]
    return SwarmSpec.from_dict(
        {
            "swarm": {"name": f"bench-{mode}", "model": str(model_dir), "insecure": True},
            "limits": {"max_len": 256, "max_sessions": 16},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
            "stage": [
                {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": cut[i : i + 2]}
                for i in range(3)
            ],
            "standby": [
                {
                    "name": f"a{i}",
                    "listen": f"127.0.0.1:{9011 + i}",
                    "layers_of": f"s{i}",
                    "role": "auditor",
                }
                for i in range(3)
            ],
            "audit": {"enabled": True, "mode": mode},
        },
        source=f"bench-{mode}.toml",
    )


async def one_round(coordinator: Any, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    rows: list[dict[str, Any]] = []

    async def one(ids: list[int]) -> None:
        began = time.perf_counter()
        first: list[float] = []

        def arrived(got: tuple[int, ...]) -> None:
            if not first:
                first.append(time.perf_counter() - began)

        done = await generate_watching(
            coordinator, ids, arrived, max_tokens=max_tokens, ignore_eos=True
        )
        wall = time.perf_counter() - began
        rows.append(
            {"tokens": list(done.token_ids), "wall_s": wall, "first_s": first[0] if first else None,
             "tok_s": len(done.token_ids) / wall}
        )  # fmt: skip

    async with trio.open_nursery() as n:
        for ids in prompts:
            n.start_soon(one, ids)
    return rows


async def bench(args: argparse.Namespace, model_dir: Path, n_layers: int) -> dict[str, Any]:
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    rounds: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        handles = {}
        for mode in MODES:
            spec = spec_for(model_dir, n_layers, mode)
            handles[mode] = await nursery.start(
                partial(run_swarm, spec, model_dir=model_dir, network=MemoryNetwork(),
                        startup_timeout_s=600.0)
            )  # fmt: skip
        for r in range(args.rounds):
            for mode in MODES:
                rows = await one_round(handles[mode].coordinator, prompts, args.max_tokens)
                load = os.getloadavg()[0]
                rounds.append({"round": r, "mode": mode, "requests": rows, "load": load})
                med = statistics.median(x["tok_s"] for x in rows)
                print(f"round {r} {mode}: median {med:.2f} tok/s, load {load:.1f}", flush=True)
        audits = {m: str(h.checks.statistics()) for m, h in handles.items()}
        nursery.cancel_scope.cancel()
    summary: dict[str, Any] = {}
    for mode in MODES:
        reqs = [x for r in rounds if r["mode"] == mode for x in r["requests"]]
        summary[mode] = {
            "median_tok_s": statistics.median(x["tok_s"] for x in reqs),
            "median_first_token_s": statistics.median(x["first_s"] for x in reqs),
            "requests": len(reqs),
        }
    summary["ratio_tok_s_hold_over_sample"] = (
        summary["hold"]["median_tok_s"] / summary["sample"]["median_tok_s"]
    )
    same = all(
        a["tokens"] == b["tokens"]
        for ra, rb in zip(rounds[::2], rounds[1::2], strict=True)
        for a, b in zip(
            sorted(ra["requests"], key=lambda x: x["tokens"]),
            sorted(rb["requests"], key=lambda x: x["tokens"]),
            strict=True,
        )
    )
    return {"summary": summary, "outputs_identical": same, "audits": audits, "rounds": rounds}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", seed=11, n_layers=6)
        else:
            model_dir = resolve_model(args.model)
        n_layers = ModelConfig.from_dir(model_dir).n_layers
        result = trio.run(bench, args, model_dir, n_layers)
    result["config"] = {k: str(v) for k, v in vars(args).items()}
    result["command"] = " ".join(sys.argv)
    result["cpus"] = os.cpu_count()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2), "identical:", result["outputs_identical"])
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
