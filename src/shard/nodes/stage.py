"""Composition roots of the stage and standby nodes (the coordinator's is
``shard.nodes.coordinator``).

A stage node wires: an upstream listener feeding the executor's inbox, the ``StageExecutor``,
a supervised ``DownstreamLink`` to its successor (with the replay log), and a ``ControlClient``
to the scheduler. A standby wires the same parts but leaves the executor and the downstream
link unstarted until the scheduler sends ``Activate``: it holds its block loaded (hot), or
loads it then (a spare: the cold path), dials the successor it was given and serves whoever
the scheduler rewires to it.

A stage reports ready only when its downstream link is up, so when the coordinator's dial to
stage 0 succeeds, the ring is connected end to end.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import trio

from shard.failover.control import ControlClient, NodeReplaced, OrderFailed
from shard.failover.edge import DownstreamLink
from shard.failover.replay import ReplayLog
from shard.messages import Activate, Fault, Hello, Message, NodeName, Register, Rewire, Welcome
from shard.model.config import ModelConfig
from shard.model.device import TORCH_DTYPES, resolve_device, torch_dtype
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.spec.nodes import StageSpec
from shard.spec.swarm import SwarmSpec
from shard.stage import offload
from shard.stage.executor import StageExecutor
from shard.stage.graphs import ChunkGraphs, chunk_rows
from shard.transport import Connection, Network
from shard.transport.links import HandshakeError, accept_peer, pump_in
from shard.trust.compose import signing_identity, signing_token
from shard.trust.device import device_identity
from shard.trust.receipts import ReceiptSigner
from shard.weights.block import fetch_stage, make_seeder

log = logging.getLogger(__name__)

DTYPES = TORCH_DTYPES  # kept for importers; shard.model.device owns the mapping


@attrs.frozen
class StageHandle:
    """What a started stage node reports: its name, block and bound address (a standby has
    no executor until it is activated; a spare's block is (-1, -1))."""

    name: str
    first: int
    last: int
    address: str
    executor: StageExecutor | None


def _successor(spec: SwarmSpec, index: int) -> str:
    if index + 1 < len(spec.stages):
        return str(spec.stages[index + 1].listen)
    return str(spec.coordinator.listen)


class _StageNode:
    """One stage or standby process's actors (see the module docstring)."""

    def __init__(
        self,
        spec: SwarmSpec,
        name: str,
        *,
        network: Network,
        model_dir: Path,
        address: str,
        timeout_s: float,
    ) -> None:
        self.spec = spec
        self.name = NodeName(name)
        self.network = network
        self.model_dir = model_dir
        self.address = address  # where upstream dials us (the bound address once serving)
        self.timeout_s = timeout_s
        self.role = "standby"
        self.slot = ""  # the ring slot served, once a stage
        self.block: tuple[int, int] = (-1, -1)
        self.model: StageModel | None = None
        self.executor: StageExecutor | None = None
        self.link: DownstreamLink | None = None
        self.control: ControlClient | None = None
        self.nursery: trio.Nursery | None = None
        self.replaced: NodeReplaced | None = None
        inbox_send, self._inbox_recv = trio.open_memory_channel[Message](0)
        self.inbox = inbox_send
        failover = spec.failover
        self.replay_log = ReplayLog(max_bytes=failover.replay_max_bytes)

    async def load(self, first: int, last: int) -> None:
        """Load ``[first, last)`` straight onto this node's device (``DeviceUnavailable``, one
        line, before anything is read if the machine cannot give it)."""
        runtime = self.spec.runtime(self.name)
        device = resolve_device(runtime.device, self.name)
        dtype = torch_dtype(runtime.dtype or self.spec.dtype)
        self.model = await offload.run_sync(
            lambda: load_stage(self.model_dir, first, last, dtype=dtype, device=device)
        )
        self.block = (first, last)

    def graphs(self) -> ChunkGraphs | None:
        """The block's CUDA graphs per the spec's ``graphs`` mode (None when ``off``)."""
        mode = self.spec.runtime(self.name).graphs
        if mode == "off" or self.model is None:
            return None
        policy = self.spec.speculation.policy
        return ChunkGraphs(self.model, mode=mode, rows=chunk_rows(policy.k, policy.k_max))

    def hello(self, link: str = "ring") -> Hello:
        return Hello(node=self.name, role="stage", swarm=self.spec.name, link=link)

    def register(self) -> Register:
        return Register(self.name, self.role, self.address, *self.block, slot=self.slot)

    async def report(self, fault: Fault) -> None:
        if self.control is not None:
            await self.control.report(fault)

    async def connect(self, successor: str) -> None:
        """Build the executor and the downstream link, and dial ``successor``."""
        assert self.model is not None
        first, last = self.block
        outbox_send, outbox_recv = trio.open_memory_channel[Message](0)
        node_spec = self.spec.node(self.name)
        self.executor = StageExecutor(
            self.model,
            node=self.name,
            inbox=self._inbox_recv,
            outbox=outbox_send,
            max_sessions=self.spec.limits.max_sessions,
            receipts=ReceiptSigner(
                signing_identity(self.spec, self.name),
                node=self.name,
                address=str(node_spec.listen),
                first=first,
                last=last,
                device=device_identity(),
                token=signing_token(self.spec, self.name),
            ),
            graphs=self.graphs(),
        )
        failover = self.spec.failover
        self.link = DownstreamLink(
            self.name,
            outbox_recv,
            self.network,
            self.hello(),
            replay_log=self.replay_log,
            heartbeat_s=failover.heartbeat_s,
            send_timeout_s=failover.send_timeout_s,
            connect_timeout_s=self.timeout_s,
            handshake_timeout_s=self.spec.limits.handshake_timeout_s,
            on_fault=self.report,
        )
        await self.link.connect(successor)

    def start(self) -> None:
        assert self.nursery is not None and self.executor is not None and self.link is not None
        self.nursery.start_soon(self.executor.run)
        self.nursery.start_soon(self.link.run)
        self.role = "stage"

    async def obey(self, order: Activate | Rewire) -> None:
        if isinstance(order, Rewire):
            if self.link is None:
                raise OrderFailed(f"{self.name} is not in the ring; nothing to rewire")
            await self.link.rewire(order.address, replay=order.replay)
            return
        if self.executor is not None:
            raise OrderFailed(f"{self.name} already serves a ring slot")
        if self.block != (order.first, order.last):
            log.info("%s: loading layers %d..%d (cold)", self.name, order.first, order.last)
            await self.load(order.first, order.last)
        await self.connect(order.successor)
        self.slot = order.slot
        self.start()

    async def serve_upstream(self, conn: Connection) -> None:
        welcome = Welcome(node=self.name, role="stage", swarm=self.spec.name)
        try:
            await accept_peer(conn, welcome, timeout_s=self.spec.limits.handshake_timeout_s)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        await pump_in(self.name, conn, self.inbox.clone())

    async def supervise(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the control link; if the scheduler refuses this node (it was replaced), stop
        the whole node — ``run_stage`` / ``run_standby`` then raise ``NodeReplaced``."""
        assert self.nursery is not None
        try:
            await self.make_control().run(task_status=task_status)
        except NodeReplaced as exc:
            log.error("%s", exc)
            self.replaced = exc
            self.nursery.cancel_scope.cancel()

    def make_control(self) -> ControlClient:
        failover = self.spec.failover
        self.control = ControlClient(
            self.name,
            self.network,
            str(self.spec.coordinator.listen),
            self.hello("control"),
            self.register,
            self.obey,
            heartbeat_s=failover.heartbeat_s,
            dead_after_s=failover.dead_after_s,
            connect_timeout_s=self.timeout_s,
            handshake_timeout_s=self.spec.limits.handshake_timeout_s,
        )
        return self.control


async def run_stage(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network,
    model_dir: Path,
    successor: str | None = None,
    startup_timeout_s: float = 120.0,
    supervised: bool = True,
    task_status: trio.TaskStatus[StageHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run stage ``name`` of ``spec``: load its block, dial its successor, serve upstream.

    ``successor`` overrides the address dialled downstream (a WAN-emulating relay in front of
    the real successor). ``supervised`` (default) keeps a control link to the scheduler; tests
    that play the coordinator themselves turn it off. A failed downstream link is reported to
    the scheduler and waits for a ``Rewire``; it never ends the node.
    """
    node = spec.node(name)
    assert isinstance(node, StageSpec)
    index = [s.name for s in spec.stages].index(name)
    if spec.fetch is not None and spec.fetch.fetches(name):  # verified fetch of the block
        model_dir = (await fetch_stage(spec, name)).path
    config = ModelConfig.from_dir(model_dir)
    first, last = spec.blocks(config.n_layers)[index]
    me = _StageNode(
        spec,
        name,
        network=network,
        model_dir=model_dir,
        address=str(node.listen),
        timeout_s=startup_timeout_s,
    )
    await me.load(first, last)
    me.slot = name
    await me.connect(successor or _successor(spec, index))
    async with trio.open_nursery() as nursery:
        me.nursery = nursery
        me.start()
        if (seeder := make_seeder(spec, name, model_dir)) is not None:
            await nursery.start(seeder.run)  # a [[fetch.seeder]] named like this stage
        me.address = await nursery.start(network.serve, str(node.listen), me.serve_upstream)
        if supervised:
            await nursery.start(me.supervise)
        assert me.executor is not None
        task_status.started(StageHandle(name, first, last, me.address, me.executor))
    if me.replaced is not None:
        raise me.replaced


async def run_standby(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network,
    model_dir: Path,
    startup_timeout_s: float = 120.0,
    task_status: trio.TaskStatus[StageHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run standby ``name``: load its block (none for a spare), serve upstream, register with
    the scheduler and wait for ``Activate``. Reports ready once registered."""
    node = spec.node(name)
    config = ModelConfig.from_dir(model_dir)
    block = spec.standby_block(name, config.n_layers)
    me = _StageNode(
        spec,
        name,
        network=network,
        model_dir=model_dir,
        address=str(node.listen),
        timeout_s=startup_timeout_s,
    )
    if block is not None:
        await me.load(*block)
    async with trio.open_nursery() as nursery:
        me.nursery = nursery
        me.address = await nursery.start(network.serve, str(node.listen), me.serve_upstream)
        await nursery.start(me.supervise)
        first, last = me.block
        task_status.started(StageHandle(name, first, last, me.address, None))
    if me.replaced is not None:
        raise me.replaced
