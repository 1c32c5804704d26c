"""What features on the return path cost, side by side: verdict bytes and decode tok/s.

In one run, on the bundled SmolLM2 (fp32, CPU; hidden 576, so one feature row is 1152 bytes
in float16):

- ``bytes``: the frame of a ``Verdict`` (three ``Hop`` records, as from a 3-stage ring)
  without and with features, for a plain decode step (1 row), a verify chunk whose 4 drafts
  all held (5 rows) and the prompt's final verdict with a 16-row window; and the median
  ``encode -> decode`` time of each (what the tail and the coordinator pay per frame, plus
  the coordinator's check, ``verdict_features``), and the tail's own cost of the rows
  (fp32 -> float16, ``to_wire``; the norm itself is computed anyway, for the head);
- ``speed``: one in-process ring (``shard.nodes.inprocess.run_swarm``: 3 stages and the
  coordinator in this process, every frame through the wire codec, ``--latency-ms`` one way
  per edge, 25 by default), greedy, ``ignore_eos``, ``--max-tokens`` per prompt, four modes
  interleaved prompt by prompt so a drift in the machine's load hits them alike:
  ``plain`` (a proposer that never guesses: one position per lap) and ``ngram`` (prompt
  lookup, K = 4, D = 1), each ``-off`` (features 0) and ``-on`` (a 16-row window). Decode
  tok/s is (tokens - 1) / (seconds - prefill); outputs of ``-on`` are compared with ``-off``
  (``identical``), reported, never asserted.

Writes JSON (``--json``), prints a Markdown summary. Benchmarks are not tests: nothing here
asserts a speed, and on a shared machine the figures are indicative (the load average is
recorded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio

from plain_ring import REPO, Prompt, git_info, machine_info
from shard.compute.tensors import to_wire
from shard.convert.bundled import resolve_model
from shard.coordinator.features import verdict_features
from shard.decode.control import SpeculationConfig
from shard.decode.draft import Drafter, NGramProposer, Proposer
from shard.messages import ChunkSeq, Epoch, Hop, NodeName, SessionId, Verdict
from shard.model.config import ModelConfig
from shard.model.tokenizer import Tokenizer
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.spec.swarm import SwarmSpec
from shard.transport import MemoryNetwork
from shard.wire import decode, encode

Record = dict[str, Any]
WINDOW = 16
MODES = ("plain-off", "plain-on", "ngram-off", "ngram-on")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/feature_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example (~3 min on 2 idle cores): .venv/bin/python bench/feature_cost.py",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--latency-ms", type=float, default=25.0, help="one way per ring edge")
    p.add_argument(
        "--prompts",
        default="01-copy,03-prose,04-chat",
        help="comma-separated names in bench/prompts (default 01-copy,03-prose,04-chat)",
    )
    p.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    p.add_argument(
        "--model", default="smollm2", help="bundled name or checkpoint dir (default smollm2)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench/results/feature_cost.json",
        help="output file (default bench/results/feature_cost.json)",
    )
    return p.parse_args(argv)


# -- bytes -------------------------------------------------------------------------------------


def verdicts(hidden: int) -> dict[str, tuple[Verdict, Verdict, int | None]]:
    """(without, with features, prompt_len or None) for each verdict shape of the hot path."""
    hops = tuple(
        Hop(NodeName(f"s{i}"), 0.0123, 1.7e9 + i, 1.7e9 + i + 0.01, 0.0004, 5, 1234)
        for i in range(3)
    )
    out: dict[str, tuple[Verdict, Verdict, int | None]] = {}
    shapes = {"decode (1 row)": (300, 1, None), "verify 4/4 (5 rows)": (300, 5, None)}
    shapes["prompt (16 rows)"] = (120, 1, 128)
    for name, (start, n, prompt_len) in shapes.items():
        plain = Verdict(
            SessionId(7), Epoch(1), ChunkSeq(42), start, tuple(range(900, 900 + n)), n - 1, hops
        )
        rows = WINDOW if prompt_len else n
        end = prompt_len if prompt_len else start + n
        feats = to_wire(torch.randn(rows, hidden).half())
        rich = Verdict(
            plain.session,
            plain.epoch,
            plain.seq,
            start,
            plain.target_ids,
            plain.accepted,
            hops,
            features=feats,
            features_start=end - rows,
        )
        out[name] = (plain, rich, prompt_len)
    return out


def tail_us(rows: int, hidden: int, reps: int = 2000) -> float:
    """Median microseconds the tail spends on ``rows`` features after its forward: fp32 ->
    float16 on the CPU, then the wire payload (``to_wire``)."""
    feats = torch.randn(1, rows, hidden)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps // 5):
            to_wire(feats[0].to("cpu", torch.float16))
        rounds.append((time.perf_counter() - t0) / (reps // 5) * 1e6)
    return round(statistics.median(rounds), 1)


def byte_costs(hidden: int, reps: int = 2000) -> list[Record]:
    """Frame bytes and median encode+decode(+check) microseconds, without and with; and the
    tail's own conversion of the rows."""
    rows = []
    for name, (plain, rich, prompt_len) in verdicts(hidden).items():
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(5):  # rounds, interleaved
            for mode, msg in (("off", plain), ("on", rich)):
                window = WINDOW if mode == "on" else 0
                t0 = time.perf_counter()
                for _ in range(reps // 5):
                    got = decode(encode(msg))
                    assert isinstance(got, Verdict)
                    verdict_features(got, window=window, dim=hidden, prompt_len=prompt_len)
                times[mode].append((time.perf_counter() - t0) / (reps // 5) * 1e6)
        off, on = len(encode(plain)), len(encode(rich))
        rows.append(
            {
                "verdict": name,
                "bytes_off": off,
                "bytes_on": on,
                "extra_bytes": on - off,
                "us_off": round(statistics.median(times["off"]), 1),
                "us_on": round(statistics.median(times["on"]), 1),
                "tail_us": tail_us(rich.features.shape[0] if rich.features else 0, hidden),
            }
        )
    return rows


# -- speed -------------------------------------------------------------------------------------


class NoGuess:
    """Plain decoding through the speculative loop: never guesses; may ask for features."""

    name = "noguess"
    computes = False

    def __init__(self, features: int) -> None:
        self.features = features
        self.rows = 0

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        self.rows += int(features.shape[0])


class WithFeatures:
    """An n-gram proposer that also asks for (and counts) features."""

    name = "ngram"
    computes = False

    def __init__(self, features: int) -> None:
        self._inner = NGramProposer()
        self.features = features
        self.rows = 0

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self._inner.propose(context, k)

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        self.rows += int(features.shape[0])


def proposer_for(mode: str) -> NoGuess | WithFeatures:
    window = WINDOW if mode.endswith("-on") else 0
    return NoGuess(window) if mode.startswith("plain") else WithFeatures(window)


def ring_spec(model_dir: Path, latency_ms: float) -> SwarmSpec:
    data: dict[str, Any] = {
        "swarm": {"name": "features", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 2048, "prefill_chunk": 128, "max_sessions": 4},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9300"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9301 + i}", "layers": "auto"} for i in range(3)
        ],
        "links": {"latency_ms": latency_ms},
        "speculation": {"draft": "ngram"},
    }
    return SwarmSpec.from_dict(data, source="feature_cost")


def prompt_tokens(model_dir: Path, names: Sequence[str]) -> list[tuple[str, list[int]]]:
    tokenizer = Tokenizer.from_dir(model_dir)
    out = []
    for name in names:
        prompt = Prompt.from_file(REPO / "bench/prompts" / f"{name}.txt")
        text = prompt.text
        if prompt.chat:
            text = tokenizer.apply_chat([{"role": "user", "content": text}])
        out.append((name, tokenizer.encode(text)))
    return out


async def speed(model_dir: Path, args: argparse.Namespace) -> list[Record]:
    """Every mode on every prompt through one ring, modes interleaved per prompt."""
    spec = ring_spec(model_dir, args.latency_ms)
    prompts = prompt_tokens(model_dir, args.prompts.split(","))
    current: list[Proposer] = []

    def drafts(_spec: SwarmSpec, _dir: Path) -> Drafter:
        return Drafter(lambda _prompt: current[-1])

    runs: list[Record] = []
    async with trio.open_nursery() as nursery:
        handle: CoordinatorHandle = await nursery.start(
            lambda task_status: run_swarm(
                spec,
                model_dir=model_dir,
                network=MemoryNetwork(encode_frames=True),
                drafts=drafts,
                startup_timeout_s=300.0,
                task_status=task_status,
            )
        )
        for rnd in range(args.rounds):
            for name, ids in prompts:
                for mode in MODES:
                    proposer = proposer_for(mode)
                    current.append(proposer)
                    k = 4 if mode.startswith("ngram") else 1
                    done = await handle.coordinator.generate(
                        ids,
                        max_tokens=args.max_tokens,
                        speculation=SpeculationConfig(k=k, depth=1),
                        ignore_eos=True,
                    )
                    s = done.stats
                    decode_s = s.seconds - s.prefill_s
                    runs.append(
                        {
                            "round": rnd,
                            "prompt": name,
                            "prompt_tokens": len(ids),
                            "mode": mode,
                            "tokens": s.tokens,
                            "decode_tok_s": (s.tokens - 1) / decode_s if decode_s > 0 else None,
                            "prefill_s": s.prefill_s,
                            "laps": s.laps,
                            "tokens_per_lap": s.tokens_per_lap,
                            "feature_rows": proposer.rows,
                            "token_ids": list(done.token_ids),
                        }
                    )
                    print(
                        f"{name} {mode}: {runs[-1]['decode_tok_s']:.2f} tok/s, "
                        f"{proposer.rows} feature rows",
                        file=sys.stderr,
                        flush=True,
                    )
        nursery.cancel_scope.cancel()
    return runs


def summarize(runs: Sequence[Record]) -> list[Record]:
    """Per mode pair: median decode tok/s off and on, the paired ratios (each prompt's on
    over its off, run back to back: median, min, max), and identical outputs."""
    rows = []
    for kind in ("plain", "ngram"):
        off = [r for r in runs if r["mode"] == f"{kind}-off"]
        on = [r for r in runs if r["mode"] == f"{kind}-on"]
        ratios = [b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(off, on, strict=True)]
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(off, on, strict=True))
        rows.append(
            {
                "draft": kind,
                "decode_tok_s_off": round(statistics.median(r["decode_tok_s"] for r in off), 3),
                "decode_tok_s_on": round(statistics.median(r["decode_tok_s"] for r in on), 3),
                "paired_ratio_median": round(statistics.median(ratios), 3),
                "paired_ratio_min": round(min(ratios), 3),
                "paired_ratio_max": round(max(ratios), 3),
                "tokens_per_lap_on": round(statistics.median(r["tokens_per_lap"] for r in on), 2),
                "identical": same,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args.model)
    hidden = ModelConfig.from_dir(model_dir).hidden_size
    load_before = os.getloadavg()
    began = time.time()
    sizes = byte_costs(hidden)
    runs = trio.run(speed, model_dir, args)
    summary = summarize(runs)
    result = {
        "bench": "feature_cost",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine_info(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "seconds": round(time.time() - began, 1),
        "config": {
            "model": args.model,
            "hidden": hidden,
            "window": WINDOW,
            "latency_ms": args.latency_ms,
            "max_tokens": args.max_tokens,
            "prompts": args.prompts,
            "rounds": args.rounds,
            "ring": "in-process run_swarm, 3 stages, every frame encoded (MemoryNetwork)",
        },
        "bytes": sizes,
        "summary": summary,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| verdict | bytes off | bytes on | + bytes | codec µs off | codec µs on | tail µs |"
        "\n|---|---|---|---|---|---|---|"
    )
    for r in sizes:
        print(
            f"| {r['verdict']} | {r['bytes_off']} | {r['bytes_on']} | {r['extra_bytes']} "
            f"| {r['us_off']} | {r['us_on']} | {r['tail_us']} |"
        )
    print(
        "\n| draft | tok/s off | tok/s on | on/off (paired: median, min-max) | identical |"
        "\n|---|---|---|---|---|"
    )
    for r in summary:
        print(
            f"| {r['draft']} | {r['decode_tok_s_off']} | {r['decode_tok_s_on']} "
            f"| {r['paired_ratio_median']} ({r['paired_ratio_min']}-{r['paired_ratio_max']}) "
            f"| {r['identical']} |"
        )
    print(f"\nload average before {load_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
