"""Composition root of a node started with ``shard up --role stage --join HOST:PORT``.

The node holds no layer range: it measures its compute per layer on its own device (a scratch
layer of the model's shape, ``shard.model.profile``), starts serving upstream (and RTT probes),
and registers with the coordinator at ``HOST:PORT`` as a spare standby carrying its
``NodeProfile``. The coordinator's scheduler asks it to measure its round trips to the other
candidates, plans the ring (``shard.formation``) and either activates it with a block
(it loads that block and dials its successor, exactly as a cold standby does) or leaves it a
standby for the sticky re-plan after a death.

Weights: when the swarm's spec has ``[fetch]`` and its ``stages`` is ``"all"`` (the default)
or names this node (``fetches_weights``), the node needs no local copy: before profiling it
fetches, verified against the signed manifest, only what every block holds (``config.json``,
tokenizer, safetensors headers: ``shard.nodes.fetching.fetch_common``), and reads the model's
shape from that ``config.json``; on ``Activate`` it fetches exactly the chunks of its block
(``fetch_layers``) into the same cache directory and loads from there. A tampered chunk is
refused and asked of another seeder; a block no seeder can serve fails that ``Activate``
(the scheduler hears why), never the node. Without ``[fetch]`` for it the node reads its
model directory (``--model``, else the spec's ``model``).

The swarm's settings (its name, model, dtype, trust authority, limits, timings) come from the
swarm's spec; the node itself is added to it here as a spare ``[[standby]]`` with its own
listen address, key and token, so every part of a stage node reads it as usual.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import trio

from shard.compute import offload
from shard.messages import NodeProfile
from shard.model.config import ModelConfig
from shard.model.device import resolve_device, torch_dtype
from shard.model.profile import available_memory_bytes, measure_layer_ms
from shard.nodes.auditing import auditing
from shard.nodes.defaults import with_checkpoint_weights
from shard.nodes.fetching import fetch_common
from shard.nodes.stage import StageHandle, _StageNode
from shard.nodes.stage_config import stage_config
from shard.spec.nodes import Address, StandbySpec
from shard.spec.swarm import SpecError, SwarmSpec
from shard.spec.trust import CredentialPaths
from shard.transport import Network

log = logging.getLogger(__name__)

__all__ = ["fetches_weights", "joined_spec", "measure_profile", "run_joined"]


def joined_spec(
    spec: SwarmSpec,
    name: str,
    *,
    join: str,
    listen: str,
    key: Path | None = None,
    token: Path | None = None,
) -> SwarmSpec:
    """``spec`` as node ``name`` joining the coordinator at ``join`` sees it: itself a spare
    standby listening on ``listen`` with ``key``/``token``, the coordinator at ``join``.

    Errors: ``SpecError`` for a name the spec already uses, a bad address, or a secure swarm
    without ``key`` and ``token``."""
    source = f"{spec.source} (--join)"
    taken = {spec.coordinator.name, *(s.name for s in spec.stages)}
    if name in taken | {s.name for s in spec.standbys}:
        raise SpecError(source, "--node", f"{name!r} is a node of the spec; pick another name")
    try:
        coordinator = Address.parse(join)
        here = Address.parse(listen)
    except ValueError as exc:
        raise SpecError(source, "--join/--listen", str(exc)) from None
    if not spec.insecure and (key is None or token is None):
        raise SpecError(
            source, "--key/--token", "a secure swarm admits a joining node by its key and token"
        )
    me = StandbySpec(name, here, credentials=CredentialPaths(key=key, token=token))
    return attrs.evolve(
        spec,
        coordinator=attrs.evolve(spec.coordinator, listen=coordinator),
        standbys=(*spec.standbys, me),
    )


def fetches_weights(spec: SwarmSpec, name: str) -> bool:
    """Whether node ``name`` fetches its block (and its config) per the spec's ``[fetch]``
    rather than reading a local model directory."""
    return spec.fetch is not None and spec.fetch.fetches(name)


def measure_profile(
    spec: SwarmSpec, name: str, config_dir: Path, memory_bytes: int | None
) -> NodeProfile:
    """Time one scratch layer (the shape ``config_dir/config.json`` gives; no weights read)
    on node ``name``'s device for a 1-token and a (K+1)-token chunk (K: the spec's fixed K,
    else 4), and offer ``memory_bytes`` (default: half of what is free). Runs torch: call it
    in a worker thread."""
    config = ModelConfig.from_dir(config_dir)
    runtime = spec.runtime(name)
    device = resolve_device(runtime.device, name)
    policy = spec.speculation.policy
    chunk = 1 + (policy.k if policy.k is not None else min(4, policy.k_max))  # adaptive: typical
    one, many = measure_layer_ms(
        config,
        device=device,
        dtype=torch_dtype(runtime.dtype or spec.dtype),
        rows=(1, chunk),
        weights=runtime.weights,  # the checkpoint's default already in ``spec`` (run_joined)
    )
    memory = available_memory_bytes(device) if memory_bytes is None else memory_bytes
    label = str(device)
    if device.type == "cuda":
        import torch

        label = f"{device} ({torch.cuda.get_device_name(device)})"
    return NodeProfile(label, memory, one, many, chunk)


async def run_joined(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network,
    model_dir: Path,
    memory_bytes: int | None = None,
    startup_timeout_s: float = 120.0,
    task_status: trio.TaskStatus[StageHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run node ``name`` of ``spec`` (from ``joined_spec``): measure, serve, register and wait
    for the scheduler's ``Activate``. Ready once registered. ``model_dir`` is not read when
    the node fetches its weights (``fetches_weights``).

    Errors: ``JoinRefused`` (a registration the scheduler refused), ``NodeReplaced``, the
    first dial's ``TransportError`` / ``HandshakeError``; a fetching node's ``FetchError`` /
    ``ManifestError`` when no seeder serves a verified config (nothing started yet)."""
    fetch = fetches_weights(spec, name)
    config_dir = (await fetch_common(spec, name)).path if fetch else model_dir
    spec = with_checkpoint_weights(spec, config_dir)  # its headers say so before any block
    profile = await offload.run_sync(lambda: measure_profile(spec, name, config_dir, memory_bytes))
    log.info("%s: profile %s", name, profile)
    node = spec.node(name)
    me = _StageNode(
        stage_config(spec, name, fetch=fetch),
        auditing(spec, name, network, None, supervised=True),
        model_dir=model_dir,
        listen=str(node.listen),
        timeout_s=startup_timeout_s,
        block=None,
        profile=profile,
    )
    await me.run(None, task_status=task_status)
