"""The ``shard`` command's argument parser: the command table, in the order ``--help`` lists it.

Each command's arguments are declared in ``shard.cli.args`` (one module per command module),
its work lives in the ``shard.cli`` module ``shard.cli.HANDLERS`` names; this module only
assembles the parser, so ``shard --help`` stays fast.
"""

from __future__ import annotations

import argparse

from shard import __version__
from shard.cli.args.base import Parser
from shard.cli.args.bench import add_bench
from shard.cli.args.convert import add_convert
from shard.cli.args.draft import add_draft
from shard.cli.args.generate import add_generate
from shard.cli.args.keys import add_receipt, add_trust
from shard.cli.args.ledger import add_ledger
from shard.cli.args.plan import add_plan
from shard.cli.args.relay import add_relay
from shard.cli.args.swarm import add_monitor, add_swarm
from shard.cli.args.up import add_up
from shard.cli.args.weights import add_weights

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
    add_generate(sub)
    add_swarm(sub)
    add_up(sub)
    add_monitor(sub)
    add_plan(sub)
    add_trust(sub)
    add_receipt(sub)
    add_ledger(sub)
    add_weights(sub)
    add_convert(sub)
    add_relay(sub)
    add_draft(sub)
    add_bench(sub)
    return parser
