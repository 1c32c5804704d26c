"""Composition roots of the stage and standby nodes (the coordinator's is
``shard.nodes.coordinator``).

A stage node wires: an upstream listener feeding the executor's inbox, the ``StageExecutor``,
a supervised ``DownstreamLink`` to its successor (with the replay log), and a ``ControlClient``
to the scheduler. A standby wires the same parts but leaves the executor and the downstream
link unstarted until the scheduler sends ``Activate``: it holds its block loaded (hot), or
loads it then (a spare: the cold path), dials the successor it was given and serves whoever
the scheduler rewires to it (blocks load with ``shard.nodes.loading``). An auditor
(``[[standby]] role = "auditor"``) is a standby that registers as ``auditor`` and refuses
``Activate``: it only answers audit requests.

A stage reports ready only when its downstream link is up, so when the coordinator's dial to
stage 0 succeeds, the ring is connected end to end.

The roots below read the spec; the node itself holds only what it reads of it, one frozen
``StageNodeConfig`` built once (``shard.nodes.stage_config``), and its part in spot checks
(``shard.nodes.auditing``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio

from shard.failover.control import (
    ControlClient,
    ControlLink,
    JoinRefused,
    NodeReplaced,
    OrderFailed,
)
from shard.failover.duties import duties
from shard.failover.edge import DownstreamLink
from shard.failover.fence import Fence
from shard.failover.replay import ReplayLog
from shard.membership.rtt import measure_row, serve_probes
from shard.messages import (
    Activate,
    Fault,
    Hello,
    MeasureRtt,
    Message,
    NodeName,
    NodeProfile,
    Register,
    Rewire,
    RttReport,
    StageReport,
    Welcome,
)
from shard.model.config import ModelConfig
from shard.model.device import TORCH_DTYPES
from shard.model.llama import StageModel
from shard.nodes.auditing import Auditing, auditing
from shard.nodes.defaults import with_checkpoint_defaults
from shard.nodes.fetching import fetch_block, fetch_stage, make_seeder
from shard.nodes.loading import LoadedBlock, load_block, load_from
from shard.nodes.sizes import model_facts
from shard.nodes.stage_config import StageNodeConfig, stage_config
from shard.spec.nodes import StageSpec
from shard.spec.swarm import SwarmSpec
from shard.stage.config import StageAides
from shard.stage.executor import StageExecutor
from shard.stage.graphs import ChunkGraphs
from shard.stage.tail_drafts import TailDrafts
from shard.transport import Connection, Network, TransportError
from shard.transport.guard import serve_one
from shard.transport.links import HandshakeError, accept_peer, pump_in
from shard.trust.device import device_identity
from shard.trust.identity import IdentityError
from shard.trust.receipts import ReceiptSigner
from shard.weights.fetch import FetchError
from shard.weights.manifest import ManifestError
from shard.weights.seeder import Seeder

log = logging.getLogger(__name__)

DTYPES = TORCH_DTYPES  # kept for importers; shard.model.device owns the mapping
#: How often a stage checks its counters for a connected monitor (``_serve_monitor``).
_REPORT_S = 0.05


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
    if index + 1 < len(spec.stages):  # nat:NAME when it accepts no inbound connection
        return spec.address_of(spec.stages[index + 1].name)
    return str(spec.coordinator.listen)


@attrs.frozen
class _Serving:
    """What serves a ring slot: the executor and its downstream link, built together."""

    slot: str
    executor: StageExecutor
    link: DownstreamLink


class _StageNode:
    """One stage or standby process's actors (see the module docstring).

    Channels: upstream links -> executor (``inbox``), downstream link -> control client
    (``faults``), and an ``Activate`` carried out -> the task that starts what it built
    (``starts``). A standby serves no slot (``_serving`` is None) until the scheduler
    activates it; that is the one thing that changes.
    """

    def __init__(
        self,
        config: StageNodeConfig,
        audits: Auditing,
        *,
        model_dir: Path,
        listen: str,
        timeout_s: float,
        block: LoadedBlock | None,
        supervised: bool = True,
        profile: NodeProfile | None = None,
    ) -> None:
        """``config``: what the node reads of its spec (``stage_config``); ``audits``: its
        network and its part in spot checks (``shard.nodes.auditing.auditing``, made with the
        same ``supervised``); ``profile``: a node started with ``--join`` registers it (and
        measures RTTs). With ``config.fetch`` a cold load fetches its block (verified) instead
        of reading ``model_dir``."""
        self._config = config
        self._fence = Fence()  # the coordinator generation it follows
        self._profile = profile
        self._name = config.name
        self._auditing = audits
        self._network = audits.network  # mirrored when the swarm audits
        self._model_dir = model_dir
        self._listen = listen
        self._address = listen  # where upstream dials us (the bound address once serving)
        self._timeout_s = timeout_s
        self._block = block
        self._supervised = supervised
        self._serving: _Serving | None = None
        self._replay_log = ReplayLog(max_bytes=config.replay_max_bytes)
        self._inbox_send, self._inbox = trio.open_memory_channel[Message](0)
        self._faults_send, self._faults = trio.open_memory_channel[Fault](0)
        self._starts_send, self._starts = trio.open_memory_channel[_Serving](0)

    def _hello(self, link: str = "ring") -> Hello:
        return Hello(node=self._name, role="stage", swarm=self._config.swarm, link=link)

    def _register(self) -> Register:
        """What this node registers as now (a snapshot, read on each control connection)."""
        first, last = (self._block.first, self._block.last) if self._block else (-1, -1)
        role, slot = ("stage", self._serving.slot) if self._serving else (self._idle_role, "")
        return Register(
            self._name, role, self._address, first, last, slot=slot, profile=self._profile
        )

    @property
    def _idle_role(self) -> str:
        """Out of the ring: ``standby``, or ``auditor`` (a ``[[standby]] role = "auditor"``)."""
        if self._profile is not None:  # a joining node: not in the spec, never an auditor
            return "standby"
        return self._config.idle_role

    def _graphs(self, block: LoadedBlock) -> ChunkGraphs | None:
        """The block's CUDA graphs per the spec's ``graphs`` mode (None when ``off``, and for a
        model with linear attention, whose chunks run eagerly)."""
        mode = self._config.graphs
        if mode == "off" or block.model.config.linear_attn is not None:
            return None  # a linear-attention layer reads its state's positions on the host
        return ChunkGraphs(block.model, mode=mode, rows=self._config.graph_rows)

    async def build(self, block: LoadedBlock, slot: str, successor: str) -> _Serving:
        """Build the executor and the downstream link for ``slot``, and dial ``successor``."""
        outbox_send, outbox_recv = trio.open_memory_channel[Message](0)
        config = self._config
        executor = StageExecutor(
            block.model,
            config.executor,
            self._inbox,
            outbox_send,
            aides=StageAides(
                receipts=ReceiptSigner(
                    config.signing.identity(),
                    node=self._name,
                    address=self._address,
                    first=block.first,
                    last=block.last,
                    device=device_identity(),
                    token=config.signing.token_text(),
                ),
                graphs=self._graphs(block),
                drafts=TailDrafts(block.mtp) if block.mtp is not None else None,
            ),
        )
        link = DownstreamLink(
            self._name,
            outbox_recv,
            self._network,
            self._hello(),
            attrs.evolve(config.edge, connect_timeout_s=self._timeout_s),
            replay_log=self._replay_log,
            faults=self._faults_send if self._supervised else None,
        )
        await link.connect(successor)
        return _Serving(slot, executor, link)

    async def _obey(self, order: Activate | Rewire) -> None:
        """Carry out the scheduler's order (asked by the control client: ``Duties.orders``)."""
        if isinstance(order, Rewire):
            if self._serving is None:
                raise OrderFailed(f"{self._name} is not in the ring; nothing to rewire")
            await self._serving.link.rewire(order.address, replay=order.replay)
            return
        if self._serving is not None:
            raise OrderFailed(f"{self._name} already serves a ring slot")
        if self._idle_role == "auditor":
            raise OrderFailed(f"{self._name} is an auditor: it never joins the ring")
        block = self._block
        if block is None or (block.first, block.last) != (order.first, order.last):
            model_dir = await self._block_dir(order.first, order.last)
            log.info("%s: loading layers %d..%d (cold)", self._name, order.first, order.last)
            block = await load_from(self._config.load, model_dir, order.first, order.last)
            self._block = block
        serving = await self.build(block, order.slot, order.successor)
        await self._starts_send.send(serving)
        self._serving = serving

    async def _block_dir(self, first: int, last: int) -> Path:
        """Where layers ``[first, last)`` load from: ``model_dir``, or (``config.fetch``) the block
        fetched and verified chunk by chunk. A fetch that fails — every seeder bad, slow or
        gone, a manifest refused — fails this order (``OrderFailed``), never the node."""
        if self._config.fetch is None:
            return self._model_dir
        log.info("%s: fetching layers [%d, %d) (verified)", self._name, first, last)
        try:
            return (await fetch_block(self._config.fetch, first, last)).path
        except (FetchError, ManifestError, IdentityError, ValueError, KeyError) as exc:
            raise OrderFailed(
                f"{self._name}: could not fetch layers [{first}, {last}): {exc}"
            ) from None

    async def _serve_upstream(self, conn: Connection) -> None:
        welcome = Welcome(node=self._name, role="stage", swarm=self._config.swarm)
        try:
            hello = await accept_peer(
                conn, welcome, timeout_s=self._config.edge.handshake_timeout_s
            )
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        if hello.role == "monitor":
            await self._serve_monitor(conn)
            return
        if hello.link == "probe":  # a joining node measuring its RTT to this one
            await serve_one(conn, serve_probes, what="probe link")
            return
        pump = partial(pump_in, self._name, sink=self._inbox_send.clone())
        if hello.role == "coordinator":  # fenced by its generation (shard.failover.fence)
            ring = partial(serve_one, conn, pump, what="ring link")
            await self._fence.serve(hello.generation, ring, conn, node=self._name)
            return
        await serve_one(conn, pump, what="ring link")  # its errors end it, not this node

    async def _serve_monitor(self, conn: Connection) -> None:
        """Send this stage's counters (``StageReport``) to a monitor whenever they change,
        checked every ``_REPORT_S``, until it goes away. Read-only: nothing it sends is read."""
        sent: StageReport | None = None
        try:
            while True:
                report = self._stage_report()
                if report != sent:
                    await conn.send(report)
                    sent = report
                await trio.sleep(_REPORT_S)
        except TransportError:
            log.info("%s: monitor %s went away", self._name, conn.peer)

    def _stage_report(self) -> StageReport:
        name = NodeName(self._name)
        serving, block = self._serving, self._block
        first, last = (block.first, block.last) if block is not None else (-1, -1)
        if serving is None:
            return StageReport(name, first, last, 0, 0, 0, 0)
        stats = serving.executor.statistics()
        return StageReport(
            name, first, last, stats.sessions, stats.chunks, stats.positions, stats.faults
        )

    async def _start_each(self, nursery: trio.Nursery) -> None:
        """Start what each ``Activate`` built, in the node's nursery."""
        async with self._starts:
            async for serving in self._starts:
                nursery.start_soon(serving.executor.run)
                nursery.start_soon(serving.link.run)

    async def _measure(self, order: MeasureRtt) -> RttReport:
        return await measure_row(self._network, self._hello("probe"), order)

    def _control(self, nursery: trio.Nursery) -> ControlClient:
        """The control link, its questions answered by this node in ``nursery``."""
        config = self._config
        link = ControlLink(
            self._name,
            config.coordinators,
            self._hello("control"),
            heartbeat_s=config.edge.heartbeat_s,
            dead_after_s=config.dead_after_s,
            connect_timeout_s=self._timeout_s,
            handshake_timeout_s=config.edge.handshake_timeout_s,
        )
        measure = self._measure if self._profile is not None else None
        asked = duties(nursery, self._obey, self._auditing.audit, measure)
        return ControlClient(
            link,
            self._network,
            self._register,
            asked,
            faults=self._faults,
            copies=self._auditing.copies,
            fence=self._fence,
        )

    async def run(
        self,
        serving: _Serving | None,
        *,
        seeder: Seeder | None = None,
        task_status: trio.TaskStatus[StageHandle] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve ``serving``'s slot (a stage) or wait for ``Activate`` (a standby): serve
        upstream, keep the control link when supervised. Ready once serving and registered.

        Errors: ``NodeReplaced`` when the scheduler refuses this node (it was replaced):
        the whole node stops.
        """
        replaced: list[NodeReplaced | JoinRefused] = []
        async with trio.open_nursery() as nursery:

            async def supervise(*, task_status: trio.TaskStatus[None]) -> None:
                try:
                    await self._control(nursery).run(task_status=task_status)
                except (NodeReplaced, JoinRefused) as exc:
                    log.info("%s", exc)  # raised below: whoever runs the node reports it
                    replaced.append(exc)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(self._start_each, nursery)
            if serving is not None:
                self._serving = serving
                nursery.start_soon(serving.executor.run)
                nursery.start_soon(serving.link.run)
            if seeder is not None:
                await nursery.start(seeder.run)  # a [[fetch.seeder]] named like this stage
            self._address = await nursery.start(
                self._network.serve, self._listen, self._serve_upstream
            )
            if self._supervised:
                await nursery.start(supervise)
            first, last = (self._block.first, self._block.last) if self._block else (-1, -1)
            executor = serving.executor if serving is not None else None
            task_status.started(StageHandle(self._name, first, last, self._address, executor))
        if replaced:
            raise replaced[0]


async def run_stage(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network,
    model_dir: Path,
    successor: str | None = None,
    startup_timeout_s: float = 120.0,
    supervised: bool = True,
    wrap_block: Callable[[str, StageModel], StageModel] | None = None,
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
    spec = with_checkpoint_defaults(spec, model_dir)
    config = ModelConfig.from_dir(model_dir)
    blocks = spec.blocks(config.n_layers, model_facts(config, spec, model_dir))
    block = await load_block(spec, name, model_dir, *blocks[index])
    if wrap_block is not None:  # tests only: a cheating stage (shard.testing.cheating)
        block = attrs.evolve(block, model=wrap_block(name, block.model))
    me = _StageNode(
        stage_config(spec, name),
        auditing(spec, name, network, block.model, supervised=supervised),
        model_dir=model_dir,
        listen=str(node.listen),
        timeout_s=startup_timeout_s,
        block=block,
        supervised=supervised,
    )
    serving = await me.build(block, name, successor or _successor(spec, index))
    seeder = make_seeder(spec, name, model_dir)
    await me.run(serving, seeder=seeder, task_status=task_status)


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
    spec = with_checkpoint_defaults(spec, model_dir)
    node = spec.node(name)
    config = ModelConfig.from_dir(model_dir)
    block = spec.standby_block(name, config.n_layers, model_facts(config, spec, model_dir))
    loaded = await load_block(spec, name, model_dir, *block) if block is not None else None
    me = _StageNode(
        stage_config(spec, name),
        auditing(spec, name, network, loaded.model if loaded else None, supervised=True),
        model_dir=model_dir,
        listen=str(node.listen),
        timeout_s=startup_timeout_s,
        block=loaded,
    )
    await me.run(None, task_status=task_status)
