"""``shard generate``'s arguments (run by ``shard.cli.generate``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, bounded, ignore_eos_arg, sampling_args


def add_generate(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text: on this machine (--local) or on a running swarm (--spec)",
        description="Generate a completion. --local runs the whole model in this process "
        "(the reference every distributed mode is compared with); --spec sends the prompt to "
        "the coordinator of a running swarm.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the whole model here")
    where.add_argument("--spec", help="swarm spec (TOML) of a running swarm")
    p.add_argument(
        "--model",
        help="with --local: 'smollm2' (bundled, default), 'gemma3-270m' (bundled, a base "
        "model), a checkpoint dir or a .gguf file",
    )
    p.add_argument(
        "--weights",
        choices=["stored", "float32", "int8", "int4"],
        help="with --local: how the model holds its weights: stored (a quantized checkpoint's "
        "own blocks; the default for one, as the bundled models are), float32 (a float "
        "checkpoint's default), int8 or int4 (quantized at load); docs/model.md",
    )
    p.add_argument(
        "--max-len",
        type=bounded(int, 1, (1 << 31) - 1, "a positive integer"),
        default=None,
        help="KV length with --local (default: 2048, capped at the model's context length)",
    )
    p.add_argument(
        "--key", help="this client's secret key (secure swarms; else [trust] client_key)"
    )
    p.add_argument("--token", help="this client's admission token (secure swarms)")
    p.add_argument(
        "--receipt",
        metavar="OUT",
        help="with --spec: write the run's signed receipt (JSON) to OUT; check it with "
        "`shard receipt verify OUT`",
    )
    p.add_argument("prompt", help="the prompt text; - reads it from standard input")
    sampling_args(p)
    ignore_eos_arg(p)
