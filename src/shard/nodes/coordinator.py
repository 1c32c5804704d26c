"""Composition roots: wire the actors of one node (stage or coordinator) and start them.

This is the only module that connects actors to each other and to the network; actors get
channels, never sockets. A node reports ready (``task_status.started``) only when it can do
its job: a stage serves its upstream only after its own downstream link is up, so when the
coordinator's dial to stage 0 succeeds the whole ring is connected, end to end.

Supervision: every actor of a node lives in one nursery. The coordinator's process also runs
the scheduler (``shard.failover.scheduler``): every stage and standby keeps a control link
to it, and a node that dies is replaced by a standby while the requests wait
(docs/failover.md). Stage roots: ``shard.nodes.stage``; the return link: ``return_link``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import attrs
import trio

from shard.audit.checker import SpotChecker, SpotEvent, SpotOutcome
from shard.audit.hub import AuditHub
from shard.compute import offload
from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig, Hold
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.follow import serve_follower
from shard.coordinator.receipt_log import ReceiptLog
from shard.coordinator.service import complete
from shard.coordinator.text import TextAdapter
from shard.decode.draft import Drafter
from shard.failover.edge import DownstreamLink
from shard.failover.events import RingControl
from shard.failover.replay import ReplayLog
from shard.failover.scheduler import Scheduler, Slot
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.formation.formation import Prober
from shard.membership.rtt import measure_rtt, serve_probes
from shard.messages import (
    Fault,
    GenerateRequest,
    Hello,
    Message,
    NodeName,
    SessionId,
    Welcome,
)
from shard.messages.audit import AuditCopy
from shard.model.config import ModelConfig
from shard.model.tokenizer import Tokenizer
from shard.nodes.api import make_server, serve_api
from shard.nodes.auditing import hold_gate, weights_of
from shard.nodes.compose import signing_identity, signing_token
from shard.nodes.defaults import with_checkpoint_defaults
from shard.nodes.drafter import make_drafter
from shard.nodes.return_link import ReturnEndpoint
from shard.nodes.sizes import model_facts
from shard.nodes.stage import DTYPES, StageHandle, run_stage, run_standby
from shard.nodes.stage_config import edge_timings
from shard.observe.devices import DeviceProbe
from shard.observe.status import StatusFeed, StatusReads
from shard.placement import ModelFacts
from shard.spec.formation import FormationSpec
from shard.spec.limits import Limits
from shard.spec.nodes import CoordinatorSpec
from shard.spec.swarm import SwarmSpec
from shard.transport import Connection, ConnectionClosed, Network, TransportError
from shard.transport.guard import IdleDeadline, PeerTooSlow, send_within, serve_one
from shard.transport.links import HandshakeError, accept_peer
from shard.transport.mirror import MirrorNetwork
from shard.trust.receipts import RunSigner

log = logging.getLogger(__name__)

#: Builds the coordinator's draft proposers from its spec and model (``make_drafter``).
DrafterMaker = Callable[[SwarmSpec, Path], Drafter | None]


@attrs.frozen
class CoordinatorHandle:
    """What a started coordinator node reports; in-process callers use it to generate."""

    name: str
    address: str
    coordinator: Coordinator
    tokenizer: Tokenizer
    text: TextAdapter  # the coordinator's one text adapter (its wire clients' and its API's)
    scheduler: Scheduler | None = None
    api: str | None = None  # the HTTP API's http://host:port when [api] listen is set
    checks: SpotChecker | None = None  # the spot checker (strikes, evictions)


def _hello(spec: SwarmSpec, name: str, role: str) -> Hello:
    return Hello(node=NodeName(name), role=role, swarm=spec.name)


def _slots(spec: SwarmSpec, config: ModelConfig, model_dir: Path) -> list[Slot]:
    if spec.formation is not None:
        return []  # the scheduler fills them when the ring forms
    blocks = spec.blocks(config.n_layers, model_facts(config, spec, model_dir))
    return [
        Slot(NodeName(s.name), first, last, NodeName(s.name), spec.address_of(s.name))
        for s, (first, last) in zip(spec.stages, blocks, strict=True)
    ]


def _router(
    spec: SwarmSpec,
    model_dir: Path,
    config: ModelConfig,
    drafter: Drafter | None,
    *,
    to_ring: trio.MemorySendChannel[Message],
    from_ring: trio.MemoryReceiveChannel[Message],
    control: trio.MemoryReceiveChannel[RingControl],
    sent_log: ReplayLog,
    nonces: Callable[[SessionId], bytes] | None,
    hold: Hold | None = None,
    checkpoints: CheckpointStore | None = None,
) -> tuple[Coordinator, Tokenizer]:
    """The coordinator's router and its tokenizer."""
    name = NodeName(spec.coordinator.name)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_ids)))
    coordinator = Coordinator(
        CoordinatorConfig(
            node=name,
            eos_ids=eos,
            limits=spec.limits,
            speculation=spec.speculation.policy,
            incarnation=secrets.randbits(20),
            feature_dim=config.hidden_size,
        ),
        CoordinatorChannels(to_ring=to_ring, from_ring=from_ring, control=control),
        CoordinatorAides(
            drafter=drafter,
            signer=RunSigner(
                signing_identity(spec, name),
                coordinator=name,
                model=spec.model,
                n_layers=config.n_layers,
                n_stages=len(spec.stages),
                swarm=spec.name,
                token=signing_token(spec, name),
            ),
            checkpoints=checkpoints,
            sent_log=sent_log,
            nonces=nonces,
            hold=hold,
            receipts=None
            if spec.ledger.receipts is None
            else ReceiptLog(Path(spec.ledger.receipts)),
        ),
    )
    return coordinator, tokenizer


@attrs.frozen
class _Listener:
    """Hands each connection to the coordinator's listen address to the actor its ``Hello``
    names: the scheduler (control links), a client, a monitor, or the return endpoint."""

    welcome: Welcome
    limits: Limits
    coordinator: Coordinator
    text: TextAdapter
    scheduler: Scheduler
    feed: StatusFeed
    endpoint: ReturnEndpoint
    store: CheckpointStore | None  # its checkpoints: what a standby follows, clients resume

    @property
    def generation(self) -> int:
        return self.welcome.generation

    async def handle(self, conn: Connection) -> None:
        try:
            hello = await accept_peer(conn, self.welcome, timeout_s=self.limits.handshake_timeout_s)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        # Each link's errors end that link only (shard.transport.guard), never this node.
        node = self.welcome.node
        if hello.link == "follow" and hello.role == "coordinator" and self.store is not None:
            follower = partial(serve_follower, self.store, node=node, generation=self.generation)
            await serve_one(conn, follower, what="follow link", node=node)
        elif hello.link == "control" and hello.role == "stage":
            serve = partial(self.scheduler.serve, hello=hello)
            await serve_one(conn, serve, what="control link")
        elif hello.role == "client":
            client = partial(
                _serve_client, self.coordinator, self.text, limits=self.limits, store=self.store
            )
            await serve_one(conn, client, what="client link", node=node)
        elif hello.role == "monitor":  # the status feed: reads, may reset
            await serve_one(conn, self.feed.serve, what="monitor link", node=node)
        elif hello.link == "probe":  # a joining node measuring its RTT to the coordinator
            await serve_one(conn, serve_probes, what="probe link")
        else:
            await self.endpoint.serve(conn, hello, tail=self.scheduler.tail())


async def run_coordinator(
    spec: SwarmSpec,
    *,
    network: Network,
    model_dir: Path,
    successor: str | None = None,
    startup_timeout_s: float = 120.0,
    drafts: DrafterMaker = make_drafter,
    generation: int = 1,
    adopted: Sequence[RequestCheckpoint] = (),
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the coordinator and its scheduler: serve the return endpoint, control links and
    clients, dial stage 0. ``drafts`` builds its draft proposers (the spec's, by default).
    ``generation`` fences older coordinators off the stages; ``adopted``: the requests a
    standby took over, resumed when their clients come back (docs/failover.md).

    The channels: requests -> ring link (``to_ring``), return link -> router (``from_ring``),
    scheduler -> router (``control``: pause, resume, ring lost, events), ring link ->
    scheduler (``ring_faults``). Ready when stage 0 answered (so the whole ring is up) and the
    tail has dialled back.

    Longer than most functions on purpose: it is the coordinator's wiring, one construction
    after another, and reads best in one place.
    """
    spec = with_checkpoint_defaults(spec, model_dir)  # as every stage resolves it
    me: CoordinatorSpec = spec.coordinator
    name = NodeName(me.name)
    to_ring_send, to_ring_recv = trio.open_memory_channel[Message](0)
    from_ring_send, from_ring_recv = trio.open_memory_channel[Message](0)
    control_send, control_recv = trio.open_memory_channel[RingControl](0)
    faults_send, faults_recv = trio.open_memory_channel[Fault](0)
    drafter = await offload.run_sync(drafts, spec, model_dir)
    failover = spec.failover
    sent_log = ReplayLog(max_bytes=failover.replay_max_bytes)  # recorded by the router
    config = ModelConfig.from_dir(model_dir)
    store = _store(spec, adopted)
    batched = spec.limits.max_batch_rows > 1  # then no audit can be bit-exact
    hub = None
    if spec.audit.enabled:  # each accused's weights declared as the spec gives them
        hub = AuditHub(spec.audit, name, batched=batched, weights_of=partial(weights_of, spec))
    coordinator, tokenizer = _router(
        spec,
        model_dir,
        config,
        drafter,
        to_ring=to_ring_send,
        from_ring=from_ring_recv,
        control=control_recv,
        sent_log=sent_log,
        nonces=hub.nonce if hub is not None else None,
        hold=hold_gate(hub),
        checkpoints=store,
    )
    # The ring link's and the return link's copies of ring chunks go to the scheduler.
    copies_send, copies_recv = trio.open_memory_channel[AuditCopy](0)
    mirror = MirrorNetwork(network, copies_send.send) if spec.audit.enabled else None
    ring_link = DownstreamLink(
        name,
        to_ring_recv,
        mirror if mirror is not None else network,
        attrs.evolve(_hello(spec, name, "coordinator"), generation=generation),
        edge_timings(spec, startup_timeout_s),
        replay_log=sent_log,
        records=False,
        faults=faults_send,
    )
    endpoint = ReturnEndpoint(name, from_ring_send, coordinator.event, mirror)
    spot_send, spot_recv = trio.open_memory_channel[SpotEvent](0)
    outcome_send, outcome_recv = trio.open_memory_channel[SpotOutcome](0)
    scheduler = Scheduler(
        SchedulerConfig(
            node=name,
            slots=_slots(spec, config, model_dir),
            return_address=str(me.listen),
            policy=spec.failover,
            formation=_formation(spec, config, model_dir),
        ),
        SchedulerChannels(
            to_router=control_send,
            ring_faults=faults_recv,
            own_copies=copies_recv if mirror is not None else None,
            spot_checks=spot_send,
            spot_outcomes=outcome_recv,
        ),
        ring_link=ring_link,
        return_up=endpoint.up,
        mesh_probe=_mesh_probe(spec, name, network),
    )
    checks = SpotChecker(hub, spec.audit, scheduler.roster, spot_recv, outcome_send)
    reads = StatusReads(
        coordinator,
        ring=scheduler.ring,
        standbys=scheduler.standbys,
        devices=DeviceProbe(name).read,
        audits=checks.audit_counts,
    )
    feed = StatusFeed(reads, swarm=spec.name, send_timeout_s=spec.limits.message_timeout_s)
    welcome = Welcome(node=name, role="coordinator", swarm=spec.name, generation=generation)
    # One text adapter (and one tokenizing thread) for the wire clients and the HTTP API.
    text = TextAdapter(tokenizer)
    listener = _Listener(welcome, spec.limits, coordinator, text, scheduler, feed, endpoint, store)
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        await nursery.start(feed.run)
        await nursery.start(scheduler.run)
        await nursery.start(checks.run)
        bound = await nursery.start(network.serve, str(me.listen), listener.handle)
        if scheduler.formation is not None:  # the joined nodes' ring, planned and activated
            formed = await scheduler.formation.form()
            coordinator.formed(len(formed.stages))
            successor = successor or scheduler.formation.entry
        await ring_link.connect(successor or spec.address_of(spec.stages[0].name))
        nursery.start_soon(ring_link.run)
        with trio.fail_after(startup_timeout_s):
            await endpoint.joined.wait()

        def repairs() -> int:  # a give-up ("failed") repaired nothing
            return sum(r.kind != "failed" for r in scheduler.statistics().recoveries)

        api = make_server(spec, coordinator, text, failovers=repairs, checkpoints=store)
        api_address = None if api is None else await serve_api(nursery, api, str(spec.api.listen))
        task_status.started(
            CoordinatorHandle(
                name, bound, coordinator, tokenizer, text, scheduler, api_address, checks
            )
        )


def _store(spec: SwarmSpec, adopted: Sequence[RequestCheckpoint]) -> CheckpointStore | None:
    """The coordinator's checkpoints: on disk with ``[failover] checkpoint_dir``, in memory
    for a standby to follow (or one that took over); None when neither."""
    directory = spec.failover.checkpoint_dir
    if directory is None and spec.coordinator.standby is None and not adopted:
        return None
    store = CheckpointStore(None if directory is None else Path(directory))
    store.adopt(adopted)
    return store


def _formation(
    spec: SwarmSpec, config: ModelConfig, model_dir: Path
) -> tuple[FormationSpec, ModelFacts] | None:
    """What the scheduler forms a ring with, for a spec with ``[formation]``: the model's
    layers priced in the swarm's ``weights`` format (joined nodes hold the spec's)."""
    if spec.formation is None:
        return None
    return spec.formation, model_facts(config, spec, model_dir)


def _mesh_probe(spec: SwarmSpec, name: str, network: Network) -> Prober | None:
    """How the scheduler probes a joined node's listen address (reachability detection)."""
    if spec.formation is None:
        return None
    hello = Hello(node=NodeName(name), role="coordinator", swarm=spec.name, link="probe")
    return partial(measure_rtt, network, hello=hello, probes=spec.formation.probes, timeout_s=10.0)


async def _serve_client(
    coordinator: Coordinator,
    text: TextAdapter,
    conn: Connection,
    *,
    limits: Limits,
    store: CheckpointStore | None = None,
) -> None:
    """Serve one client connection: each ``GenerateRequest`` runs as its own task; replies
    go through one writer so concurrent requests never interleave inside a frame. When the
    client goes away its requests are cancelled (their sessions end on the ring).

    Idle means no request running (``IdleDeadline``): a client that only sends heartbeats or
    other messages is cut ``limits.idle_timeout_s`` after its last request ended (or its Hello),
    and to the network it is idle meanwhile, so its host's cap can reclaim it for a newcomer.

    Errors: ``PeerTooSlow`` when the client runs no request for ``limits.idle_timeout_s`` or
    does not take a reply within ``limits.message_timeout_s``; a malformed frame's
    ``WireError`` (``serve_one`` ends the connection either way)."""
    out_send, out_recv = trio.open_memory_channel[Message](0)
    # Only requests keep the link (and its host's slot) alive; heartbeats do not.
    idle = IdleDeadline(limits.idle_timeout_s, conn)
    ignored = 0  # messages that were not requests

    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            try:
                async with out_recv:
                    async for msg in out_recv:
                        await send_within(conn, msg, limits.message_timeout_s, what="client")
            except PeerTooSlow:
                raise
            except TransportError:
                log.info("client %s went away", conn.peer)
                nursery.cancel_scope.cancel()

        async def serve(request: GenerateRequest, emit: trio.MemorySendChannel[Message]) -> None:
            try:
                async with emit:
                    await complete(coordinator, text, request, emit.send, store)
            finally:
                idle.end()

        nursery.start_soon(writer)
        async with out_send:
            with idle.scope:
                while True:
                    try:
                        msg = await conn.receive()
                    except ConnectionClosed:
                        log.info("client %s closed its connection", conn.peer)
                        break
                    if isinstance(msg, GenerateRequest):
                        idle.begin()
                        nursery.start_soon(serve, msg, out_send.clone())
                    else:  # no request: the idle deadline runs on (a heartbeat flood is idle)
                        level = logging.DEBUG if ignored else logging.WARNING  # once, not a flood
                        log.log(level, "client %s sent %s; ignored", conn.peer, type(msg).__name__)
                        ignored += 1
            if idle.fired:
                raise PeerTooSlow(
                    f"client {conn.peer} ran no request for {idle.idle_s:g} s "
                    "(limits.idle_timeout_s)"
                )


__all__ = [
    "DTYPES",
    "CoordinatorHandle",
    "StageHandle",
    "run_coordinator",
    "run_stage",
    "run_standby",
]
