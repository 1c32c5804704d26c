"""Seeder: serves the chunks of a manifest that it holds, to stages fetching their block.

A seeder answers ``ChunkRequest`` with ``ChunkData`` or ``ChunkMissing``, one answer per
request, in order, after the ``Hello``/``Welcome`` handshake of ``shard.transport.links`` (the
fetcher
says role ``fetch``, the seeder answers ``seeder``). Its chunks come from a ``ChunkSource``:
``DirectorySource`` reads a checkpoint directory (``shard up --role seeder``) or a stage's
sparse fetched copy (a stage serving what it holds), verifying its copy when it starts and each
chunk again before sending it, so an honest seeder never passes on bytes that do not match.
The fetcher verifies everything anyway: a seeder is never trusted.

Chunks travel as raw ``uint8`` tensor payloads, never msgpack'd, over any ``Network``; in a
secure swarm they still ride plain WebSockets (integrity comes from the signed manifest, and
weights are public: see docs/manifests.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import attrs
import trio

from shard.compute import offload
from shard.messages import (
    ChunkData,
    ChunkMissing,
    ChunkRequest,
    Fault,
    Message,
    NodeName,
    Tensor,
    Welcome,
)
from shard.transport import Connection, Network
from shard.transport.guard import serve_one
from shard.transport.links import HANDSHAKE_TIMEOUT_S, HandshakeError, accept_peer
from shard.weights.manifest import Manifest, ManifestError, verify_chunk
from shard.weights.plan import ChunkKey
from shard.weights.store import BlockStore, verified_chunks

log = logging.getLogger(__name__)

__all__ = ["ChunkSource", "DirectorySource", "Seeder", "SeederStatistics"]

#: A fetcher that stays silent this long is disconnected (it reconnects when it needs more).
IDLE_TIMEOUT_S = 120.0


class ChunkSource(Protocol):
    """Where a seeder's chunks come from: ``scan`` checks the copy at start (returns how many
    chunks it will serve); ``chunk`` is the bytes, or None when not held."""

    def scan(self) -> int: ...

    def chunk(self, file: str, index: int) -> bytes | None: ...


class DirectorySource:
    """Chunks of ``manifest`` read from ``directory``, served only while they verify.

    ``scan()`` (at start) hashes every chunk the directory should hold: all of them for a
    full checkpoint, the recorded ones for a fetched copy (``shard.weights.store``).
    """

    def __init__(self, manifest: Manifest, directory: Path) -> None:
        self.manifest = manifest
        self.directory = Path(directory)
        self._store = BlockStore(manifest, self.directory)
        self._have: set[ChunkKey] = set()

    def scan(self) -> int:
        """Check the copy; return how many chunks verified (only those are served)."""
        recorded = verified_chunks(self.directory, self.manifest)
        if recorded is None:
            candidates = {(f.path, i) for f in self.manifest.files for i in range(len(f.chunks))}
        else:
            candidates = recorded
        self._have = {key for key in candidates if self._verifies(key)}
        bad = len(candidates) - len(self._have)
        if bad:
            log.warning(
                "%s: %d chunks do not match the manifest; not serving them", self.directory, bad
            )
        return len(self._have)

    def chunk(self, file: str, index: int) -> bytes | None:
        key = (file, index)
        if key not in self._have:
            return None
        try:
            data = self._store.read(key)
            verify_chunk(self.manifest, file, index, data)
        except (OSError, ManifestError) as exc:
            log.warning(
                "%s: %s chunk %d changed on disk (%s); not serving it",
                self.directory,
                file,
                index,
                exc,
            )
            self._have.discard(key)
            return None
        return data

    def _verifies(self, key: ChunkKey) -> bool:
        try:
            verify_chunk(self.manifest, key[0], key[1], self._store.read(key))
        except (OSError, ManifestError):
            return False
        return True


@attrs.frozen
class SeederStatistics:
    """Totals since start: requests answered, chunks sent, misses, payload bytes sent."""

    connections: int
    requests: int
    served: int
    missing: int
    bytes_served: int


@attrs.define
class _Counts:
    connections: int = 0
    requests: int = 0
    served: int = 0
    missing: int = 0
    bytes_served: int = 0


class Seeder:
    """Serve ``source``'s chunks of ``manifest`` on ``listen``.

    Cancellation: cancelling ``run`` stops the listener and closes every connection; nothing
    is left half-sent that a fetcher would accept (it verifies every chunk).

    Errors: a fetcher that breaks the protocol (a message other than ``ChunkRequest``, a
    malformed frame) gets a ``Fault`` or a reset, and only its connection ends; transport
    failures of one connection are logged by the network. ``run`` raises only when it cannot
    listen (``TransportError``).
    """

    def __init__(
        self,
        manifest: Manifest,
        source: ChunkSource,
        *,
        node: str,
        swarm: str,
        listen: str,
        network: Network,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.manifest = manifest
        self._source = source
        self._node = NodeName(node)
        self._welcome = Welcome(node=self._node, role="seeder", swarm=swarm)
        self._listen = listen
        self._network = network
        self._handshake_timeout_s = handshake_timeout_s
        self._counts = _Counts()

    def statistics(self) -> SeederStatistics:
        c = self._counts
        return SeederStatistics(c.connections, c.requests, c.served, c.missing, c.bytes_served)

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Check the copy, then listen and serve until cancelled; reports the bound address
        when ready. The check hashes the whole copy once, in a worker thread (it takes seconds
        for a large model and must not stall a stage's ring traffic)."""
        held = await offload.run_sync(self._source.scan)
        log.info("seeder %s: serving %d chunks of %s", self._node, held, self.manifest.describe())
        await self._network.serve(self._listen, self._serve, task_status=task_status)

    async def _serve(self, conn: Connection) -> None:
        try:
            await accept_peer(conn, self._welcome, timeout_s=self._handshake_timeout_s)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("seeder %s: %s", self._node, exc)
            return
        self._counts.connections += 1
        await serve_one(conn, self._answer_requests, what="fetch link", node=self._node)

    async def _answer_requests(self, conn: Connection) -> None:
        while True:
            msg: Message | None = None
            with trio.move_on_after(IDLE_TIMEOUT_S):
                msg = await conn.receive()
            if not isinstance(msg, ChunkRequest):  # None: idle too long
                if msg is not None:
                    await self._refuse(conn, msg)
                return
            await conn.send(self.answer(msg))

    def answer(self, request: ChunkRequest) -> Message:
        """The reply to one request (a pure function of the source, for tests too)."""
        self._counts.requests += 1
        r = request
        if r.root != self.manifest.root:
            reason = f"this seeder serves manifest {self.manifest.root[:16]}, not {r.root[:16]}"
            return self._missing(r, reason)
        data = self._source.chunk(r.file, r.index) if r.index >= 0 else None
        if data is None:
            return self._missing(r, "chunk not held here")
        self._counts.served += 1
        self._counts.bytes_served += len(data)
        payload = Tensor(dtype="uint8", shape=(len(data),), data=data)
        return ChunkData(root=r.root, file=r.file, index=r.index, data=payload)

    def _missing(self, r: ChunkRequest, reason: str) -> ChunkMissing:
        self._counts.missing += 1
        return ChunkMissing(root=r.root, file=r.file, index=r.index, reason=reason)

    async def _refuse(self, conn: Connection, msg: Message) -> None:
        detail = f"a seeder answers ChunkRequest only, got {type(msg).__name__}"
        log.warning("seeder %s: %s from %s", self._node, detail, conn.peer)
        await conn.send(Fault(node=self._node, kind="protocol", detail=detail))
