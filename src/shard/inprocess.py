"""A whole swarm inside one Trio run: every node of a spec, joined by an injected network.

The nodes are the same composition roots as ``shard up`` (``shard.node``), so what runs here
is what runs across machines; only the ``Network`` differs: memory channels by default,
optionally wrapped in per-edge delay to emulate a WAN, or real WebSockets on loopback.
Tests and benchmarks use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from shard.config import SwarmSpec
from shard.node import CoordinatorHandle, run_coordinator, run_stage
from shard.transport import DelayNetwork, MemoryNetwork, Network


def spec_latency(spec: SwarmSpec) -> Callable[[str, str], float]:
    """One-way latency in seconds for (sending node, dialled address), from the spec's edges."""
    by_address = {str(spec.coordinator.listen): spec.coordinator.name}
    by_address.update({str(s.listen): s.name for s in spec.stages})
    ring = spec.ring()
    hops = set(itertools.pairwise(ring))

    def latency(src: str, address: str) -> float:
        dst = by_address.get(address)
        if dst is None or (src, dst) not in hops:
            return 0.0
        return spec.edge(src, dst).latency_ms / 1000.0

    return latency


def node_network(spec: SwarmSpec, inner: Network, node: str, *, emulate: bool) -> Network:
    """The network one node sees: ``inner``, delayed per the spec's edges when ``emulate``."""
    if not emulate:
        return inner
    latency = spec_latency(spec)
    bandwidth = spec.default_bandwidth_mbps * 1e6
    return DelayNetwork(
        inner, lambda src, dst: latency(node, dst), bandwidth_bps=bandwidth, local_name=node
    )


async def run_swarm(
    spec: SwarmSpec,
    *,
    model_dir: Path,
    network: Network | None = None,
    emulate_latency: bool = True,
    startup_timeout_s: float = 60.0,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every node of ``spec`` in this process until cancelled.

    Reports the coordinator's handle once the ring is connected end to end.
    """
    inner = network if network is not None else MemoryNetwork()
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(inner)
        nets: dict[str, Network] = {}
        for name in (*(s.name for s in spec.stages), spec.coordinator.name):
            net = node_network(spec, inner, name, emulate=emulate_latency)
            if net is not inner:
                await stack.enter_async_context(net)
            nets[name] = net
        nursery = await stack.enter_async_context(trio.open_nursery())
        for stage in spec.stages:
            nursery.start_soon(
                _stage, spec, stage.name, nets[stage.name], model_dir, startup_timeout_s
            )
        handle = await nursery.start(
            _coordinator, spec, nets[spec.coordinator.name], model_dir, startup_timeout_s
        )
        task_status.started(handle)


async def _stage(
    spec: SwarmSpec, name: str, network: Network, model_dir: Path, timeout_s: float
) -> None:
    await run_stage(spec, name, network=network, model_dir=model_dir, startup_timeout_s=timeout_s)


async def _coordinator(
    spec: SwarmSpec,
    network: Network,
    model_dir: Path,
    timeout_s: float,
    *,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    await run_coordinator(
        spec,
        network=network,
        model_dir=model_dir,
        startup_timeout_s=timeout_s,
        task_status=task_status,
    )
