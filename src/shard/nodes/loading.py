"""Loading a stage's or standby's block of layers: onto the node's device, in its dtype, its
weights held as the spec says (``shard.nodes.auditing.weights_of``), in a worker thread. The
stage and standby roots (``shard.nodes.stage``) load with it, at start and on ``Activate``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs

from shard.compute import offload
from shard.model.device import emulated_dtype_note, resolve_device, torch_dtype
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.weights import resolve_weights
from shard.nodes.auditing import weights_of
from shard.spec.swarm import SwarmSpec

log = logging.getLogger(__name__)


@attrs.frozen
class LoadedBlock:
    """A block of layers, loaded."""

    model: StageModel
    first: int
    last: int


@attrs.frozen
class BlockSource:
    """How node ``name`` loads a block, as its spec says (``block_source``): its device (as
    written, resolved when loading), dtype and weights (``weights_of``)."""

    name: str
    device: str
    dtype: str
    weights: str | None


def block_source(spec: SwarmSpec, name: str) -> BlockSource:
    """Node ``name``'s ``BlockSource`` (``SpecError`` if there is no such node)."""
    runtime = spec.runtime(name)
    return BlockSource(name, runtime.device, runtime.dtype or spec.dtype, weights_of(spec, name))


async def load_block(
    spec: SwarmSpec, name: str, model_dir: Path, first: int, last: int
) -> LoadedBlock:
    """Load layers ``first..last`` for node ``name`` of ``spec`` (``load_from``)."""
    return await load_from(block_source(spec, name), model_dir, first, last)


async def load_from(source: BlockSource, model_dir: Path, first: int, last: int) -> LoadedBlock:
    """Load layers ``first..last`` in a worker thread (the forward pass's boundary), straight
    onto ``source``'s device (``DeviceUnavailable``, one line, before anything is read if the
    machine cannot give it)."""
    name = source.name
    device = resolve_device(source.device, name)
    dtype = torch_dtype(source.dtype)
    if (note := emulated_dtype_note(name, device, dtype)) is not None:
        log.warning("%s", note)
    weights = resolve_weights(source.weights, model_dir, dtype)
    log.info("%s: layers [%d, %d), weights %s, dtype %s", name, first, last, weights, dtype)
    model = await offload.run_sync(
        lambda: load_stage(model_dir, first, last, dtype=dtype, device=device, weights=weights)
    )
    return LoadedBlock(model, first, last)
