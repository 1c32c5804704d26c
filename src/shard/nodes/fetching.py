"""A node's part in verified fetch, from its spec's ``[fetch]`` table (``shard.spec.fetch``).

``fetch_stage(spec, name)`` is what a stage with ``fetch`` runs before loading: read the
manifest, check the publisher's signature, refuse a rollback (the last manifest accepted per
model is kept in the cache), fetch the stage's block from the spec's seeders (every other
``[[fetch.seeder]]``) into ``<cache>/<model>/v<version>-<root>/`` and return the report, whose
``path`` ``load_stage`` reads. ``fetch_layers(spec, name, first, last)`` does the same for the
block the scheduler gave a node that joined (a stage node holds only what fetching reads of
the spec, a ``BlockFetch``, and calls ``fetch_block``), and ``fetch_common(spec, name)``
fetches only what every block holds (config, tokenizer, headers), so such a node reads the
model's config, to profile itself, before it holds any weights.
``make_seeder(spec, name, model_dir)`` builds the seeder a node called ``name`` runs: a seeder
process, or a stage serving its own copy.

Fetches and seeders talk plain WebSockets unless given a network: what they move is public
weights whose integrity the signed manifest guarantees, so even a secure swarm's stages fetch
that way (docs/manifests.md explains why and what that does and does not protect).

Errors: ``ManifestError`` (missing, unsigned, tampered or older manifest), ``FetchError``,
``IdentityError`` (the publisher key file), ``SpecError`` (a block that does not fit).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import attrs

from shard.nodes.compose import plain_network, plain_network_for
from shard.spec.fetch import FetchSpec
from shard.spec.limits import Limits
from shard.spec.swarm import SwarmSpec
from shard.transport import Network
from shard.trust.identity import read_public_key
from shard.weights.fetch import FetchOptions, FetchProgress, FetchReport, fetch_chunks
from shard.weights.manifest import Manifest, check_newer, verify
from shard.weights.plan import ChunkKey, block_chunks, chunk_keys, common_chunks
from shard.weights.seeder import DirectorySource, Seeder

log = logging.getLogger(__name__)

__all__ = [
    "BlockFetch",
    "accept_manifest",
    "block_fetch",
    "fetch_block",
    "fetch_common",
    "fetch_layers",
    "fetch_stage",
    "load_manifest",
    "make_seeder",
]

ACCEPTED_NAME = "accepted.manifest.json"


def load_manifest(fetch: FetchSpec) -> Manifest:
    """The spec's manifest, verified against its publisher key.

    Errors: ``ManifestError`` (bad manifest), ``IdentityError`` (publisher key file).
    """
    manifest = Manifest.from_file(fetch.manifest)
    verify(manifest, read_public_key(fetch.publisher))
    return manifest


def accept_manifest(manifest: Manifest, cache: Path) -> Path:
    """Record ``manifest`` as the latest accepted for its model; return its block directory.

    Errors: ``ManifestInvalid`` when a newer manifest of the model was accepted before.
    """
    model_dir = cache / re.sub(r"[^A-Za-z0-9_.-]", "_", manifest.model)
    latest = model_dir / ACCEPTED_NAME
    if latest.is_file():
        check_newer(Manifest.from_file(latest), manifest)
    model_dir.mkdir(parents=True, exist_ok=True)
    manifest.save(latest)
    return model_dir / f"v{manifest.version}-{manifest.root[:16]}"


def default_cache() -> Path:
    from shard.convert.bundled import cache_dir

    return cache_dir() / "blocks"


async def fetch_stage(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network | None = None,
    progress: Callable[[FetchProgress], None] | None = None,
) -> FetchReport:
    """Fetch stage ``name``'s block per ``spec.fetch``; opens ``network`` for the duration."""
    manifest = load_manifest(_fetch_of(block_fetch(spec, name)))
    index = [s.name for s in spec.stages].index(name)
    model = None
    if any(s.layers is None for s in spec.stages):  # "auto" cuts by bytes: read the config
        from shard.model.config import ModelConfig
        from shard.nodes.defaults import with_checkpoint_weights
        from shard.nodes.sizes import model_facts

        common = (await fetch_common(spec, name)).path
        # the weights the stage will load with (a quantized checkpoint: stored, when the spec
        # says none), read from the fetched headers: the block fetched is the block loaded
        spec = with_checkpoint_weights(spec, common)
        model = model_facts(ModelConfig.from_dir(common), spec, common)
    first, last = spec.blocks(manifest.n_layers, model)[index]
    return await fetch_layers(
        spec, name, first, last, manifest=manifest, network=network, progress=progress
    )


@attrs.frozen
class BlockFetch:
    """What node ``name`` fetches with, from its spec (``block_fetch``): the ``[fetch]``
    table (None: the spec has none, an error when fetching), the swarm's name, the spec's
    source (for that error) and its ``[limits]`` (timeouts, and the plain network's caps)."""

    name: str
    swarm: str
    source: str
    fetch: FetchSpec | None
    limits: Limits


def block_fetch(spec: SwarmSpec, name: str) -> BlockFetch:
    return BlockFetch(name, spec.name, spec.source, spec.fetch, spec.limits)


async def fetch_layers(
    spec: SwarmSpec,
    name: str,
    first: int,
    last: int,
    *,
    manifest: Manifest | None = None,
    network: Network | None = None,
    progress: Callable[[FetchProgress], None] | None = None,
) -> FetchReport:
    """Fetch layers ``[first, last)`` for node ``name`` per ``spec.fetch`` (``fetch_block``)."""
    return await fetch_block(
        block_fetch(spec, name), first, last, manifest=manifest, network=network, progress=progress
    )


async def fetch_block(
    via: BlockFetch,
    first: int,
    last: int,
    *,
    manifest: Manifest | None = None,
    network: Network | None = None,
    progress: Callable[[FetchProgress], None] | None = None,
) -> FetchReport:
    """Fetch layers ``[first, last)`` as ``via`` says (the block the scheduler gave a node
    that joined); ``manifest``: already loaded and verified.

    Errors: as the module's, and ``ValueError`` for a range the model does not have."""
    name = via.name
    manifest = manifest or load_manifest(_fetch_of(via))
    keys = chunk_keys(block_chunks(manifest, first, last))
    report = await _fetch(via, manifest, keys, f"[{first}, {last})", network, progress)
    log.info(
        "%s: block [%d, %d) ready in %s: %d chunks fetched, %d reused",
        name,
        first,
        last,
        report.path,
        report.chunks_fetched,
        report.chunks_reused,
    )
    return report


async def fetch_common(
    spec: SwarmSpec, name: str, *, network: Network | None = None
) -> FetchReport:
    """Fetch, for node ``name``, what every block holds (config, tokenizer, the safetensors
    headers: ``shard.weights.plan.common_chunks``), verified, into the directory its block
    will be fetched into: enough to read the model's config before any block is known."""
    via = block_fetch(spec, name)
    manifest = load_manifest(_fetch_of(via))
    keys = chunk_keys(common_chunks(manifest))
    return await _fetch(via, manifest, keys, "config and headers", network, None)


def _fetch_of(via: BlockFetch) -> FetchSpec:
    if via.fetch is None:
        raise ValueError(f"{via.source}: no [fetch] table")
    return via.fetch


async def _fetch(
    via: BlockFetch,
    manifest: Manifest,
    keys: list[ChunkKey],
    what: str,
    network: Network | None,
    progress: Callable[[FetchProgress], None] | None,
) -> FetchReport:
    """Fetch ``keys`` of ``manifest`` (accepted first: no rollback) from the spec's seeders."""
    name, fetch = via.name, _fetch_of(via)
    dest = accept_manifest(manifest, fetch.cache or default_cache())
    peers = [s.listen for s in fetch.seeders if s.name != name]
    options = FetchOptions(
        parallel=fetch.parallel,
        chunk_timeout_s=fetch.chunk_timeout_s,
        connect_timeout_s=via.limits.connect_timeout_s,
        handshake_timeout_s=via.limits.handshake_timeout_s,
    )
    network = network or plain_network_for(via.limits)  # [limits]: caps and byte budget
    async with network:
        report = await fetch_chunks(
            manifest,
            keys,
            what,
            peers=peers,
            network=network,
            dest=dest,
            node=name,
            swarm=via.swarm,
            options=options,
            progress=progress or _Every10Percent(name),
        )
    if report.bad_peers:
        log.warning("%s: peers that served bad chunks: %s", name, ", ".join(report.bad_peers))
    return report


def make_seeder(
    spec: SwarmSpec, name: str, model_dir: Path, *, network: Network | None = None
) -> Seeder | None:
    """The seeder node ``name`` runs per ``[[fetch.seeder]]`` (None when it runs none),
    serving the entry's ``model`` directory, else ``model_dir``."""
    fetch = spec.fetch
    entry = fetch.seeder(name) if fetch is not None else None
    if fetch is None or entry is None:
        return None
    manifest = load_manifest(fetch)
    source = DirectorySource(manifest, entry.model or model_dir)
    network = network or plain_network(spec)  # the spec's [limits]: caps and byte budget
    return Seeder(
        manifest,
        source,
        node=name,
        swarm=spec.name,
        listen=entry.listen,
        network=network,
        handshake_timeout_s=spec.limits.handshake_timeout_s,
    )


class _Every10Percent:
    """Progress as log lines, one per tenth of the bytes."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._last = -1

    def __call__(self, p: FetchProgress) -> None:
        tenth = 10 * p.bytes_done // max(p.bytes_total, 1)
        if tenth != self._last:
            self._last = tenth
            log.info(
                "%s: fetched %d/%d chunks (%d%% of %d bytes)",
                self._name,
                p.chunks_done,
                p.chunks_total,
                10 * tenth,
                p.bytes_total,
            )
