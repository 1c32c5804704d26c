"""Loading a stage's or standby's block of layers: onto the node's device, in its dtype, its
weights held as the spec says (``shard.nodes.auditing.weights_of``), in a worker thread. The
stage and standby roots (``shard.nodes.stage``) load with it, at start and on ``Activate``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import torch

from shard.compute import offload
from shard.decode.head.mtp import MtpError, MtpHead
from shard.model.config import ModelLoadError
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
    mtp: MtpHead | None = None  # the checkpoint's MTP block, at a tail that drafts with it


@attrs.frozen
class BlockSource:
    """How node ``name`` loads a block, as its spec says (``block_source``): its device (as
    written, resolved when loading), dtype and weights (``weights_of``)."""

    name: str
    device: str
    dtype: str
    weights: str | None
    mtp: bool = False  # the spec drafts with the MTP block at the tail: the tail loads it


def block_source(spec: SwarmSpec, name: str) -> BlockSource:
    """Node ``name``'s ``BlockSource`` (``SpecError`` if there is no such node)."""
    runtime = spec.runtime(name)
    dtype, weights = runtime.dtype or spec.dtype, weights_of(spec, name)
    return BlockSource(name, runtime.device, dtype, weights, mtp=spec.speculation.mtp_at_tail)


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
    mtp = None
    if source.mtp and model.is_last:
        mtp = await offload.run_sync(_load_mtp, name, model_dir, dtype, device)
    return LoadedBlock(model, first, last, mtp)


def _load_mtp(
    name: str, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> MtpHead | None:
    """The tail's MTP block, in the block's dtype on its device; None (said in the log) when
    it cannot be read here: the tail then serves sessions that ask for its drafts without
    any (they decode plainly), and every other session as before."""
    try:
        return MtpHead.load(model_dir, dtype=dtype, device=device)
    except (MtpError, ModelLoadError) as exc:
        log.warning("%s: no MTP drafts at this tail: %s", name, exc)
        return None
