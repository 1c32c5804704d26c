"""``shard plan``'s arguments: the placement planner, and the fit of a model before
downloading it (run by ``shard.cli.plan`` and ``shard.cli.fit``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, bounded


def add_plan(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "plan",
        help="choose the ring's nodes, order, blocks and coordinator place by predicted lap",
        description="Plan a ring (docs/placement.md): choose which candidates hold layers, in "
        "which order, with which contiguous blocks (faster nodes take more, within memory), "
        "and where the coordinator runs, minimising the predicted lap (every hop's one-way "
        "latency + every stage's compute for a verify chunk). Exact up to 12 candidates "
        "(Held-Karp), a stated heuristic beyond. Prints the ring, the blocks, the standbys, "
        "the predicted lap and why the alternatives lost (the even split in file order, "
        "other coordinator places, one stage more or less). With SPEC the candidates are its "
        "stages and standbys and the model its model; what the spec does not say (speeds, "
        "memory) is assumed and printed; when no node is profiled the ring keeps the "
        "spec's number of stages. The last line says what `swarm up` runs: this plan's "
        "layout (with the coordinator where the spec puts it) when it beats the ring as "
        'written and every stage is "auto", else the spec as written, and why.',
    )
    p.add_argument(
        "spec", nargs="?", help="swarm spec (TOML): its stages and standbys are the candidates"
    )
    p.add_argument(
        "--rtt",
        metavar="FILE",
        help="a geography (TOML, or JSON by its .json suffix): the RTT matrix in ms, and "
        "optionally node profiles, the model and coordinator places; alone, it is the whole "
        "problem (e.g. specs/geography/world.toml)",
    )
    p.add_argument("--model", help="with SPEC: this checkpoint dir's config instead of the spec's")
    p.add_argument(
        "--coordinator",
        metavar="PLACE",
        help="force the coordinator to run at PLACE (a name in the RTT matrix)",
    )
    p.add_argument(
        "--pin-boundaries",
        action="store_true",
        help="only trusted nodes may hold the first block (embedding) and the last (head)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    fit = p.add_argument_group(
        "fit a model before downloading it (--config; no SPEC, no --rtt)",
        "From a config.json alone (e.g. specs/models/*/config.json): each stage's bytes "
        "under --weights, the contiguous split whose largest stage is smallest, and whether "
        "--stages cards of --memory GiB hold it (or how many would). Exit 0 when it fits, "
        "3 when it does not (the verdict says how many cards would), 1 for a bad config.",
    )
    fit.add_argument("--config", metavar="PATH", help="a config.json, or its directory")
    fit.add_argument(
        "--weights",
        default="bfloat16",
        choices=("float32", "bfloat16", "float16", "int8", "int4", "fp8"),
        help="how the stages hold their weights (default: bfloat16; fp8: a published FP8 "
        "checkpoint kept as stored, for a config whose quantization_config is FP8)",
    )
    fit.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "float16"),
        help="the dense parts' dtype with int8/int4 (norms, biases, routers; default bfloat16)",
    )
    fit.add_argument(
        "--stages",
        type=bounded(int, 1, 1024, "a number of stages >= 1"),
        default=3,
        help="how many cards (stages) to cut the model over (default: 3)",
    )
    fit.add_argument(
        "--memory",
        type=bounded(float, 0.001, 1 << 20, "a size in GiB > 0"),
        default=24.0,
        metavar="GIB",
        help="each card's memory in GiB (default: 24)",
    )
