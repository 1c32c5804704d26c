"""The draft cache: where a target's distilled draft lives, building it on request, and
``resolve_draft``, which maps a draft name (``smollm2-distilled[-<N>L]``) or a checkpoint
directory to the directory to load.

An entry is ``<cache>/drafts/<name>-<layers>L-<key>``; it counts only once ``distill.json``
(``MARKER``) is in it, and ``distill`` writes that last, so a crash never leaves a usable
half-entry.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import attrs

from shard.convert.bundled import BUNDLED, cache_dir, resolve_model
from shard.training.distill.build import (
    DISTILL_VERSION,
    MARKER,
    DistillError,
    DraftExists,
    distill,
)

__all__ = [
    "DEFAULT_LAYERS",
    "DEFAULT_MINUTES",
    "DraftNotFound",
    "Recipe",
    "cached_draft",
    "discard",
    "draft_dir",
    "is_complete",
    "resolve_draft",
]

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
        discard(out)
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


def discard(path: Path) -> None:
    """Remove a cache entry; rename it aside first so no reader sees it half-deleted."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".trash", dir=path.parent))
    try:
        os.rename(path, trash / path.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
