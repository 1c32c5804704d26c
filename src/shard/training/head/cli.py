"""``shard draft train``: train a draft head into the cache (or ``--out``); registered on the
``shard draft`` parser of ``shard.training.distill.cli``, which reports its errors."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import attrs
import torch

from shard.model.bundled import BUNDLED, resolve_model
from shard.training.head.build import MARKER, SAMPLE_DTYPES, HeadRecipe, train_head
from shard.training.head.cache import cached_head, features_dir, head_dir, is_complete
from shard.training.head.trainer import TrainSettings

__all__ = ["add_train_parser", "train_command"]

_DEFAULTS = HeadRecipe()


def add_train_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``train`` subcommand's arguments."""
    p = sub.add_parser(
        "train",
        help="train a feature-conditioned draft head for a target (minutes, CPU)",
        description="Sample text with the target and cache its features, train a one-layer "
        "draft head that reads them (EAGLE family), then measure chained acceptance on "
        "held-out prompts and the cost per drafted token. Resumable: an interrupted run "
        "continues from its last checkpoint. Writes into the cache unless --out is given.",
    )
    p.add_argument(
        "--target", default="smollm2", help="bundled name, checkpoint dir or .gguf (smollm2)"
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=_DEFAULTS.minutes,
        help=f"for features and training ({_DEFAULTS.minutes:g}); measuring adds about one",
    )
    p.add_argument(
        "--shortlist",
        type=int,
        default=_DEFAULTS.shortlist,
        help=f"readout vocabulary: the N tokens the target predicts most ({_DEFAULTS.shortlist}"
        "; 0 = all)",
    )
    p.add_argument("--layers", type=int, default=_DEFAULTS.layers, help="head layers (1)")
    p.add_argument("--window", type=int, default=_DEFAULTS.window, help="attention window (64)")
    p.add_argument("--steps", type=int, help="at most this many training steps")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling, training")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument(
        "--sample-dtype",
        choices=SAMPLE_DTYPES,
        default=_DEFAULTS.sample_dtype,
        help="dtype of the target copy that samples the training text: auto = bfloat16 on a "
        "CPU with bf16 instructions (1.8x the text per minute on one), else float32; "
        "training and measuring use float32 (auto)",
    )
    p.add_argument("--out", type=Path, help="a new directory instead of the cache")
    p.add_argument("--force", action="store_true", help="retrain a cached head")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def train_command(args: argparse.Namespace) -> int:
    """Run ``shard draft train``; 0 when a head is built (or already was)."""
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    target_dir = resolve_model(args.target, progress=progress)
    name = args.target if args.target in BUNDLED else Path(target_dir).name.lower()
    recipe = HeadRecipe(
        minutes=args.minutes,
        layers=args.layers,
        window=args.window,
        shortlist=args.shortlist,
        seed=args.seed,
        sample_dtype=args.sample_dtype,
        train=attrs.evolve(TrainSettings(), max_steps=args.steps),
    )
    out = args.out if args.out is not None else head_dir(target_dir, name, recipe)
    if args.out is None and is_complete(out) and not args.force:
        print(f"already built: {out} (--force retrains it)")
        return 0
    try:
        with _sigterm_interrupts():
            if args.out is not None:
                features = features_dir(target_dir, name, recipe)
                train_head(target_dir, out, features, recipe, progress=progress)
            else:
                cached_head(target_dir, name, recipe, force=args.force, progress=progress)
    except KeyboardInterrupt:
        print(
            "shard draft train: interrupted; run the same command again to resume", file=sys.stderr
        )
        return 130
    report = json.loads((out / MARKER).read_text(encoding="utf-8"))
    m = report["measured"]
    alphas = " ".join(f"{a:.2f}" for a in m["alpha"])
    print(
        f"wrote {out}: α1..α{len(m['alpha'])} {alphas}; {m['committed'][-1]:.2f} tokens per "
        f"verify of {len(m['alpha'])} drafts; {m['draft_ms']:.1f} ms per drafted token, target "
        f"{m['target_ms']:.1f} ({m['cost_ratio']:.0%}); {report['steps']} steps on "
        f"{report['feature_tokens']} tokens in {report['wall_s'] / 60:.1f} min"
    )
    return 0


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` (as Ctrl-C does), so training checkpoints first."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
