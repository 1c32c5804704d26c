"""A whole swarm inside one Trio run: every node of a spec, joined by an injected network.

The nodes are the same composition roots as ``shard up`` (``shard.nodes.coordinator``), so what
runs here
is what runs across machines; only the ``Network`` differs: memory channels by default,
optionally wrapped in per-edge delay to emulate a WAN, or real WebSockets on loopback.
Tests and benchmarks use it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import trio

from shard.failover.control import NodeReplaced
from shard.model.llama import StageModel
from shard.nodes.compose import with_reach
from shard.nodes.coordinator import (
    CoordinatorHandle,
    DrafterMaker,
    run_coordinator,
    run_stage,
    run_standby,
)
from shard.nodes.drafter import make_drafter
from shard.spec.swarm import SwarmSpec
from shard.transport import DelayNetwork, MemoryNetwork, Network

log = logging.getLogger(__name__)


def spec_latency(spec: SwarmSpec) -> Callable[[str, str], float]:
    """One-way latency in seconds for (sending node, dialled address), from the spec's edges."""
    by_address = {str(spec.coordinator.listen): spec.coordinator.name}
    by_address.update({str(s.listen): s.name for s in spec.stages})
    by_address.update({spec.address_of(s.name): s.name for s in spec.stages})  # nat:NAME
    ring = spec.ring()
    hops = set(itertools.pairwise(ring))

    def latency(src: str, address: str) -> float:
        dst = by_address.get(address)
        if dst is None or (src, dst) not in hops:
            return 0.0
        return spec.edge(src, dst).latency_ms / 1000.0

    return latency


def node_network(spec: SwarmSpec, inner: Network, node: str, *, emulate: bool) -> Network:
    """The network one node sees: ``inner`` (reaching ``reachable = false`` nodes through
    callbacks and the relay when the spec has any: ``shard.nodes.compose.with_reach``),
    delayed per the spec's edges when ``emulate``."""
    reach = with_reach(spec, node, _role(spec, node), inner, owns_inner=False)
    if not emulate:
        return reach
    latency = spec_latency(spec)
    bandwidth = spec.default_bandwidth_mbps * 1e6
    return DelayNetwork(
        reach, lambda src, dst: latency(node, dst), bandwidth_bps=bandwidth, local_name=node
    )


def _role(spec: SwarmSpec, node: str) -> str:
    return "coordinator" if node == spec.coordinator.name else "stage"


async def run_swarm(
    spec: SwarmSpec,
    *,
    model_dir: Path,
    network: Network | None = None,
    emulate_latency: bool = True,
    startup_timeout_s: float = 60.0,
    wrap: Callable[[str, Network], Network] | None = None,
    scopes: dict[str, trio.CancelScope] | None = None,
    refused: trio.MemorySendChannel[str] | None = None,
    wrap_block: Callable[[str, StageModel], StageModel] | None = None,
    drafts: DrafterMaker | None = None,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every node of ``spec`` (stages, standbys, coordinator) in this process until
    cancelled. Reports the coordinator's handle once the ring is connected end to end and
    every standby has registered.

    ``wrap(node, network)`` replaces the network a node sees (fault injection:
    ``shard.testing.faults``). ``scopes``, when given, is filled with each node's cancel scope:
    cancelling one kills that node (its connections close, its state is gone). A node the
    scheduler refuses (replaced while frozen, then woken) ends alone, and its name goes to
    ``refused`` when given. ``wrap_block(node, block)`` replaces the block a ring stage
    runs (spot-check tests put a cheating stage in: ``shard.testing.cheating``).
    ``drafts(spec, model_dir)`` builds the coordinator's draft proposers instead of the spec
    (tests and benchmarks of a proposer the spec cannot name).

    Long on purpose: it is a whole swarm's wiring, one node started after another, and reads
    best in one place.
    """
    inner = network if network is not None else MemoryNetwork()
    scopes = scopes if scopes is not None else {}
    names = (*(s.name for s in spec.stages), *(s.name for s in spec.standbys))
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(inner)
        nets: dict[str, Network] = {}
        for name in (*names, spec.coordinator.name):
            net = node_network(spec, inner, name, emulate=emulate_latency)
            if net is not inner:
                await stack.enter_async_context(net)
            if wrap is not None:
                net = wrap(name, net)
                await stack.enter_async_context(net)
            nets[name] = net
        nursery = await stack.enter_async_context(trio.open_nursery())
        for stage in spec.stages:
            scopes[stage.name] = trio.CancelScope()
            run = run_stage if wrap_block is None else partial(run_stage, wrap_block=wrap_block)
            nursery.start_soon(
                _node,
                scopes[stage.name],
                run,
                spec,
                stage.name,
                nets,
                model_dir,
                startup_timeout_s,
                refused,
            )
        scopes[spec.coordinator.name] = trio.CancelScope()
        handle = await nursery.start(
            _coordinator,
            scopes[spec.coordinator.name],
            spec,
            nets[spec.coordinator.name],
            model_dir,
            startup_timeout_s,
            drafts,
        )
        for standby in spec.standbys:
            scopes[standby.name] = trio.CancelScope()
            await nursery.start(
                _node,
                scopes[standby.name],
                run_standby,
                spec,
                standby.name,
                nets,
                model_dir,
                startup_timeout_s,
                refused,
            )
        task_status.started(handle)


async def _node(
    scope: trio.CancelScope,
    run: Callable[..., Awaitable[None]],
    spec: SwarmSpec,
    name: str,
    nets: dict[str, Network],
    model_dir: Path,
    timeout_s: float,
    refused: trio.MemorySendChannel[str] | None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        try:
            await run(
                spec,
                name,
                network=nets[name],
                model_dir=model_dir,
                startup_timeout_s=timeout_s,
                task_status=task_status,
            )
        except NodeReplaced as exc:  # a stalled node woke up replaced: it ends, the swarm not
            log.warning("%s", exc)
            if refused is not None:
                await refused.send(name)


async def _coordinator(
    scope: trio.CancelScope,
    spec: SwarmSpec,
    network: Network,
    model_dir: Path,
    timeout_s: float,
    drafts: DrafterMaker | None,
    *,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await run_coordinator(
            spec,
            network=network,
            model_dir=model_dir,
            startup_timeout_s=timeout_s,
            drafts=drafts or make_drafter,
            task_status=task_status,
        )
