"""shard's cache folder (no torch): converted models, built extensions, evidence."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """shard's cache: ``$XDG_CACHE_HOME/shard``, else ``~/.cache/shard``.

    The one place shard reads the environment for the cache, and it reads it on each call,
    so tests can point it elsewhere.
    """
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "shard"
