"""``shard draft {distill,train,eagle3,path}``'s arguments: the draft family of the command table
(run by ``shard.cli.draft``).

Its defaults live in the training modules (which import torch), so the arguments are added
when ``shard draft`` parses (``Parser.populate``), not when ``shard --help`` runs. Usage errors
are one ``shard draft: error:`` line and exit 2, as they always were."""

from __future__ import annotations

import argparse
from pathlib import Path

from shard.cli.args.base import Parser


def add_draft(sub: argparse._SubParsersAction[Parser]) -> None:
    """The ``draft`` subcommand; its own subcommands are added when it parses."""
    draft = sub.add_parser(
        "draft",
        help="build drafts for a target (`shard draft distill`, `train`, `eagle3`)",
        description="Build and find draft models.",
    )
    draft.reports, draft.strict, draft.populate = "shard draft", True, _draft_commands


def _draft_commands(draft: Parser) -> None:
    dsub = draft.add_subparsers(
        dest="draft_command", required=True, metavar="{distill,train,eagle3,path}"
    )
    distill, train, eagle3 = _add_distill(dsub), _add_train(dsub), _add_eagle3(dsub)
    path = dsub.add_parser("path", help="print the directory of a built draft or head")
    path.add_argument(
        "name", help="e.g. smollm2-distilled, smollm2-distilled-4L, smollm2-head, smollm2-eagle3"
    )
    for parser in (distill, train, eagle3, path):
        parser.reports = "shard draft"


def _add_distill(dsub: argparse._SubParsersAction[Parser]) -> Parser:
    from shard.training.distill.cache import DEFAULT_LAYERS, DEFAULT_MINUTES, DEFAULT_STEPS

    p = dsub.add_parser(
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
    return p


def _add_train(dsub: argparse._SubParsersAction[Parser]) -> Parser:
    from shard.training.head.build import SAMPLE_DTYPES, HeadRecipe

    defaults = HeadRecipe()
    p = dsub.add_parser(
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
        default=defaults.minutes,
        help=f"for features and training ({defaults.minutes:g}); measuring adds about one",
    )
    p.add_argument(
        "--shortlist",
        type=int,
        default=defaults.shortlist,
        help=f"readout vocabulary: the N tokens the target predicts most ({defaults.shortlist}"
        "; 0 = all)",
    )
    p.add_argument("--layers", type=int, default=defaults.layers, help="head layers (1)")
    p.add_argument("--window", type=int, default=defaults.window, help="attention window (64)")
    p.add_argument("--steps", type=int, help="at most this many training steps")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling, training")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument(
        "--sample-dtype",
        choices=SAMPLE_DTYPES,
        default=defaults.sample_dtype,
        help="dtype of the target copy that samples the training text: auto = bfloat16 on a "
        "CPU with bf16 instructions (1.8x the text per minute on one), else float32; "
        "training and measuring use float32 (auto)",
    )
    p.add_argument("--out", type=Path, help="a new directory instead of the cache")
    p.add_argument("--force", action="store_true", help="retrain a cached head")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _add_eagle3(dsub: argparse._SubParsersAction[Parser]) -> Parser:
    from shard.training.eagle3.run import DataPlan
    from shard.training.eagle3.train import Eagle3Recipe

    plan, recipe = DataPlan(), Eagle3Recipe()
    p = dsub.add_parser(
        "eagle3",
        help="train an EAGLE-3 head for a target, in the published layout (about an hour, CPU)",
        description="Continue varied prompts with the target (greedy and at low temperatures) "
        "keeping the states entering three of its layers, train an EAGLE-3 head on them with "
        "the training-time test, measure chained acceptance on held-out prompts, and write "
        "the head as SpecForge does (config.json, model.safetensors, train.json). The text "
        "is cached and reused. How the shipped smollm2-eagle3 head was made.",
    )
    p.add_argument(
        "--target", default="smollm2", help="bundled name, checkpoint dir or .gguf (smollm2)"
    )
    p.add_argument("--out", type=Path, required=True, help="a new directory for the head")
    p.add_argument(
        "--tokens", type=int, default=plan.tokens, help=f"positions of text ({plan.tokens})"
    )
    p.add_argument("--minutes", type=float, default=30.0, help="of training (30)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=recipe.draft_vocab,
        help=f"the head's vocabulary: the target's most written tokens ({recipe.draft_vocab})",
    )
    p.add_argument(
        "--copy-every",
        type=int,
        default=plan.copy_every,
        help="every Nth chunk of text is copy tasks (0, the shipped head: none; docs/drafts.md)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling, training")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--data", type=Path, help="where the text is cached (default: the cache)")
    return p
