"""What every command's arguments are built with: ``Parser``, the class of every parser in
the command table (and ``ParseExit``, how a tool's parser ends), the argparse types ``bounded``
and ``within`` (a request field within ``shard.messages.bounds``), and the sampling flags that
``generate`` and ``swarm run`` share. Imports no command's arguments: each of those imports
this."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


class ParseExit(Exception):
    """A tool's parser finished parsing with this exit code (its help printed, or its one
    error line); ``shard.cli.main`` returns the code rather than exiting."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with two per-parser settings, both off by default.

    ``reports`` (e.g. ``"shard convert"``): a usage error is one line, ``shard convert: error:
    MESSAGE (see shard convert --help)``, exit 2, and ``--help`` returns 0, as the tools always
    did, instead of argparse's usage block and ``SystemExit``. ``strict``: arguments left over
    are this parser's error (``shard relay: error: unrecognized arguments``), not the top
    parser's. ``populate`` adds the arguments when this parser first parses, so a parser whose
    defaults live in a heavy module (``shard draft``: torch) costs ``shard --help`` nothing.
    """

    reports: str | None = None
    strict: bool = False
    populate: Callable[[Parser], None] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.populate is not None:
            populate, self.populate = self.populate, None
            populate(self)
        parsed, rest = super().parse_known_args(args, namespace)
        if rest and self.strict:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        return parsed, rest

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if self.reports is None:
            super().exit(status, message)
        if message:
            print(message, end="", file=sys.stderr)
        raise ParseExit(status)

    def error(self, message: str) -> NoReturn:
        if self.reports is None:
            super().error(message)
        print(f"{self.reports}: error: {message} (see {self.reports} --help)", file=sys.stderr)
        raise ParseExit(2)


def bounded(kind: type[int] | type[float], low: float, high: float, what: str) -> Any:
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


def within(field: str) -> Any:
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


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=within("max_tokens"),
        default=64,
        help="tokens to generate (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=within("temperature"),
        default=0.0,
        help="0 = greedy (default; so is anything below 1e-4); >0 samples, up to 100",
    )
    p.add_argument(
        "--top-p",
        type=within("top_p"),
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default 1)",
    )
    p.add_argument(
        "--top-k",
        type=within("top_k"),
        default=0,
        help="keep the k likeliest tokens (0 = all)",
    )
    p.add_argument(
        "--seed",
        type=within("seed"),
        default=0,
        help="sampling seed, a signed 64-bit integer: same seed, same output",
    )
    p.add_argument(
        "--k",
        type=within("k"),
        default=None,
        help="with a swarm: drafted tokens per verify chunk for this request (0 = plain "
        "decoding; default: the spec's [speculation] policy)",
    )
    p.add_argument(
        "--depth",
        type=within("depth"),
        default=None,
        help="with a swarm: verify chunks in flight for this request (default: the spec's)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def ignore_eos_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at end-of-sequence: generate exactly --max-tokens (benchmarks)",
    )
