"""``shard up``'s arguments, ``--join``'s among them (run by ``shard.cli.up``)."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser, bounded


def add_up(sub: argparse._SubParsersAction[Parser]) -> None:
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
