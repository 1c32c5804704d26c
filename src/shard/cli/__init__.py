"""shard.cli: the operator surface — ``main`` (the ``shard`` command) and its one command table.
No module outside this package parses arguments (``tests/test_cli_table.py``). It may import
every other package; nothing imports it. Command modules are imported only when their command
runs, so ``shard --help`` stays fast.

Every subcommand's arguments are declared here, in ``args/``: one module of arguments per
command module below, on one parsing base (``args/base.py``), none importing another's;
``parser.py`` assembles them into the one parser, in the order ``shard --help`` lists them.
And every handler (``HANDLERS`` names each), one module per command family, each calling the
library that does the work::

    generate.py      ``shard generate``, local or through a swarm's client port
    up.py            ``shard up``: one node
    swarm.py         ``shard swarm up|run``, ``shard monitor``
    plan.py          ``shard plan SPEC`` (the placement planner); fit.py: ``plan --config``
    keys.py          ``keygen``, ``admit``, ``receipt verify``, ``api-key``
    ledger.py        ``shard ledger DIR``: the metering ledger of a folder of receipts
    weights.py       ``manifest build|sign|verify``, ``fetch``
    convert.py       ``shard convert MODEL.gguf OUT_DIR``
    relay.py         ``shard relay``, the delaying TCP relay
    draft.py         ``shard draft distill|train|path``
    bench.py         ``shard bench``, whose driver is ``benchmark/`` (rings side by side
                     against the analytical bound; it builds its swarms from a base spec)
    inputs.py        prompt arguments (``-`` for standard input) and prompt files
    errors.py        how operator errors are reported: one ``shard: error:`` line
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Final

from shard.logs import NOTE

__all__ = ["HANDLERS", "main"]

HANDLERS: Final = {
    "generate": ("shard.cli.generate", "generate"),
    "swarm": ("shard.cli.swarm", "swarm"),
    "up": ("shard.cli.up", "up"),
    "monitor": ("shard.cli.swarm", "monitor"),
    "plan": ("shard.cli.plan", "plan_main"),
    "keygen": ("shard.cli.keys", "keygen"),
    "api-key": ("shard.cli.keys", "api_key"),
    "admit": ("shard.cli.keys", "admit"),
    "receipt": ("shard.cli.keys", "receipt"),
    "ledger": ("shard.cli.ledger", "ledger"),
    "manifest": ("shard.cli.weights", "manifest_main"),
    "fetch": ("shard.cli.weights", "fetch_main"),
    "convert": ("shard.cli.convert", "convert"),
    "relay": ("shard.cli.relay", "relay"),
    "draft": ("shard.cli.draft", "draft"),
    "bench": ("shard.cli.bench", "bench"),
}
"""Every subcommand of ``build_parser()`` -> (module, function) that runs it."""

TOOLS: Final = frozenset({"convert", "relay", "draft", "bench"})
"""Commands that report their own errors and exit codes (one ``shard X: error:`` line, 2 or 1)
and set up no logging: they run outside ``dispatch``'s error mapping, as they always did."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shard ARGV``; returns the exit code."""
    from shard.cli.args.base import ParseExit
    from shard.cli.parser import build_parser

    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except ParseExit as done:  # a tool's help, or its one usage-error line
        return done.code
    if args.command in TOOLS:
        return handler(args.command)(args)
    return dispatch(args)


def handler(command: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs ``command`` (imported now: its module only when it runs)."""
    module, name = HANDLERS[command]
    run: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return run


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; an operator error is one ``shard: error:`` line and exit 1."""
    from shard.cli.errors import UsageError, leaves, operator_errors

    logging.basicConfig(
        level=logging.INFO if args.verbose else NOTE,  # NOTE: the good news, shown by default
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    run = handler(args.command)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        known = operator_errors()
        found = list(leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in found):
            return 130
        if found and all(isinstance(leaf, UsageError) for leaf in found):
            for leaf in found:
                print(f"shard {args.command}: error: {leaf}", file=sys.stderr)
            return 2
        if found and all(isinstance(leaf, known) for leaf in found):
            for leaf in found:
                print(f"shard: error: {leaf}", file=sys.stderr)
            return 1
        raise
