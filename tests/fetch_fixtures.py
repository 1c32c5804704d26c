"""A chunk source for verified-fetch tests that records what it is asked and can tamper
(``test_fetch``, ``test_join_fetch_procs``): what a hostile seeder serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shard.weights.manifest import Manifest
from shard.weights.plan import ChunkKey
from shard.weights.seeder import ChunkSource, DirectorySource


class Recording:
    """A chunk source that records every chunk asked of it; can tamper with some, or lack some."""

    def __init__(
        self,
        inner: ChunkSource,
        *,
        tamper: set[ChunkKey] | None = None,
        tamper_all: bool = False,
        lacks: set[ChunkKey] | None = None,
    ) -> None:
        self.inner = inner
        self.asked: list[ChunkKey] = []
        self.tampered: list[ChunkKey] = []
        self._tamper, self._all, self._lacks = tamper or set(), tamper_all, lacks or set()

    def scan(self) -> int:
        return self.inner.scan()

    def chunk(self, file: str, index: int) -> bytes | None:
        key = (file, index)
        self.asked.append(key)
        data = None if key in self._lacks else self.inner.chunk(file, index)
        if data is not None and (self._all or key in self._tamper):
            self.tampered.append(key)
            data = tampered(data)
        return data


def tampered(data: bytes) -> bytes:
    """The chunk with its middle bytes changed (what an attacker serves)."""
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 16]) + data[mid + 16 :]


def source(manifest: Manifest, model_dir: Path, **kw: Any) -> Recording:
    return Recording(DirectorySource(manifest, model_dir), **kw)
