"""Distil a small draft model from the target, offline, in minutes, on a CPU.

The draft is the target's first ``layers`` layers plus its final norm and (tied) embedding
and head, so it shares the target's tokenizer and embedding; the layers and the norm are then
trained to imitate the whole target (knowledge distillation). The work is split by idea:

    distill_data.py    training text (the target's own samples, stdlib code), target labels
    distill_train.py   the loss and training loop; ``measure``, the held-out agreement check
    distill.py         ``distill``: the recipe end to end, the checkpoint, the cache, the CLI

The result is an ordinary Hugging Face checkpoint directory (``load_stage(dir, 0, layers)``,
``[speculation] draft_model = "dir"``) whose ``distill.json`` records the settings and the
measured agreement. It is built in a temporary sibling and renamed into place with
``distill.json`` written last, so a directory without it is never a draft.
``resolve_draft("smollm2-distilled")`` finds a built draft in the cache; building it takes
minutes, so it happens only on request (``shard draft distill``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from shard.decode.distill.data import build_corpus
from shard.decode.distill.train import Measured, measure, reference_runs, train
from shard.model.bundled import BUNDLED, ModelNotFound, cache_dir, resolve_model
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.llama import StageModel
from shard.model.loader import hf_name, load_stage, load_truncated
from shard.model.tokenizer import Tokenizer

__all__ = [
    "MARKER",
    "DistillError",
    "DistillReport",
    "DraftNotFound",
    "Recipe",
    "cached_draft",
    "distill",
    "distill_main",
    "draft_dir",
    "is_complete",
    "resolve_draft",
    "write_checkpoint",
]

DISTILL_VERSION = 1
"""Bumped whenever training changes what a draft is, so cached drafts are rebuilt."""

MARKER = "distill.json"
"""Settings and measured agreement; written last, so its presence means the directory is whole."""

_DATA_SHARE = 0.5  # of a time budget, at most, for sampling and labelling text
_EPOCHS = 4  # the corpus is ``steps * batch / _EPOCHS`` rows


class DistillError(Exception):
    """A draft cannot be distilled or found; the message says what to do."""


@attrs.frozen
class DistillReport:
    """What ``distill`` built, how, and how well it agrees with its target."""

    out_dir: Path
    target: str
    layers: int
    steps: int
    seq_len: int
    batch: int
    seed: int
    time_budget_s: float | None
    threads: int
    rows: int
    train_tokens: int
    data_s: float
    train_s: float
    loss_first: float
    loss_last: float
    measured: Measured

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["distill_version"] = DISTILL_VERSION
        return d


def distill(
    target_dir: Path,
    out_dir: Path,
    *,
    layers: int,
    steps: int,
    seq_len: int,
    batch: int,
    seed: int,
    progress: bool,
    time_budget_s: float | None,
) -> DistillReport:
    """Train a ``layers``-layer draft of the model in ``target_dir``; publish it as ``out_dir``.

    ``time_budget_s`` caps sampling plus training (the learning-rate schedule follows
    whichever of steps and time runs out first); measuring adds about a minute for SmolLM2.
    ``out_dir`` is built in a temporary sibling and renamed into place with ``MARKER`` written last.

    Errors: ``DistillError`` when ``out_dir`` exists or the layer count is out of range.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.exists():
        raise DistillError(f"{out_dir} already exists; remove it or choose another directory")
    target = load_stage(target_dir, 0, ModelConfig.from_dir(target_dir).n_layers)
    if not 0 < layers < target.config.n_layers:
        raise DistillError(f"a draft needs 1..{target.config.n_layers - 1} layers, got {layers}")
    tokenizer = Tokenizer.from_dir(target_dir)
    torch.manual_seed(seed)
    began = time.perf_counter()
    data_budget = None if time_budget_s is None else _DATA_SHARE * time_budget_s
    rows = max(batch, steps * batch // _EPOCHS)
    corpus = build_corpus(target, tokenizer, rows, seq_len, seed, data_budget, progress)
    data_s = time.perf_counter() - began
    student = load_truncated(target_dir, layers)
    train_budget = None if time_budget_s is None else max(time_budget_s - data_s, 0.0)
    losses = train(
        student,
        corpus,
        steps=steps,
        batch=batch,
        seed=seed,
        budget_s=train_budget,
        progress=progress,
    )
    train_s = time.perf_counter() - began - data_s
    baseline = load_truncated(target_dir, layers)
    report = DistillReport(
        out_dir=out_dir,
        target=str(target_dir),
        layers=layers,
        steps=len(losses),
        seq_len=seq_len,
        batch=batch,
        seed=seed,
        time_budget_s=time_budget_s,
        threads=torch.get_num_threads(),
        rows=int(corpus.ids.shape[0]),
        train_tokens=corpus.tokens,
        data_s=round(data_s, 1),
        train_s=round(train_s, 1),
        loss_first=round(losses[0], 4),
        loss_last=round(sum(losses[-10:]) / len(losses[-10:]), 4),
        measured=measure(target, student, baseline, reference_runs(target, tokenizer)),
    )
    _publish(target_dir, student, report)
    return report


class DraftExists(DistillError):
    """The output directory appeared while distilling (a concurrent run published first)."""


def _publish(target_dir: Path, student: StageModel, report: DistillReport) -> None:
    """Write the checkpoint into a temporary sibling of ``report.out_dir``, ``MARKER`` last,
    and rename it into place; renaming onto an existing directory fails (``DraftExists``)."""
    out = report.out_dir
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared cache entry private
        write_checkpoint(student, target_dir, tmp)
        _write_json(tmp / MARKER, report.to_json())
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if out.exists():
                raise DraftExists(f"{out} appeared while distilling; keeping it") from exc
            raise DistillError(f"could not move the draft into {out}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_checkpoint(model: StageModel, target_dir: Path, out_dir: Path) -> None:
    """``model`` (every layer) as a checkpoint in ``out_dir``: the target's config.json with
    ``num_hidden_layers`` changed, ``model.safetensors``, and its tokenizer files."""
    config = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = len(model.layers)
    _write_json(out_dir / "config.json", config)
    tensors = {  # named_parameters lists a tied head once, as the embedding
        hf_name(model.config, 0, name): p.detach().contiguous()
        for name, p in model.named_parameters()
    }
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors writes 0600; a cache entry is shared like the model
    _fsync(weights)
    for f in sorted(target_dir.iterdir()):
        if f.is_file() and _is_tokenizer_file(f.name):
            shutil.copyfile(f, out_dir / f.name)


def _is_tokenizer_file(name: str) -> bool:
    """Whatever the target holds besides weights, config and markers (tokenizer, chat
    template, generation config)."""
    ours = name in ("config.json", MARKER) or name.startswith(("shard-", "."))
    return not ours and not name.endswith((".safetensors", ".safetensors.index.json", ".gguf"))


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --- the cache and `shard draft` -------------------------------------------------------------

DEFAULT_LAYERS = 2
DEFAULT_MINUTES = 8.0
DEFAULT_STEPS = 2000  # an upper bound: the time budget ends a default run first
DEFAULT_SEQ_LEN = 192
DEFAULT_BATCH = 8
_NAME = re.compile(r"(?P<target>[a-z0-9._-]+?)-distilled(?:-(?P<layers>\d+)L)?")


class DraftNotFound(DistillError):
    """A draft name or path leads to no usable draft; says how to build one."""


@attrs.frozen
class Recipe:
    """How to distil a draft (the ``distill`` keyword arguments other than ``progress``)."""

    layers: int = DEFAULT_LAYERS
    steps: int = DEFAULT_STEPS
    seq_len: int = DEFAULT_SEQ_LEN
    batch: int = DEFAULT_BATCH
    seed: int = 0
    time_budget_s: float | None = DEFAULT_MINUTES * 60


def draft_dir(target_dir: Path, name: str, layers: int) -> Path:
    """The cache entry ``<cache>/drafts/<name>-<layers>L-<key>`` for a target's draft.

    The key covers the target's directory name (itself keyed on its source) and the
    distiller's version, so a new target or distiller gets a fresh entry.
    """
    text = f"{DISTILL_VERSION}:{Path(target_dir).resolve().name}:{layers}"
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    return cache_dir() / "drafts" / f"{name}-{layers}L-{key}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a finished draft (its ``MARKER`` exists)."""
    return (path / MARKER).is_file()


def cached_draft(
    target_dir: Path, name: str, recipe: Recipe, *, force: bool = False, progress: bool = True
) -> Path:
    """The cached draft of ``target_dir`` for ``recipe.layers``, distilling it when absent.

    An entry without ``MARKER`` (a crash, a copy) is moved aside and rebuilt, never used;
    ``force`` rebuilds a complete one. Losing a publication race to a concurrent run is
    success: the winner's entry is complete by construction.
    """
    out = draft_dir(target_dir, name, recipe.layers)
    if is_complete(out) and not force:
        return out
    if out.exists():
        _discard(out)
    try:
        distill(target_dir, out, progress=progress, **attrs.asdict(recipe))
    except DraftExists:
        if not is_complete(out):
            raise
    return out


def resolve_draft(name_or_path: str, *, build: bool = False, progress: bool = True) -> Path:
    """The directory of the draft ``name_or_path``: a checkpoint directory (returned as is)
    or ``<bundled>-distilled[-<N>L]`` (e.g. ``smollm2-distilled``), found in the cache.

    Errors: ``DraftNotFound`` for anything else, or when the named draft is not cached and
    ``build`` is false (distilling takes minutes: it is never started implicitly).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftNotFound(f"{path} is a directory without config.json; not a checkpoint")
        return path
    match = _NAME.fullmatch(name_or_path)
    if match is None or match["target"] not in BUNDLED:
        raise DraftNotFound(
            f"{name_or_path!r} is not a checkpoint directory or a distilled draft name "
            f"({', '.join(f'{b}-distilled[-<N>L]' for b in sorted(BUNDLED))})"
        )
    target, layers = match["target"], int(match["layers"] or DEFAULT_LAYERS)
    target_dir = resolve_model(target, progress=progress)
    out = draft_dir(target_dir, target, layers)
    if is_complete(out):
        return out
    if not build:
        raise DraftNotFound(
            f"draft {name_or_path!r} is not built yet (no {out}); build it, in about "
            f"{DEFAULT_MINUTES:.0f} minutes, with `shard draft distill --target {target} "
            f"--layers {layers}`"
        )
    return cached_draft(target_dir, target, Recipe(layers=layers), progress=progress)


def _discard(path: Path) -> None:
    """Remove a cache entry; rename it aside first so no reader sees it half-deleted."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".trash", dir=path.parent))
    try:
        os.rename(path, trash / path.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


def distill_main(argv: list[str] | None = None) -> int:
    """``shard draft {distill,path} ...``: build a draft or print where one is; 0 or 2."""
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
            print(resolve_draft(args.name, progress=False))
            return 0
        return _distill_command(args)
    except (DistillError, ModelNotFound, ModelLoadError) as exc:
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
    sub = parser.add_subparsers(dest="draft_command", required=True, metavar="{distill,path}")
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
    path = sub.add_parser("path", help="print the directory of a built draft")
    path.add_argument("name", help="e.g. smollm2-distilled, smollm2-distilled-4L")
    return parser


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"
