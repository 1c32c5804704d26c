"""The ``shard`` command's argument parser: the command table, every subcommand's arguments.

This module declares ``generate``, ``swarm``, ``up``, ``monitor`` and ``plan``; ``parser_tools``
the keys, receipts, manifests, ``convert`` and ``relay``; ``parser_draft`` ``draft``;
``parser_bench`` ``bench``. Each subcommand's work lives in the ``shard.cli`` module
``shard.cli.HANDLERS`` names; this module only builds the parser, so ``shard --help`` stays
fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from shard import __version__
from shard.cli.parser_plan import add_plan
from shard.cli.parser_tools import (
    Parser,
    add_ledger,
    add_manifest,
    add_receipt,
    add_tools,
    add_trust,
    bounded,
)

EPILOG = """\
examples:
  shard swarm run specs/local.toml --prompt "The capital of France is"
  shard swarm run specs/local.toml --prompts specs/prompts.txt --json
  echo "Hello" | shard generate --local - --ignore-eos --max-tokens 32
  shard generate --local "The capital of France is"
  shard swarm up specs/local.toml --api 8000  # OpenAI API + chat page: http://127.0.0.1:8000/
  shard swarm up specs/wan-sim.toml          # then, elsewhere:
  shard generate --spec specs/wan-sim.toml "Write a haiku about rivers" --chat
  shard up --role stage --spec specs/local.toml --node s1
  shard up --role stage --join 127.0.0.1:7790 --spec specs/formed.toml --node gpu-a
  shard monitor --spec specs/local.toml       # watch a running swarm live
  shard convert model.gguf out_dir/
  shard bench specs/local.toml --latencies 0,25 --json out.json
  shard plan --rtt specs/geography/world.toml   # where the ring should run, and why
  shard keygen --out keys/authority.key      # the swarm's authority
  shard keygen --out keys/s0.key
  shard api-key --keys api-keys.txt --label alice   # a bearer key for [api] keys_file
  shard admit --authority keys/authority.key --node-pub keys/s0.key.pub --swarm lab \\
      --roles stage --expires 30d --out keys/s0.token
"""


def _within(field: str) -> Any:
    """An argparse type for the request field ``field``: its value within the one table of
    bounds the API and the coordinator also check (``shard.messages.bounds``, imported when
    the flag is given, so ``shard --help`` stays fast)."""

    def parse(text: str) -> int | float:
        from shard.messages.bounds import BOUNDS

        bound = BOUNDS[field]
        try:
            value: int | float = int(text) if bound.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {bound.describe()}") from None
        if not bound.holds(value):
            raise argparse.ArgumentTypeError(f"{text} is not {bound.describe()}")
        return value

    return parse


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=_within("max_tokens"),
        default=64,
        help="tokens to generate (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=_within("temperature"),
        default=0.0,
        help="0 = greedy (default; so is anything below 1e-4); >0 samples, up to 100",
    )
    p.add_argument(
        "--top-p",
        type=_within("top_p"),
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default 1)",
    )
    p.add_argument(
        "--top-k",
        type=_within("top_k"),
        default=0,
        help="keep the k likeliest tokens (0 = all)",
    )
    p.add_argument(
        "--seed",
        type=_within("seed"),
        default=0,
        help="sampling seed, a signed 64-bit integer: same seed, same output",
    )
    p.add_argument(
        "--k",
        type=_within("k"),
        default=None,
        help="with a swarm: drafted tokens per verify chunk for this request (0 = plain "
        "decoding; default: the spec's [speculation] policy)",
    )
    p.add_argument(
        "--depth",
        type=_within("depth"),
        default=None,
        help="with a swarm: verify chunks in flight for this request (default: the spec's)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _ignore_eos_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at end-of-sequence: generate exactly --max-tokens (benchmarks)",
    )


def _add_generate(sub: argparse._SubParsersAction[Parser]) -> None:
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
    _sampling_args(p)
    _ignore_eos_arg(p)


def _add_up(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "up",
        help="run one node of a swarm (the form an operator runs on each machine)",
        description="Run one node of the swarm described by SPEC until interrupted. A stage "
        "loads its block, dials its successor and then serves its predecessor; the "
        "coordinator serves the tail's return link, control links and clients, and dials "
        "stage 0; a standby ([[standby]] in the spec) loads its block, registers with the "
        "coordinator and waits to replace a stage that dies (docs/failover.md); an auditor "
        '([[standby]] with role = "auditor") loads the block of its layers_of stage and only '
        "re-runs the chunks the scheduler sends it to audit ([audit] enabled): it is never "
        "spliced into the ring (docs/security.md, spot checks). A node the swarm replaced "
        "(declared dead after a freeze, or evicted by an audit) stops with one line saying "
        "so and exit code 3: the run goes on without it.",
    )
    p.add_argument(
        "--role",
        required=True,
        choices=["stage", "coordinator", "standby", "auditor", "seeder"],
        help="which node this is; auditor: audits its block's stage, never joins the ring",
    )
    p.add_argument("--spec", required=True, help="swarm spec (TOML)")
    p.add_argument("--node", help="node name in the spec (default: the coordinator's name)")
    p.add_argument(
        "--standby-of",
        metavar="HOST:PORT",
        help="with --role coordinator: be the standby coordinator of the primary at "
        "HOST:PORT — follow its checkpoints and take over at [coordinator] standby when it "
        "dies (docs/failover.md, 'Standby coordinator')",
    )
    _join_args(p)
    p.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    p.add_argument(
        "--successor", help="dial this HOST:PORT downstream instead of the spec's (e.g. a relay)"
    )
    p.add_argument(
        "--device",
        help="cpu, cuda, cuda:N or auto: where this node computes (overrides the spec's device)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations (overrides the node's and the swarm's dtype in the spec)",
    )
    p.add_argument(
        "--weights",
        choices=["stored", "float32", "bfloat16", "float16", "int8", "int4"],
        help="how this node holds its weights (overrides the node's and the swarm's weights "
        "in the spec; docs/specs.md)",
    )
    p.add_argument(
        "--graphs",
        choices=["off", "lazy", "warm"],
        help="CUDA graphs per chunk shape on a GPU stage: lazy (first use), warm (at session "
        "open) or off (overrides the spec's graphs; docs/model.md)",
    )
    p.add_argument(
        "--layout",
        metavar="NAME=FIRST:LAST,...",
        help="run the spec with this ring: its stages in this order holding these blocks, "
        "the other stages and standbys standing by (what `shard plan SPEC` prints as "
        "`swarm up: --layout ...`; `swarm up/run` pass it to every node; every node of a "
        "swarm needs the same; docs/placement.md)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds (default 180)")
    p.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="with --role coordinator: serve the OpenAI-compatible HTTP API and the chat page "
        "at HOST:PORT (a bare PORT binds 127.0.0.1; default: the spec's [api] listen; "
        "docs/api.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for this node's forward pass (default: torch's choice; "
        "`swarm up/run` give each node its share of the cores)",
    )
    p.add_argument(
        "--die-with-parent",
        type=int,
        metavar="PID",
        default=None,
        help="exit as soon as process PID exits (the launcher of `swarm up/run` passes its own "
        "PID, so no node outlives it, even when it is SIGKILLed; Linux)",
    )


def _join_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join",
        metavar="HOST:PORT",
        help="with --role stage: join the coordinator at HOST:PORT with no layer range; its "
        "scheduler places this node (a block, or standby) from its measured profile and RTTs "
        "(a spec with [formation]; --node names this node; docs/placement.md)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:0",
        help="with --join: where this node accepts its predecessor and probes (default "
        "127.0.0.1:0; give an address the other nodes can reach)",
    )
    p.add_argument("--key", help="with --join: this node's secret key (secure swarms)")
    p.add_argument("--token", help="with --join: this node's admission token (secure swarms)")
    p.add_argument(
        "--memory-gib",
        type=bounded(float, 0.0, 1 << 20, "a size in GiB >= 0"),
        help="with --join: memory offered for weights (default: half of what is free)",
    )


def _add_swarm(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser("swarm", help="start a whole swarm from a spec as local processes")
    ssub = p.add_subparsers(dest="swarm_command", required=True, metavar="{up,run}")
    up = ssub.add_parser(
        "up",
        help="start every node of SPEC and keep them running until Ctrl-C",
        description="Start every node of SPEC as a local process (with delaying relays where "
        "the spec sets link latency) and keep them running until Ctrl-C, SIGTERM or SIGHUP, "
        "which stops them all (exit 128 + the signal). A stage or standby that dies is "
        "reported (SHARD NODE EXITED) and replaced by a standby; the swarm serves on "
        "(docs/failover.md). Only the coordinator's death ends it. First it plans the ring "
        "as `shard plan SPEC` does (--verbose prints that plan on stderr): when every stage is "
        '"auto" and the plan beats the ring as written (a shorter predicted lap), the '
        "nodes run the plan's order, blocks and standbys; a tie keeps the spec as written "
        "(docs/placement.md).",
    )
    up.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    up.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    _placement_args(up)
    up.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="the coordinator serves the OpenAI-compatible HTTP API and the chat page at "
        "HOST:PORT (a bare PORT binds 127.0.0.1; default: the spec's [api] listen; docs/api.md)",
    )
    up.add_argument(
        "--monitor",
        action="store_true",
        help="watch the swarm in the live monitor; quitting the monitor stops the swarm",
    )
    run = ssub.add_parser(
        "run",
        help="start SPEC, run prompt(s), print the output, tear everything down",
        description="Start every node of SPEC, run the prompt(s) through the ring, print the "
        "completions (or JSON with --json) and stop every process. The ring is planned as "
        "for `swarm up`.",
    )
    run.add_argument("spec", help="swarm spec (TOML), e.g. specs/local.toml")
    what = run.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; - reads it from standard input")
    what.add_argument("--prompts", help="a UTF-8 file with one prompt per line")
    run.add_argument("--model", help="checkpoint dir to use instead of resolving the spec's model")
    _placement_args(run)
    run.add_argument(
        "--receipt",
        metavar="OUT",
        help="write each run's signed receipt (JSON) to OUT (OUT.2.json, ... for more prompts)",
    )
    _sampling_args(run)
    _ignore_eos_arg(run)


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,  # `shard -v swarm ...` sets it too; absent here: keep that
        help="print the placement plan (as `shard plan SPEC`) and what runs, and log more; "
        "without it only a plan that changes the ring is named, in one line",
    )
    placement = p.add_mutually_exclusive_group()
    placement.add_argument(
        "--rtt",
        metavar="FILE",
        help="plan the ring over this geography (as `shard plan SPEC --rtt FILE`) and "
        "emulate its latencies on the ring's hops in place of the spec's [links] latency",
    )
    placement.add_argument(
        "--as-written",
        action="store_true",
        help="run the ring as the spec writes it (file order; its blocks, or the even split "
        'for "auto"): no planning',
    )


def _add_monitor(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "monitor",
        help="watch a running swarm live: ring latency, tok/s, α, stages, events",
        description="Open the live monitor on a coordinator's status feed: the ring with each "
        "edge's latency, tok/s and α sparklines, per-stage compute, the event log. Keys: q "
        "quits, p pauses, r resets the rolling statistics. Reconnects when the coordinator "
        "restarts.",
    )
    p.add_argument("address", nargs="?", help="the coordinator's HOST:PORT (with --swarm)")
    p.add_argument("--swarm", help="the swarm's name (the handshake checks it)")
    p.add_argument("--spec", help="swarm spec (TOML): its coordinator address and name")
    p.add_argument(
        "--key",
        help="with --spec of a secure swarm: this monitor's secret key (else [trust] client_key)",
    )
    p.add_argument(
        "--token",
        help="with --spec of a secure swarm: its token admitting role monitor (else [trust] "
        "client_token)",
    )


def build_parser() -> Parser:
    """The ``shard`` command's parser: every subcommand, each with the handler
    ``shard.cli.HANDLERS`` names."""
    parser = Parser(
        prog="shard",
        description="Run one large language model across many machines as a ring of stages.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (to stderr)")
    parser.add_argument("--version", action="version", version=f"shard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_swarm(sub)
    _add_up(sub)
    _add_monitor(sub)
    add_plan(sub)
    add_trust(sub)
    add_receipt(sub)
    add_ledger(sub)
    add_manifest(sub)
    add_tools(sub)
    return parser
