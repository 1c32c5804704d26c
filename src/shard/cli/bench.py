"""``shard bench``: the speculative ring benchmark (``shard.cli.benchmark``). The arguments
are declared in ``shard.cli.args.bench`` and checked by ``shard.cli.benchmark.options``;
``bench_main`` is the same command with a parser of its own, for
``bench/speculation_ring.py``. Exit status 0, or 1 with one ``PROG: error:`` line on a bad
option, spec or head."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from shard.cli.args.bench import bench_parser
from shard.cli.benchmark.main import run_bench
from shard.cli.benchmark.options import Options, OptionsError, options

__all__ = ["bench", "bench_main", "parse"]


def bench(args: argparse.Namespace) -> int:
    """Run ``shard bench``; default paths resolve against the working directory."""
    return _run(lambda: options(vars(args), root=Path.cwd()), "shard bench")


def bench_main(argv: Sequence[str], *, root: Path | None = None, prog: str = "shard bench") -> int:
    """Parse ``argv`` with a parser of its own (``prog`` names it) and run the benchmark;
    default paths resolve against ``root`` (default: the working directory)."""
    return _run(lambda: parse(argv, root=root or Path.cwd(), prog=prog), prog)


def parse(
    argv: Sequence[str], *, root: Path, prog: str, now: datetime.datetime | None = None
) -> Options:
    """``argv`` parsed and checked. Errors: ``OptionsError`` for bad values (argparse exits on
    bad flags)."""
    return options(vars(bench_parser(prog).parse_args(list(argv))), root=root, now=now)


def _run(checked: Callable[[], Options], prog: str) -> int:
    try:
        opts = checked()
    except OptionsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return run_bench(opts, prog=prog)
