"""A sparse local copy of a manifest's files, and the record of which chunks are verified.

``BlockStore(manifest, dest)`` keeps each file of the manifest at ``dest/<path>``, created at
its full size (sparse: chunks never written read as zeros and are never loaded), plus two
hidden files: ``.shard-manifest.json`` (the manifest it holds) and ``.shard-chunks`` (one
line ``<file>\\t<index>`` per chunk written after it verified, appended as it lands).

Only bytes that verified are ever written (the caller checks with ``verify_chunk``; ``write``
checks again). On ``open`` every recorded chunk is read back and re-hashed; one that no longer
matches (a torn write, a disk error, a hand edit) is dropped and fetched again, which is what
makes resuming after an interruption safe. A store whose record belongs to another manifest
root starts over, deleting the old manifest's files first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from shard.weights.manifest import Manifest, ManifestError, replace_file, verify_chunk
from shard.weights.plan import ChunkKey

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_NAME", "RECORD_NAME", "BlockStore", "verified_chunks"]

MANIFEST_NAME: Final = ".shard-manifest.json"
RECORD_NAME: Final = ".shard-chunks"


class BlockStore:
    """Verified chunks of ``manifest`` under ``dest``; see the module docstring."""

    def __init__(self, manifest: Manifest, dest: Path) -> None:
        self.manifest = manifest
        self.dest = Path(dest)
        self._files = {f.path: f for f in manifest.files}

    def open(self) -> set[ChunkKey]:
        """Prepare ``dest`` and return the chunks already there that still verify."""
        self.dest.mkdir(parents=True, exist_ok=True)
        record = self.dest / RECORD_NAME
        previous = _read_manifest(self.dest / MANIFEST_NAME)
        if previous is not None and previous.root != self.manifest.root:
            log.info("%s: holds another manifest (%s); starting over", self.dest, previous.root)
            for f in previous.files:
                (self.dest / f.path).unlink(missing_ok=True)
            record.unlink(missing_ok=True)
        self.manifest.save(self.dest / MANIFEST_NAME)
        for f in self.manifest.files:
            path = self.dest / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.stat().st_size != f.size:
                with open(path, "ab") as out:
                    out.truncate(f.size)
        good = {key for key in _read_record(record) if self._still_good(key)}
        _write_record(record, good)  # drop stale lines so the record stays small and true
        return good

    def write(self, key: ChunkKey, data: bytes) -> None:
        """Write verified chunk ``key`` at its offset, then record it.

        Errors: ``ManifestMismatch`` if ``data`` does not verify (nothing is written).
        """
        path, index = key
        verify_chunk(self.manifest, path, index, data)
        start, _ = self._files[path].span(index, self.manifest.chunk_size)
        fd = os.open(self.dest / path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start)
        finally:
            os.close(fd)
        with open(self.dest / RECORD_NAME, "a", encoding="utf-8") as rec:
            rec.write(f"{path}\t{index}\n")

    def read(self, key: ChunkKey) -> bytes:
        """The bytes of chunk ``key`` as they are on disk (verified or not)."""
        path, index = key
        start, end = self._files[path].span(index, self.manifest.chunk_size)
        with open(self.dest / path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def _still_good(self, key: ChunkKey) -> bool:
        if key[0] not in self._files:
            return False
        try:
            verify_chunk(self.manifest, key[0], key[1], self.read(key))
        except (ManifestError, OSError):
            log.warning(
                "%s: recorded chunk %s %d no longer verifies; fetching it again", self.dest, *key
            )
            return False
        return True


def verified_chunks(directory: Path, manifest: Manifest) -> set[ChunkKey] | None:
    """The chunks a store in ``directory`` recorded for ``manifest`` (unchecked), or None
    when ``directory`` is not a store of that manifest (a full checkpoint, say)."""
    held = _read_manifest(Path(directory) / MANIFEST_NAME)
    if held is None or held.root != manifest.root:
        return None
    return _read_record(Path(directory) / RECORD_NAME)


def _read_manifest(path: Path) -> Manifest | None:
    if not path.is_file():
        return None
    try:
        return Manifest.from_file(path)
    except ManifestError:
        return None


def _read_record(path: Path) -> set[ChunkKey]:
    if not path.is_file():
        return set()
    keys: set[ChunkKey] = set()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        file, sep, index = line.partition("\t")
        if sep and index.isdigit():  # a torn last line is skipped, and fetched again
            keys.add((file, int(index)))
    return keys


def _write_record(path: Path, keys: set[ChunkKey]) -> None:
    replace_file(path, "".join(f"{f}\t{i}\n" for f, i in sorted(keys)).encode())
