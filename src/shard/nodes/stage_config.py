"""What a stage or standby node reads of its swarm's spec, taken once by its composition root
(``stage_config``): the node holds this frozen record, never the whole spec.

Whatever needs more of the spec is resolved here into a small record of its own: where the
node reads its signing key and token (``shard.nodes.compose.Signing``), how it loads a block
(``shard.nodes.loading.BlockSource``) and, for a node that fetches its block on ``Activate``,
how it fetches (``shard.nodes.fetching.BlockFetch``).
"""

from __future__ import annotations

import attrs

from shard.failover.edge import EdgeTimings
from shard.messages import NodeName
from shard.nodes.compose import Signing, signing
from shard.nodes.fetching import BlockFetch, block_fetch
from shard.nodes.loading import BlockSource, block_source
from shard.spec.nodes import StandbySpec
from shard.spec.swarm import SwarmSpec
from shard.stage.config import ExecutorConfig
from shard.stage.graphs import chunk_rows


@attrs.frozen
class StageNodeConfig:
    """One stage or standby node's settings, from its swarm's spec (``stage_config``)."""

    name: NodeName
    swarm: str  # the swarm's name, in every Hello and Welcome
    coordinator: str  # where the scheduler listens (the control link dials it)
    coordinators: tuple[str, ...]  # the primary's and a standby coordinator's: tried in turn
    idle_role: str  # out of the ring: "standby", or "auditor" ([[standby]] role)
    graphs: str  # the CUDA-graph mode ("off": none)
    graph_rows: frozenset[int]  # the chunk row counts graphs are captured for
    executor: ExecutorConfig  # its executor's record ([limits]: sessions, length, batching)
    edge: EdgeTimings  # its ring edge's, and its links' handshake (connect: the node's own)
    replay_max_bytes: int
    dead_after_s: float
    signing: Signing
    load: BlockSource  # how a block is loaded (a standby's cold load, on Activate)
    fetch: BlockFetch | None  # None: blocks load from the model directory, not fetched


def stage_config(spec: SwarmSpec, name: str, *, fetch: bool = False) -> StageNodeConfig:
    """Node ``name``'s ``StageNodeConfig``; ``fetch``: it fetches its block on ``Activate``
    (per ``spec.fetch``, verified) rather than reading its model directory.

    Errors: ``SpecError`` if ``spec`` has no node ``name``."""
    node = spec.node(name)
    limits, failover = spec.limits, spec.failover
    policy = spec.speculation.policy
    return StageNodeConfig(
        name=NodeName(name),
        swarm=spec.name,
        coordinator=str(spec.coordinator.listen),
        coordinators=spec.coordinator.addresses,
        idle_role=node.role if isinstance(node, StandbySpec) else "standby",
        graphs=spec.runtime(name).graphs,
        graph_rows=chunk_rows(policy.k, policy.k_max),
        executor=ExecutorConfig(
            NodeName(name),
            max_sessions=limits.max_sessions,
            max_len=limits.max_len,
            max_batch_rows=limits.max_batch_rows,
            gather_window_s=limits.gather_window_s,
            kv_budget_bytes=limits.kv_budget_mib << 20 or None,
        ),
        edge=edge_timings(spec),
        replay_max_bytes=failover.replay_max_bytes,
        dead_after_s=failover.dead_after_s,
        signing=signing(spec, name),
        load=block_source(spec, name),
        fetch=block_fetch(spec, name) if fetch else None,
    )


def edge_timings(spec: SwarmSpec, connect_timeout_s: float | None = None) -> EdgeTimings:
    """A ring edge's timings from ``spec`` (``[failover]``, ``limits``); the dial's budget is
    the node's startup timeout, given by the node (``EdgeTimings``' default when None)."""
    timings = EdgeTimings(
        heartbeat_s=spec.failover.heartbeat_s,
        send_timeout_s=spec.failover.send_timeout_s,
        handshake_timeout_s=spec.limits.handshake_timeout_s,
    )
    if connect_timeout_s is None:
        return timings
    return attrs.evolve(timings, connect_timeout_s=connect_timeout_s)
