"""Where heads live: ``<cache>/drafts/<target>-head-<key>``, built on request, and
``resolve_head``, which maps ``smollm2-head`` (or a head directory) to the directory to load.

An entry counts only once ``train.json`` (``build.MARKER``) is in it, and ``train_head``
writes that last, so a crash never leaves a usable half-entry; an entry without it is moved
aside and rebuilt, never used. The features a head is trained on live next to the entries
(``<cache>/drafts/features/<target>-<key>``) and outlive them, so a rebuild (``--force``,
another recipe) samples nothing it already has.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import attrs

from shard.convert.bundled import BUNDLED, cache_dir, resolve_model
from shard.decode.head.model import CONFIG_FILE, HEAD_VERSION, HeadError
from shard.training.distill.cache import discard
from shard.training.head.build import MARKER, HeadExists, HeadRecipe, train_head
from shard.training.head.features import FEATURES_VERSION

__all__ = [
    "HeadNotFound",
    "cached_head",
    "features_dir",
    "head_dir",
    "is_complete",
    "resolve_head",
]

_NAME = re.compile(r"(?P<target>[a-z0-9._-]+?)-head")


class HeadNotFound(HeadError):
    """A head name or path leads to no usable head; says how to build one."""


def _key(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:12]


def _sampler(recipe: HeadRecipe) -> tuple[str, ...]:
    """Key parts for the dtype that samples the features: none for fp32 (the keys of caches
    made before there was a choice), the dtype otherwise."""
    dtype = recipe.sampling_dtype()
    return () if dtype == "float32" else (dtype,)


def head_dir(target_dir: Path, name: str, recipe: HeadRecipe) -> Path:
    """The cache entry for a head of ``target_dir`` made by ``recipe``'s architecture.

    The key covers the target's directory name (itself keyed on its source), the head
    format's version, the architecture (layers, window, shortlist) and the dtype that
    sampled its features, not the budget: a head trained longer replaces the entry only on
    ``--force``.
    """
    arch = (recipe.layers, recipe.window, recipe.shortlist, recipe.seq_len, recipe.seed)
    key = _key(HEAD_VERSION, Path(target_dir).resolve().name, *arch, *_sampler(recipe))
    return cache_dir() / "drafts" / f"{name}-head-{key}"


def features_dir(target_dir: Path, name: str, recipe: HeadRecipe) -> Path:
    """The features cache of ``target_dir`` for ``recipe``'s text (row length, seed and the
    dtype that samples it)."""
    key = _key(
        FEATURES_VERSION,
        Path(target_dir).resolve().name,
        recipe.seq_len,
        recipe.seed,
        recipe.rows_per_chunk,
        *_sampler(recipe),
    )
    return cache_dir() / "drafts" / "features" / f"{name}-{key}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a finished head (its ``MARKER`` and config exist)."""
    return (path / MARKER).is_file() and (path / CONFIG_FILE).is_file()


def cached_head(
    target_dir: Path,
    name: str,
    recipe: HeadRecipe,
    *,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """The cached head of ``target_dir`` for ``recipe``, training it when absent.

    An entry without ``MARKER`` (a crash, a copy) is moved aside and rebuilt; ``force``
    rebuilds a complete one. An interrupted build resumes from its checkpoint next time.
    Losing a publication race to a concurrent run is success.
    """
    out = head_dir(target_dir, name, recipe)
    if is_complete(out) and not force:
        return out
    if out.exists():
        discard(out)
    try:
        train_head(
            target_dir, out, features_dir(target_dir, name, recipe), recipe, progress=progress
        )
    except HeadExists:
        if not is_complete(out):
            raise
    return out


def resolve_head(name_or_path: str, *, build: bool = False, progress: bool = True) -> Path:
    """The directory of the head ``name_or_path``: a head directory (returned as is) or
    ``<bundled>-head`` (e.g. ``smollm2-head``), the default recipe's head, from the cache.

    Errors: ``HeadNotFound`` for anything else, or when the named head is not built and
    ``build`` is false. With ``build`` it trains the head (minutes), saying so first.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not is_complete(path):
            raise HeadNotFound(f"{path} is not a finished draft head (no {MARKER})")
        return path
    match = _NAME.fullmatch(name_or_path)
    if match is None or match["target"] not in BUNDLED:
        raise HeadNotFound(
            f"{name_or_path!r} is not a head directory or a head name "
            f"({', '.join(f'{b}-head' for b in sorted(BUNDLED))})"
        )
    target = match["target"]
    recipe = HeadRecipe()
    target_dir = resolve_model(target, progress=progress)
    out = head_dir(target_dir, target, recipe)
    if is_complete(out):
        return out
    command = f"shard draft train --target {target}"
    if not build:
        raise HeadNotFound(
            f"draft head {name_or_path!r} is not built yet (no {out}); build it, in about "
            f"{recipe.minutes + 1:.0f} minutes, with `{command}`"
        )
    print(
        f"shard: building the draft head {name_or_path!r} ({command}): about "
        f"{recipe.minutes + 1:.0f} minutes, once; an interrupted build resumes",
        file=sys.stderr,
    )
    return cached_head(target_dir, target, attrs.evolve(recipe), progress=progress)
