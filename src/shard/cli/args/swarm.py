"""``shard swarm up|run``'s and ``shard monitor``'s arguments (run by ``shard.cli.swarm``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, ignore_eos_arg, sampling_args


def add_swarm(sub: argparse._SubParsersAction[Parser]) -> None:
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
    sampling_args(run)
    ignore_eos_arg(run)


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


def add_monitor(sub: argparse._SubParsersAction[Parser]) -> None:
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
