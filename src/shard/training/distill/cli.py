"""``shard draft {distill,train,path}``: build a draft (``distill``) or a draft head
(``train``, ``shard.training.head.cli``) into the cache (or ``--out``), or print where a built
one is. Exit status 0, or 2 with one ``shard draft: error:`` line."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import attrs
import torch

from shard.decode.head.model import HeadError
from shard.model.bundled import BUNDLED, ModelNotFound, resolve_model
from shard.model.config import ModelLoadError
from shard.training.distill.build import MARKER, DistillError, distill
from shard.training.distill.cache import (
    DEFAULT_LAYERS,
    DEFAULT_MINUTES,
    DEFAULT_STEPS,
    Recipe,
    cached_draft,
    draft_dir,
    is_complete,
    resolve_draft,
)
from shard.training.distill.train import Measured
from shard.training.head.build import MARKER as HEAD_MARKER
from shard.training.head.cache import resolve_head
from shard.training.head.cli import add_train_parser, train_command

__all__ = ["distill_main"]


def distill_main(argv: list[str] | None = None) -> int:
    """``shard draft {distill,train,path} ...``: build a draft or a head, or print where one
    is; 0, 2 on an error, 130 when training is interrupted."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(f"shard draft: error: {exc} (see shard draft --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.draft_command == "path":
            is_head = args.name.endswith("-head") or (Path(args.name) / HEAD_MARKER).is_file()
            resolve = resolve_head if is_head else resolve_draft
            print(resolve(args.name, progress=False))
            return 0
        if args.draft_command == "train":
            return train_command(args)
        return _distill_command(args)
    except (DistillError, HeadError, ModelNotFound, ModelLoadError) as exc:
        print(f"shard draft: error: {exc}", file=sys.stderr)
        return 2


def _distill_command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    target_dir = resolve_model(args.target, progress=not args.no_progress)
    name = args.target if args.target in BUNDLED else _slug(target_dir.name)
    recipe = Recipe(
        layers=args.layers, steps=args.steps, seed=args.seed, time_budget_s=args.minutes * 60
    )
    progress = not args.no_progress
    if args.out is not None:
        out = args.out
        distill(target_dir, out, progress=progress, **attrs.asdict(recipe))
    else:
        out = draft_dir(target_dir, name, args.layers)
        if is_complete(out) and not args.force:
            print(f"already built: {out} (--force rebuilds it)")
            return 0
        cached_draft(target_dir, name, recipe, force=args.force, progress=progress)
    m = Measured(**json.loads((out / MARKER).read_text(encoding="utf-8"))["measured"])
    print(
        f"wrote {out}: α {m.alpha:.2f} (untrained {m.alpha_truncated:.2f}; n-gram "
        f"{m.alpha_ngram:.2f} on {m.ngram_coverage:.0%} of positions) over {m.positions} "
        f"held-out positions; draft {m.draft_ms:.1f} ms/token, target {m.target_ms:.1f}"
    )
    return 0


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as an exception so ``distill_main`` can return 2 itself."""

    def error(self, message: str) -> Any:
        raise _UsageError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="shard draft", description="Build and find draft models.")
    sub = parser.add_subparsers(dest="draft_command", required=True, metavar="{distill,train,path}")
    p = sub.add_parser(
        "distill",
        help="distil a small draft model from a target (minutes, CPU)",
        description="Train the target's first N layers (+ its norm and tied head) to imitate "
        "the whole target on text it samples itself, then measure greedy agreement on "
        "held-out prompts. Writes into the cache unless --out is given.",
    )
    p.add_argument(
        "--target", default="smollm2", help="bundled name, checkpoint dir or .gguf (smollm2)"
    )
    p.add_argument(
        "--layers", type=int, default=DEFAULT_LAYERS, help=f"draft layers ({DEFAULT_LAYERS})"
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help=f"for sampling and training ({DEFAULT_MINUTES:g}); measuring adds about one",
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="at most this many steps")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling, training")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: OpenMP's spin-waits stall when other work shares the cores)",
    )
    p.add_argument("--out", type=Path, help="a new directory instead of the cache")
    p.add_argument("--force", action="store_true", help="rebuild a cached draft")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_train_parser(sub)
    path = sub.add_parser("path", help="print the directory of a built draft or head")
    path.add_argument("name", help="e.g. smollm2-distilled, smollm2-distilled-4L, smollm2-head")
    return parser


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"
