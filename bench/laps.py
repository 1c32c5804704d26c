"""Dependent laps: how many ring round trips a draft needs when compute is free.

A projection from recorded outputs, not a measurement. At 25 ms per edge on this project's
2-core CPU a verify lap is ~100 ms of latency and ~200 ms of stage compute; on a ring of
GPUs the compute is milliseconds and the lap is nearly all latency. Then what sets the rate
is how many laps must happen one after another. One lap verifies up to ``D·(K+1) − 1``
guesses in sequence (D chunks of K drafts in flight; a pipelined chunk's first id guesses
the bonus token before it); it commits the guesses that hold and the target's next token,
and the next lap starts from there. Plain decoding needs one lap per token, so

    (decode tokens) / (dependent laps)

is the speedup over plain decoding that a draft allows once a lap is all latency — an upper
bound for a real ring, which also pays compute, wire and the draft's own time.

Input: a ``shard bench`` JSON (its ``references``: prompt text, chat flag and the target's
greedy ids). For each reference and each (K, D) it replays the n-gram proposer the
coordinator uses, drafting as the coordinator does (each chunk continues the context
including the drafts before it), and counts laps. The oracle row is the same count for a
draft that is always right. Writes JSON (``--json``) and prints a Markdown table.

    .venv/bin/python bench/laps.py bench/results/spec_ring_25ms.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shard.convert.bundled import resolve_model
from shard.coordinator.service import prompt_ids
from shard.decode.draft import NGramProposer
from shard.messages import GenerateRequest
from shard.model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
Propose = Callable[[Sequence[int], int], list[int]]


def lap_drafts(propose: Propose, context: list[int], k: int, depth: int) -> list[int]:
    """The guesses one lap verifies: ``depth`` chunks, each ``k`` drafts plus (after the
    first) the guess of the previous chunk's bonus token, drafted in order."""
    want = depth * (k + 1) - 1
    drafts: list[int] = []
    while len(drafts) < want:
        more = propose(context + drafts, min(k + 1, want - len(drafts)))
        if not more:
            break
        drafts.extend(more)
    return drafts


def count_laps(
    propose: Propose, prompt: Sequence[int], output: Sequence[int], k: int, depth: int
) -> int:
    """Decode laps to produce ``output`` after the prefill lap gave its first token."""
    done, laps = 1, 0
    while done < len(output):
        guesses = lap_drafts(propose, [*prompt, *output[:done]], k, depth)
        held = 0
        while (
            held < len(guesses)
            and done + held < len(output)
            and guesses[held] == output[done + held]
        ):
            held += 1
        done += held + 1
        laps += 1
    return laps


def oracle_laps(tokens: int, k: int, depth: int) -> int:
    per_lap = depth * (k + 1)
    return -(-(tokens - 1) // per_lap)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("results", type=Path, help="a shard bench JSON with references")
    ap.add_argument("--k", default="8", help="drafts per chunk, comma-separated (default 8)")
    ap.add_argument(
        "--depths", default="1,4", help="chunks in flight, comma-separated (default 1,4)"
    )
    ap.add_argument("--json", type=Path, help="write the counts here")
    args = ap.parse_args(argv)
    bench = json.loads(args.results.read_text())
    model_dir = resolve_model(bench["config"]["model"], progress=False)
    tokenizer = Tokenizer.from_dir(model_dir)
    ngram = NGramProposer().propose
    ks = [int(x) for x in args.k.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    rows: list[dict[str, Any]] = []
    for ref in bench["references"]:
        prompt = prompt_ids(tokenizer, GenerateRequest(0, ref["text_in"], 1, chat=ref["chat"]))
        output = ref["token_ids"]
        for k in ks:
            for depth in depths:
                for draft, laps in (
                    ("ngram", count_laps(ngram, prompt, output, k, depth)),
                    ("oracle", oracle_laps(len(output), k, depth)),
                ):
                    rows.append(
                        {
                            "prompt": ref["prompt"],
                            "set": ref["set"],
                            "draft": draft,
                            "k": k,
                            "depth": depth,
                            "tokens": len(output),
                            "laps": laps,
                            "x_plain": (len(output) - 1) / max(laps, 1),
                        }
                    )
    print("| prompt | set | tokens | K | D | n-gram laps | × plain | oracle laps | × plain |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    pairs = zip(rows[::2], rows[1::2], strict=True)
    for ng, orc in pairs:
        print(
            f"| {ng['prompt']} | {ng['set']} | {ng['tokens']} | {ng['k']} | {ng['depth']} | "
            f"{ng['laps']} | {ng['x_plain']:.1f}× | {orc['laps']} | {orc['x_plain']:.1f}× |"
        )
    for k in ks:
        for depth in depths:
            for s in sorted({r["set"] for r in rows}):
                xs = [
                    r["x_plain"]
                    for r in rows
                    if r["set"] == s
                    and r["k"] == k
                    and r["depth"] == depth
                    and r["draft"] == "ngram"
                ]
                print(f"median n-gram × plain, {s}, K {k}, D {depth}: {statistics.median(xs):.1f}×")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"source": str(args.results), "projection": "compute-free laps", "rows": rows},
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
