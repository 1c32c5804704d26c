"""``shard draft {distill,train,eagle3,path}``: build a draft (``distill``), a draft head
(``train``) or an EAGLE-3 head (``eagle3``)
into the cache (or ``--out``), or print where a built one is. Exit status 0, 2 with one
``shard draft: error:`` line, or 130 when training is interrupted (run the same command again
to resume). The arguments are declared in ``shard.cli.args.draft``."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import attrs
import torch

from shard.convert.bundled import BUNDLED, ModelNotFound, resolve_model
from shard.decode.head.model import HeadError
from shard.decode.head.shipped import shipped_head
from shard.model.config import ModelLoadError
from shard.training.distill.build import MARKER, DistillError, distill
from shard.training.distill.cache import Recipe, cached_draft, draft_dir, is_complete, resolve_draft
from shard.training.distill.train import Measured
from shard.training.head.build import MARKER as HEAD_MARKER
from shard.training.head.build import HeadRecipe, train_head
from shard.training.head.cache import cached_head, features_dir, head_dir, resolve_head
from shard.training.head.cache import is_complete as head_is_complete
from shard.training.head.trainer import TrainSettings

__all__ = ["draft", "train_command"]


def draft(args: argparse.Namespace) -> int:
    """``shard draft {distill,train,path} ...``: build a draft or a head, or print where one
    is; 0, 2 on an error, 130 when training is interrupted."""
    try:
        if args.draft_command == "path" and (shipped := shipped_head(args.name)) is not None:
            print(shipped)
            return 0
        if args.draft_command == "path":
            is_head = args.name.endswith("-head") or (Path(args.name) / HEAD_MARKER).is_file()
            resolve = resolve_head if is_head else resolve_draft
            print(resolve(args.name, progress=False))
            return 0
        if args.draft_command == "train":
            return train_command(args)
        if args.draft_command == "eagle3":
            return _eagle3_command(args)
        return _distill_command(args)
    except (DistillError, HeadError, ModelNotFound, ModelLoadError, FileExistsError) as exc:
        print(f"shard draft: error: {exc}", file=sys.stderr)
        return 2


def _eagle3_command(args: argparse.Namespace) -> int:
    from shard.training.eagle3.run import DataPlan, build_eagle3
    from shard.training.eagle3.train import Eagle3Recipe

    for flag, value, low in [
        ("--tokens", args.tokens, 1),
        ("--minutes", args.minutes, 0.01),
        ("--draft-vocab", args.draft_vocab, 2),
        ("--threads", args.threads, 1),
        ("--copy-every", args.copy_every, 0),
    ]:
        if value < low:
            print(f"shard draft: error: {flag} must be at least {low:g}", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    target_dir = resolve_model(args.target)
    plan = DataPlan(tokens=args.tokens, seed=args.seed, copy_every=args.copy_every)
    recipe = Eagle3Recipe(draft_vocab=args.draft_vocab, seed=args.seed)
    try:
        with _sigterm_interrupts():
            report = build_eagle3(
                target_dir, args.out, plan=plan, recipe=recipe, minutes=args.minutes, data=args.data
            )
    except KeyboardInterrupt:
        print(
            "shard draft eagle3: interrupted; the text made so far is kept (run the same "
            "command again: it makes only what is missing, then trains from the start)",
            file=sys.stderr,
        )
        return 130
    m = report["measured"]
    print(
        f"wrote {args.out}: α per draft {' '.join(f'{a:.2f}' for a in m['alpha'])}, "
        f"tokens per verify of K = 1..4 {' '.join(f'{c:.2f}' for c in m['committed'])} over "
        f"{m['starts']} held-out starts; {m['draft_ms']:.1f} ms per drafted token"
    )
    return 0


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


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


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
    if args.out is None and head_is_complete(out) and not args.force:
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
    report = json.loads((out / HEAD_MARKER).read_text(encoding="utf-8"))
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
