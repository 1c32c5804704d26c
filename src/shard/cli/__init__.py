"""shard.cli: the operator surface — ``main`` (the ``shard`` command), its parser
(``parser.py``), one module per command family (``generate``, ``swarm``, ``keys``,
``weights``, ``plan``) and how operator errors are reported (``errors.py``). It may import
every other package; nothing imports it. Command modules are imported only when their
command runs, so ``shard --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shard ARGV``; returns the exit code."""
    from shard.cli.parser import build_parser

    args_list = list(sys.argv[1:] if argv is None else argv)
    # convert, relay, draft and bench own their argument parsing; everything after the name
    # goes to them.
    for name in ("convert", "relay", "draft", "bench"):
        if args_list[:1] == [name]:
            return _delegate(name, args_list[1:])
    return dispatch(build_parser().parse_args(args_list))


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    if command == "generate":
        from shard.cli.generate import generate

        return generate
    if command in ("keygen", "admit", "receipt", "api-key"):
        from shard.cli import keys

        handlers = {"keygen": keys.keygen, "admit": keys.admit, "receipt": keys.receipt}
        return {**handlers, "api-key": keys.api_key}[command]
    if command == "plan":
        from shard.cli.plan import plan_main

        return plan_main
    if command in ("up", "swarm", "monitor"):
        from shard.cli import swarm

        return {"up": swarm.up, "swarm": swarm.swarm, "monitor": swarm.monitor}[command]
    from shard.cli import weights

    return {"manifest": weights.manifest_main, "fetch": weights.fetch_main}[command]


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; an operator error is one ``shard: error:`` line and exit 1."""
    from shard.cli.errors import UsageError, leaves, operator_errors

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    handler = _handler(args.command)
    try:
        return handler(args)
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


def _delegate(name: str, rest: list[str]) -> int:
    if name == "convert":
        from shard.model.gguf_import import convert_main

        return convert_main(rest)
    if name == "draft":
        from shard.training.distill.cli import distill_main

        return distill_main(rest)
    if name == "bench":
        from shard.bench import bench_main

        return bench_main(rest)
    from shard.transport.relay import relay_main

    return relay_main(rest)
