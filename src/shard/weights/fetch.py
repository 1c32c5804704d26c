"""Verified fetch: a stage downloads only its block's chunks, checking each before it lands.

``fetch_block(manifest, first=, last=, peers=, network=, dest=, ...)`` plans the chunks of
layers ``[first, last)`` (``shard.weights.plan``), keeps those already verified in ``dest``
(``shard.weights.store``: an interrupted fetch resumes), and downloads the rest from ``peers``
(seeders, or stages serving their copy: ``shard.weights.seeder``) with ``parallel`` requests in
flight. ``fetch_chunks`` does the same for any set of chunks (a joining node's config before
its block is known: ``shard.weights.plan.common_chunks``).

Each chunk goes to one peer at a time, chosen among the least busy that have not failed it.
A reply is checked against the signed manifest's chunk hash before a byte is written; on a
bad chunk (wrong hash or length, or a reply that is not an answer to the request) the peer is
reported and dropped for good, on a slow one (``chunk_timeout_s``) or an unreachable one it
gets a strike (``max_strikes`` drops it), and on either the chunk is asked of the next peer.
When no peer is left for a chunk the fetch fails, and a rerun resumes where it stopped.

Cancellation: cancelling ``fetch_block`` leaves ``dest`` consistent: every recorded chunk
verified, the rest fetched by the next call. Errors: ``FetchError`` when some chunk could not
be fetched from any peer; ``ValueError`` for a bad layer range.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from shard.messages import ChunkData, ChunkMissing, ChunkRequest, Hello, Message, NodeName
from shard.transport import Connection, Network, TransportError
from shard.transport.links import HANDSHAKE_TIMEOUT_S, HandshakeError, dial_peer
from shard.weights.manifest import Manifest, ManifestError, verify_chunk
from shard.weights.plan import ChunkKey, block_chunks, chunk_keys, plan_bytes
from shard.weights.store import BlockStore
from shard.wire import WireError

log = logging.getLogger(__name__)

__all__ = [
    "FetchError",
    "FetchOptions",
    "FetchProgress",
    "FetchReport",
    "fetch_block",
    "fetch_chunks",
]


class FetchError(Exception):
    """Some chunk could not be fetched from any peer; says which and who failed it."""


@attrs.frozen
class FetchOptions:
    """How hard to try: requests in flight, per-chunk deadline, strikes before a peer is
    dropped, how long to keep dialing a peer that does not answer and to wait for its
    handshake."""

    parallel: int = 4
    chunk_timeout_s: float = 30.0
    max_strikes: int = 3
    connect_timeout_s: float = 10.0
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S


@attrs.frozen
class FetchProgress:
    """Where a fetch stands, after each verified chunk."""

    chunks_done: int
    chunks_total: int
    bytes_done: int
    bytes_total: int


@attrs.frozen
class FetchReport:
    """What a fetch did: ``path`` is the loadable directory; ``bad_peers`` served bad data."""

    path: Path
    chunks_total: int
    chunks_reused: int
    chunks_fetched: int
    bytes_fetched: int
    bad_peers: tuple[str, ...]
    slow_peers: tuple[str, ...]


@attrs.define
class _Peer:
    address: str
    bad: bool = False
    strikes: int = 0
    busy: int = 0


_Outcome = bytes | str  # the verified chunk, or why this peer did not deliver it


async def fetch_block(
    manifest: Manifest,
    *,
    first: int,
    last: int,
    peers: Sequence[str],
    network: Network,
    dest: Path,
    node: str = "fetch",
    swarm: str = "",
    options: FetchOptions = FetchOptions(),
    progress: Callable[[FetchProgress], None] | None = None,
) -> FetchReport:
    """Fetch what a stage of ``[first, last)`` needs into ``dest`` (see the module docstring).

    ``manifest`` must already be verified (``shard.weights.manifest.verify``); ``network`` open.
    """
    keys = chunk_keys(block_chunks(manifest, first, last))
    what = f"[{first}, {last})"
    return await fetch_chunks(
        manifest,
        keys,
        what,
        peers=peers,
        network=network,
        dest=dest,
        node=node,
        swarm=swarm,
        options=options,
        progress=progress,
    )


async def fetch_chunks(
    manifest: Manifest,
    keys: Sequence[ChunkKey],
    what: str,
    *,
    peers: Sequence[str],
    network: Network,
    dest: Path,
    node: str = "fetch",
    swarm: str = "",
    options: FetchOptions = FetchOptions(),
    progress: Callable[[FetchProgress], None] | None = None,
) -> FetchReport:
    """Fetch the chunks ``keys`` (``what`` names them in the log) into ``dest``, as
    ``fetch_block`` does: the verified ones already there are kept, every other is checked
    against ``manifest`` before it lands."""
    store = BlockStore(manifest, dest)
    have = store.open()
    todo = [key for key in keys if key not in have]
    hello = Hello(node=NodeName(node), role="fetch", swarm=swarm)
    run = _Fetch(manifest, store, [_Peer(p) for p in peers], network, hello, options, progress)
    run.total, run.done = len(keys), len(keys) - len(todo)
    run.bytes_total = plan_bytes(manifest, keys)
    run.bytes_done = run.bytes_total - plan_bytes(manifest, todo)
    run.queue.extend(todo)
    log.info("%s: fetching %d of %d chunks of %s", dest, len(todo), len(keys), what)
    await run.run()
    return FetchReport(
        path=Path(dest),
        chunks_total=len(keys),
        chunks_reused=len(keys) - len(todo),
        chunks_fetched=run.fetched,
        bytes_fetched=run.bytes_fetched,
        bad_peers=tuple(p.address for p in run.peers if p.bad),
        slow_peers=tuple(p.address for p in run.peers if p.strikes and not p.bad),
    )


class _Fetch:
    """One fetch's shared state; ``parallel`` workers take chunks from ``queue``."""

    def __init__(
        self,
        manifest: Manifest,
        store: BlockStore,
        peers: list[_Peer],
        network: Network,
        hello: Hello,
        options: FetchOptions,
        progress: Callable[[FetchProgress], None] | None,
    ) -> None:
        self.manifest, self.store, self.peers = manifest, store, peers
        self.network, self.hello = network, hello
        self.options, self.progress = options, progress
        self.failure: FetchError | None = None
        self.queue: deque[ChunkKey] = deque()
        self.total = self.done = self.fetched = 0
        self.bytes_total = self.bytes_done = self.bytes_fetched = 0
        self._turn = 0

    async def run(self) -> None:
        """Run the workers until the queue is empty; the first ``FetchError`` stops them all."""
        async with trio.open_nursery() as nursery:
            for _ in range(min(self.options.parallel, len(self.queue))):
                nursery.start_soon(self._worker, nursery.cancel_scope)
        if self.failure is not None:
            raise self.failure

    async def _worker(self, scope: trio.CancelScope) -> None:
        conns: dict[str, Connection] = {}
        try:
            while self.queue:
                await self._one(self.queue.popleft(), conns)
        except FetchError as exc:
            self.failure = self.failure or exc
            scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                for conn in conns.values():
                    await conn.aclose()

    async def _one(self, key: ChunkKey, conns: dict[str, Connection]) -> None:
        """Fetch ``key`` from one peer after another until one delivers a verified copy."""
        failures: list[str] = []
        tried: set[str] = set()
        while (peer := self._pick(tried)) is not None:
            tried.add(peer.address)
            peer.busy += 1
            try:
                outcome = await self._ask(peer, key, conns)
            finally:
                peer.busy -= 1
            if isinstance(outcome, bytes):
                self._landed(key, outcome)
                return
            failures.append(f"{peer.address}: {outcome}")
        raise FetchError(
            f"{key[0]} chunk {key[1]}: no peer could serve a verified copy "
            f"({'; '.join(failures) or 'no usable peers'}); check the [fetch] seeders, then "
            "run again: verified chunks are kept"
        )

    def _pick(self, tried: set[str]) -> _Peer | None:
        """The least busy usable peer not yet tried for this chunk (rotating among equals)."""
        usable = [
            (p.busy, (i - self._turn) % len(self.peers), p)
            for i, p in enumerate(self.peers)
            if not p.bad and p.strikes < self.options.max_strikes and p.address not in tried
        ]
        if not usable:
            return None
        self._turn += 1
        return min(usable, key=lambda entry: entry[:2])[2]

    async def _ask(self, peer: _Peer, key: ChunkKey, conns: dict[str, Connection]) -> _Outcome:
        request = ChunkRequest(root=self.manifest.root, file=key[0], index=key[1])
        reply: Message | Exception | None = None
        try:
            conn = conns.get(peer.address)
            if conn is None:
                conn = conns[peer.address] = await dial_peer(
                    self.network,
                    peer.address,
                    self.hello,
                    timeout_s=self.options.connect_timeout_s,
                    handshake_timeout_s=self.options.handshake_timeout_s,
                )
            with trio.move_on_after(self.options.chunk_timeout_s):
                await conn.send(request)
                reply = await conn.receive()
        except WireError as exc:  # a malformed frame: hostile or broken, either way bad
            return await self._bad(peer, key, f"malformed reply ({exc})", conns)
        except (TransportError, HandshakeError) as exc:
            reply = exc
        if reply is None or isinstance(reply, Exception):
            await self._drop(conns, peer.address)
            peer.strikes += 1
            why = (
                f"no answer within {self.options.chunk_timeout_s:g} s"
                if reply is None
                else str(reply)
            )
            log.warning(
                "fetch: peer %s: %s chunk %d: %s; asking another peer", peer.address, *key, why
            )
            return why
        return await self._check(peer, request, reply, conns)

    async def _check(
        self, peer: _Peer, request: ChunkRequest, reply: Message, conns: dict[str, Connection]
    ) -> _Outcome:
        """The verified bytes of ``reply``, or why not (a bad reply marks the peer bad)."""
        if isinstance(reply, ChunkMissing) and _answers(reply, request):
            return f"does not have it ({reply.reason})"
        problem = f"answered {type(reply).__name__} for another chunk or manifest"
        if isinstance(reply, ChunkData) and _answers(reply, request):
            try:
                if reply.data.dtype != "uint8":
                    raise ManifestError(f"chunk sent as {reply.data.dtype}, not uint8")
                verify_chunk(self.manifest, request.file, request.index, reply.data.data)
            except ManifestError as exc:
                problem = str(exc)
            else:
                return reply.data.data
        return await self._bad(peer, (request.file, request.index), problem, conns)

    async def _bad(
        self, peer: _Peer, key: ChunkKey, problem: str, conns: dict[str, Connection]
    ) -> str:
        """Report ``peer`` as bad, drop it for the rest of the fetch, say why."""
        peer.bad = True
        await self._drop(conns, peer.address)
        log.warning(
            "fetch: BAD PEER %s: %s chunk %d rejected: %s; it is dropped and the chunk asked "
            "of another peer",
            peer.address,
            *key,
            problem,
        )
        return f"bad chunk: {problem}"

    def _landed(self, key: ChunkKey, data: bytes) -> None:
        self.store.write(key, data)
        self.done += 1
        self.fetched += 1
        self.bytes_done += len(data)
        self.bytes_fetched += len(data)
        if self.progress is not None:
            self.progress(FetchProgress(self.done, self.total, self.bytes_done, self.bytes_total))

    async def _drop(self, conns: dict[str, Connection], address: str) -> None:
        conn = conns.pop(address, None)
        if conn is not None:
            with trio.CancelScope(shield=True):
                await conn.aclose()


def _answers(reply: ChunkData | ChunkMissing, request: ChunkRequest) -> bool:
    return (reply.root, reply.file, reply.index) == (request.root, request.file, request.index)
