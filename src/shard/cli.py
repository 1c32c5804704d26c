"""The ``shard`` command: argument parsing and dispatch.

Each subcommand's work lives in the module that owns it (``commands``, ``swarm``, ``node``,
``model.gguf_import``, ``transport.relay``); this module only builds the parser, so
``shard --help`` stays fast (heavy modules are imported inside the handlers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

EPILOG = """\
examples:
  shard swarm run specs/local.toml --prompt "The capital of France is"
  shard generate --local "The capital of France is"
  shard swarm up specs/wan-sim.toml          # then, elsewhere:
  shard generate --spec specs/wan-sim.toml "Write a haiku about rivers" --chat
  shard up --role stage --spec specs/local.toml --node s1
  shard convert model.gguf out_dir/
"""


def _bounded(kind: type[int] | type[float], low: float, high: float, what: str) -> Any:
    """An argparse type accepting ``kind`` values in [low, high], with a message saying so."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=_bounded(int, 1, 1 << 30, "a positive integer"),
        default=64,
        help="tokens to generate (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=_bounded(float, 0.0, 100.0, "a temperature in [0, 100]"),
        default=0.0,
        help="0 = greedy (default); >0 samples",
    )
    p.add_argument(
        "--top-p",
        type=_bounded(float, 1e-9, 1.0, "a probability mass in (0, 1]"),
        default=1.0,
        help="nucleus sampling mass (default 1)",
    )
    p.add_argument(
        "--top-k",
        type=_bounded(int, 0, 1 << 30, "a non-negative integer"),
        default=0,
        help="keep the k likeliest tokens (0 = all)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same output")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        default="smollm2",
        help="'smollm2' (bundled, default), a checkpoint dir or a .gguf file (with --local)",
    )
    p.add_argument("--max-len", type=int, default=2048, help="KV length with --local")
    p.add_argument("prompt", help="the prompt text")
    _sampling_args(p)


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="run one node of a swarm (the form an operator runs on each machine)",
        description="Run one node of the swarm described by SPEC until interrupted. A stage "
        "loads its block, dials its successor and then serves its predecessor; the "
        "coordinator serves the tail's return link and clients, and dials stage 0.",
    )
    p.add_argument("--role", required=True, choices=["stage", "coordinator"])
    p.add_argument("--spec", required=True, help="swarm spec (TOML)")
    p.add_argument("--node", help="node name in the spec (default: the coordinator's name)")
    p.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    p.add_argument(
        "--successor", help="dial this HOST:PORT downstream instead of the spec's (e.g. a relay)"
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds (default 180)")


def _add_swarm(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("swarm", help="start a whole swarm from a spec as local processes")
    ssub = p.add_subparsers(dest="swarm_command", required=True, metavar="{up,run}")
    up = ssub.add_parser(
        "up",
        help="start every node of SPEC and keep them running until Ctrl-C",
        description="Start every node of SPEC as a local process (with delaying relays where "
        "the spec sets link latency) and keep them running until Ctrl-C, which stops them all.",
    )
    up.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    run = ssub.add_parser(
        "run",
        help="start SPEC, run prompt(s), print the output, tear everything down",
        description="Start every node of SPEC, run the prompt(s) through the ring, print the "
        "completions (or JSON with --json) and stop every process.",
    )
    run.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    what = run.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt")
    what.add_argument("--prompts", help="a file with one prompt per line")
    run.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    _sampling_args(run)


def _add_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conv = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint to a Hugging Face directory (safetensors)",
        add_help=False,
    )
    conv.add_argument("args", nargs=argparse.REMAINDER)
    relay = sub.add_parser(
        "relay", help="a delaying TCP relay that emulates a WAN link", add_help=False
    )
    relay.add_argument("args", nargs=argparse.REMAINDER)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shard",
        description="Run one large language model across many machines as a ring of stages.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (to stderr)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_swarm(sub)
    _add_up(sub)
    _add_tools(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # convert and relay own their argument parsing; pass everything after the name through.
    for name in ("convert", "relay"):
        if args_list[:1] == [name]:
            return _delegate(name, args_list[1:])
    args = build_parser().parse_args(args_list)
    from shard import commands

    return commands.dispatch(args)


def _delegate(name: str, rest: list[str]) -> int:
    if name == "convert":
        from shard.model.gguf_import import convert_main

        return convert_main(rest)
    from shard.transport.relay import relay_main

    return relay_main(rest)
