"""Composition roots: wire the actors of one node (stage or coordinator) and start them.

This is the only module that connects actors to each other and to the network; actors get
channels, never sockets. A node reports ready (``task_status.started``) only when it can do
its job: a stage serves its upstream only after its own downstream link is up, so when the
coordinator's dial to stage 0 succeeds the whole ring is connected, end to end.

Supervision: every actor of a node lives in one nursery. The coordinator's process also runs
the scheduler (``shard.failover.scheduler``): every stage and standby keeps a control link to it,
and
a node that dies is replaced by a standby while the requests wait (docs/failover.md). The
stage and standby roots live in ``shard.nodes.stage``.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from shard.coordinator.checkpoint import CheckpointStore
from shard.coordinator.router import Coordinator
from shard.coordinator.service import complete
from shard.decode.draft import (
    AdaptiveProposer,
    Drafter,
    ModelProposer,
    NGramProposer,
    OracleProposer,
    Proposer,
)
from shard.failover.edge import DownstreamLink
from shard.failover.replay import ReplayLog
from shard.failover.scheduler import Scheduler, Slot
from shard.messages import (
    Fault,
    GenerateRequest,
    Hello,
    Message,
    NodeName,
    Welcome,
)
from shard.model.config import ModelConfig
from shard.model.device import resolve_device
from shard.model.llama import StageModel
from shard.model.loader import load_stage, load_truncated
from shard.model.tokenizer import Tokenizer
from shard.nodes.stage import DTYPES, StageHandle, run_stage, run_standby
from shard.observe.devices import DeviceProbe
from shard.observe.status import StatusFeed
from shard.spec.nodes import CoordinatorSpec
from shard.spec.swarm import SwarmSpec
from shard.stage import offload
from shard.transport import Connection, Network, TransportError
from shard.transport.links import HandshakeError, accept_peer, pump_in
from shard.trust.compose import signing_identity, signing_token
from shard.trust.receipts import RunSigner

log = logging.getLogger(__name__)


@attrs.frozen
class CoordinatorHandle:
    """What a started coordinator node reports; in-process callers use it to generate."""

    name: str
    address: str
    coordinator: Coordinator
    tokenizer: Tokenizer
    scheduler: Scheduler | None = None


def _hello(spec: SwarmSpec, name: str, role: str) -> Hello:
    return Hello(node=NodeName(name), role=role, swarm=spec.name)


def make_drafter(spec: SwarmSpec, model_dir: Path) -> Drafter | None:
    """The coordinator's draft proposers, per the spec's ``[speculation]`` (None: plain)."""
    plan = spec.speculation
    if plan.draft == "none":
        return None
    if plan.draft == "oracle":
        assert plan.oracle_file is not None
        references = json.loads(Path(plan.oracle_file).read_text())["references"]

        def oracle(prompt: Sequence[int]) -> Proposer:
            n = len(prompt)
            for ref in references:
                if ref[:n] == list(prompt):
                    return OracleProposer(ref)
            return OracleProposer([])  # no reference for this prompt: plain decoding

        return Drafter(oracle)
    model: StageModel | None = None
    if plan.uses_model:
        runtime = spec.runtime(spec.coordinator.name)  # the draft's device and dtype
        dtype = DTYPES[runtime.dtype or spec.dtype]
        device = resolve_device(runtime.device, spec.coordinator.name)
        if plan.draft_model is not None:
            draft_dir = Path(plan.draft_model)
            layers = ModelConfig.from_dir(draft_dir).n_layers
            model = load_stage(draft_dir, 0, layers, dtype=dtype, device=device)
        else:
            model = load_truncated(model_dir, plan.draft_layers, dtype=dtype, device=device)

    def factory(prompt: Sequence[int]) -> Proposer:
        proposers: list[Proposer] = []
        if plan.draft in ("ngram", "auto"):
            proposers.append(NGramProposer())
        if model is not None:
            proposers.append(ModelProposer(model, max_len=spec.limits.max_len))
        return proposers[0] if len(proposers) == 1 else AdaptiveProposer(proposers)

    return Drafter(factory)


async def run_coordinator(
    spec: SwarmSpec,
    *,
    network: Network,
    model_dir: Path,
    successor: str | None = None,
    startup_timeout_s: float = 120.0,
    task_status: trio.TaskStatus[CoordinatorHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the coordinator and its scheduler: serve the return endpoint, control links and
    clients, dial stage 0.

    Ready when stage 0 answered (so the whole ring is up) and the tail has dialled back.
    """
    me: CoordinatorSpec = spec.coordinator
    name = NodeName(me.name)
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_ids)))
    to_ring_send, to_ring_recv = trio.open_memory_channel[Message](0)
    from_ring_send, from_ring_recv = trio.open_memory_channel[Message](0)
    drafter = await offload.run_sync(make_drafter, spec, model_dir)
    failover = spec.failover
    checkpoints = None
    if failover.checkpoint_dir is not None:
        checkpoints = CheckpointStore(Path(failover.checkpoint_dir))
    coordinator = Coordinator(
        checkpoints=checkpoints,
        incarnation=secrets.randbits(20),
        sent_log=ReplayLog(max_bytes=failover.replay_max_bytes),
        node=name,
        eos_ids=eos,
        to_ring=to_ring_send,
        from_ring=from_ring_recv,
        limits=spec.limits,
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
        speculation=spec.speculation.policy,
    )
    ring_link = DownstreamLink(
        name,
        to_ring_recv,
        network,
        _hello(spec, name, "coordinator"),
        replay_log=coordinator.sent_log,  # recorded by the coordinator as it sends
        records=False,
        heartbeat_s=failover.heartbeat_s,
        send_timeout_s=failover.send_timeout_s,
        connect_timeout_s=startup_timeout_s,
        handshake_timeout_s=spec.limits.handshake_timeout_s,
    )
    blocks = spec.blocks(config.n_layers)
    scheduler = Scheduler(
        node=name,
        slots=[
            Slot(NodeName(s.name), first, last, NodeName(s.name), str(s.listen))
            for s, (first, last) in zip(spec.stages, blocks, strict=True)
        ],
        return_address=str(me.listen),
        ring_link=ring_link,
        hooks=coordinator,
        policy=failover,
        return_up=lambda: return_links > 0,
    )

    async def link_fault(fault: Fault) -> None:
        coordinator.event("fault", f"{fault.node}: {fault.kind}: {fault.detail}")
        await scheduler.link_fault(name)

    ring_link.on_fault = link_fault
    feed = StatusFeed(
        coordinator,
        swarm=spec.name,
        ring=scheduler.ring,
        standbys=scheduler.standbys,
        devices=DeviceProbe(name).read,
    )
    welcome = Welcome(node=name, role="coordinator", swarm=spec.name)
    tail_joined = trio.Event()
    return_links = 0

    async def handler(conn: Connection) -> None:
        try:
            hello = await accept_peer(conn, welcome, timeout_s=spec.limits.handshake_timeout_s)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        if hello.link == "control" and hello.role == "stage":
            await scheduler.serve(conn, hello)
            return
        if hello.role == "client":
            await _serve_client(coordinator, tokenizer, conn)
            return
        if (
            hello.role == "monitor"
        ):  # the status feed (shard.observe.status): read-only but for reset
            await feed.serve(conn)
            return
        tail = scheduler.tail()
        if hello.role != "stage" or hello.node != tail:
            # Only the ring's current tail may open the return link: anyone else's verdicts
            # would be taken for the ring's.
            log.warning("%s: refused %s (%s) on the return link", name, hello.node, hello.role)
            await conn.send(
                Fault(node=name, kind="handshake", detail=f"only {tail} may open the return link")
            )
            return
        nonlocal return_links
        tail_joined.set()
        coordinator.event("join", f"{hello.node} ({hello.role}) connected from {conn.peer}")
        return_links += 1
        try:
            await pump_in(name, conn, from_ring_send.clone())
        finally:
            return_links -= 1

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        await nursery.start(feed.run)
        await nursery.start(scheduler.run)
        bound = await nursery.start(network.serve, str(me.listen), handler)
        await ring_link.connect(successor or str(spec.stages[0].listen))
        nursery.start_soon(ring_link.run)
        with trio.fail_after(startup_timeout_s):
            await tail_joined.wait()
        task_status.started(CoordinatorHandle(name, bound, coordinator, tokenizer, scheduler))


async def _serve_client(coordinator: Coordinator, tokenizer: Tokenizer, conn: Connection) -> None:
    """Serve one client connection: each ``GenerateRequest`` runs as its own task; replies
    go through one writer so concurrent requests never interleave inside a frame. When the
    client goes away its requests are cancelled (their sessions end on the ring)."""
    out_send, out_recv = trio.open_memory_channel[Message](0)

    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            try:
                async with out_recv:
                    async for msg in out_recv:
                        await conn.send(msg)
            except TransportError:
                log.info("client %s went away", conn.peer)
                nursery.cancel_scope.cancel()

        async def serve(request: GenerateRequest, emit: trio.MemorySendChannel[Message]) -> None:
            async with emit:
                await complete(coordinator, tokenizer, request, emit.send)

        nursery.start_soon(writer)
        async with out_send:
            while True:
                try:
                    msg = await conn.receive()
                except TransportError:
                    log.info("client %s closed its connection", conn.peer)
                    break
                if isinstance(msg, GenerateRequest):
                    nursery.start_soon(serve, msg, out_send.clone())
                else:
                    log.warning("client %s sent %s; ignored", conn.peer, type(msg).__name__)


__all__ = [
    "DTYPES",
    "CoordinatorHandle",
    "StageHandle",
    "make_drafter",
    "run_coordinator",
    "run_stage",
    "run_standby",
]
