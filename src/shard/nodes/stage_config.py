"""What a stage or standby node reads of its swarm's spec, taken once by its composition root
(``stage_config``): the node holds this frozen record, never the whole spec.

Whatever needs more of the spec is resolved here into a small record of its own: where the
node reads its signing key and token (``shard.nodes.compose.Signing``), how it loads a block
(``shard.nodes.loading.BlockSource``) and, for a node that fetches its block on ``Activate``,
how it fetches (``shard.nodes.fetching.BlockFetch``).
"""

from __future__ import annotations

import attrs

from shard.messages import NodeName
from shard.nodes.compose import Signing, signing
from shard.nodes.fetching import BlockFetch, block_fetch
from shard.nodes.loading import BlockSource, block_source
from shard.spec.nodes import StandbySpec
from shard.spec.swarm import SwarmSpec
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
    max_sessions: int
    max_len: int
    max_batch_rows: int
    gather_window_s: float
    kv_budget_bytes: int | None  # None: no cap but the two above
    handshake_timeout_s: float
    replay_max_bytes: int
    heartbeat_s: float
    send_timeout_s: float
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
        max_sessions=limits.max_sessions,
        max_len=limits.max_len,
        max_batch_rows=limits.max_batch_rows,
        gather_window_s=limits.gather_window_s,
        kv_budget_bytes=limits.kv_budget_mib << 20 or None,
        handshake_timeout_s=limits.handshake_timeout_s,
        replay_max_bytes=failover.replay_max_bytes,
        heartbeat_s=failover.heartbeat_s,
        send_timeout_s=failover.send_timeout_s,
        dead_after_s=failover.dead_after_s,
        signing=signing(spec, name),
        load=block_source(spec, name),
        fetch=block_fetch(spec, name) if fetch else None,
    )
