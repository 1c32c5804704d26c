"""Evidence files: each strike's signed evidence, written where an operator can find it.

The scheduler keeps every failed audit's signed ``Evidence`` (``StrikeBook.evidence``); the
``EvidenceShelf`` also writes each to a file of its own in ``[audit] evidence_dir`` (default:
``default_evidence_dir()``, under shard's cache), so ``shard receipt verify --evidence FILE``
checks it offline, on any machine. The file is ``shard.audit.evidence.evidence_to_json``:
exactly the bytes the verifier accepts.

A file appears whole or not at all: it is written under a temporary name in the same
directory, flushed to disk, then renamed over its final name (atomic on POSIX). The name says
whom it accuses and where — ``<accused>-session<N>-chunk<I>-<digest>.json``, the digest the
first 12 hex digits of the file's BLAKE2b — so two strikes never share a name and the same
evidence written twice is one file. Names from peers are reduced to ``[A-Za-z0-9_.-]``.

Written off the event loop (``shard.compute.offload.run_sync``): tail evidence holds float32 logits
and can be megabytes. A write that fails (a full disk, no permission) costs the file, never
the strike or the coordinator: ``keep`` logs it once and says so in its note.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Final

from shard.compute import offload
from shard.messages.audit import Evidence
from shard.model.cachedir import cache_dir

log = logging.getLogger(__name__)

__all__ = ["EvidenceShelf", "default_evidence_dir", "evidence_file_name", "write_evidence"]

#: Paths of the latest evidence files kept for the status feed.
RECENT: Final = 8


def default_evidence_dir() -> Path:
    """``$XDG_CACHE_HOME/shard/evidence``, else ``~/.cache/shard/evidence``."""
    return cache_dir() / "evidence"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64] or "_"


def evidence_file_name(evidence: Evidence, text: str) -> str:
    """``<accused>-session<N>-chunk<I>-<digest>.json`` for ``evidence`` written as ``text``."""
    digest = hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return (
        f"{_safe(evidence.accused)}-session{int(evidence.session)}-chunk{int(evidence.index)}"
        f"-{digest}.json"
    )


def write_evidence(directory: Path, evidence: Evidence) -> Path:
    """Write ``evidence`` to its own file in ``directory`` (created), atomically; its path.

    Errors: ``OSError`` when the directory or the file cannot be written; ``ValueError``
    for evidence canonical JSON cannot hold (a NaN from a broken auditor)."""
    from shard.audit.evidence import evidence_to_json  # torch: only where evidence is written

    text = evidence_to_json(evidence)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / evidence_file_name(evidence, text)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600: evidence is for anyone to read and check
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class EvidenceShelf:
    """Writes each strike's evidence to ``directory`` (None: ``default_evidence_dir()``);
    ``recent`` holds the paths of the last ``RECENT`` files written, newest last."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_evidence_dir()
        self.recent: tuple[str, ...] = ()
        self.written = 0

    async def keep(self, evidence: Evidence | None) -> str:
        """Write ``evidence`` (None: a strike with none, nothing to write); a note for the
        strike's log line and status event: ``"; evidence in PATH"``, or why it was not
        written. Errors: none (a failed write is logged and noted)."""
        if evidence is None:
            return ""
        try:
            path = await offload.run_sync(write_evidence, self.directory, evidence)
        except (OSError, ValueError) as exc:  # ValueError: a NaN, which JSON cannot hold
            log.error(
                "evidence of %s's failed audit not written to %s: %s; set [audit] evidence_dir "
                "to a writable directory",
                evidence.accused, self.directory, exc,
            )  # fmt: skip
            return f"; evidence NOT written ({exc})"
        self.written += 1
        self.recent = (*self.recent, str(path))[-RECENT:]
        return f"; evidence in {path}"
