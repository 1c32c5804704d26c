"""Composition roots: wire the actors of one node (stage or coordinator) and start them.

This is the only module that connects actors to each other and to the network; actors get
channels, never sockets. A node reports ready (``task_status.started``) only when it can do
its job: a stage serves its upstream only after its own downstream link is up, so when the
coordinator's dial to stage 0 succeeds the whole ring is connected, end to end.

Supervision: every actor of a node lives in one nursery. A link that fails surfaces as a
``Fault`` at the coordinator (which fails the affected requests with a clear error) or, on a
stage, as ``StageLinkLost`` ending that node — the failure issue adds splicing in a standby.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import trio

from shard.config import CoordinatorSpec, StageSpec, SwarmSpec
from shard.coordinator import Coordinator, CoordinatorLimits
from shard.device import device_identity
from shard.draft import (
    AdaptiveProposer,
    Drafter,
    ModelProposer,
    NGramProposer,
    OracleProposer,
    Proposer,
)
from shard.fetch_stage import fetch_stage, make_seeder
from shard.links import HandshakeError, accept_peer, dial_peer, pump_in, pump_out
from shard.messages import (
    Fault,
    GenerateRequest,
    Hello,
    Message,
    NodeName,
    Welcome,
)
from shard.model.config import ModelConfig
from shard.model.llama import StageModel
from shard.model.loader import load_stage, load_truncated
from shard.model.tokenizer import Tokenizer
from shard.receipts import ReceiptSigner, RunSigner
from shard.service import complete
from shard.speculation import SpecConfig
from shard.stage import StageExecutor
from shard.status import StatusFeed
from shard.transport import Connection, Network, TransportError
from shard.trust import signing_identity

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StageLinkLost(Exception):
    """A stage lost its downstream link; without a standby the ring cannot go on."""


@attrs.frozen
class StageHandle:
    """What a started stage node reports: its name, block and bound address."""

    name: str
    first: int
    last: int
    address: str
    executor: StageExecutor


@attrs.frozen
class CoordinatorHandle:
    """What a started coordinator node reports; in-process callers use it to generate."""

    name: str
    address: str
    coordinator: Coordinator
    tokenizer: Tokenizer


def _stage_index(spec: SwarmSpec, name: str) -> int:
    for i, stage in enumerate(spec.stages):
        if stage.name == name:
            return i
    raise KeyError(name)


def _successor(spec: SwarmSpec, index: int) -> str:
    if index + 1 < len(spec.stages):
        return str(spec.stages[index + 1].listen)
    return str(spec.coordinator.listen)


async def run_stage(
    spec: SwarmSpec,
    name: str,
    *,
    network: Network,
    model_dir: Path,
    successor: str | None = None,
    startup_timeout_s: float = 120.0,
    task_status: trio.TaskStatus[StageHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run stage ``name`` of ``spec``: load its block, dial its successor, serve upstream.

    ``successor`` overrides the address dialled downstream (a WAN-emulating relay in front of
    the real successor). Errors: ``StageLinkLost`` when the downstream link fails.
    """
    node = spec.node(name)
    assert isinstance(node, StageSpec)
    index = _stage_index(spec, name)
    if spec.fetch is not None and spec.fetch.fetches(name):  # verified fetch of the block
        model_dir = (await fetch_stage(spec, name)).path
    config = ModelConfig.from_dir(model_dir)
    first, last = spec.blocks(config.n_layers)[index]
    model = await trio.to_thread.run_sync(
        lambda: load_stage(model_dir, first, last, dtype=DTYPES[spec.dtype])
    )
    inbox_send, inbox_recv = trio.open_memory_channel[Message](0)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](0)
    receipts = ReceiptSigner(
        signing_identity(spec, name),
        node=name,
        address=str(node.listen),
        first=first,
        last=last,
        device=device_identity(),
    )
    executor = StageExecutor(
        model,
        node=NodeName(name),
        inbox=inbox_recv,
        outbox=outbox_send,
        max_sessions=spec.limits.max_sessions,
        receipts=receipts,
    )
    hello = _hello(spec, name, "stage")
    downstream = await dial_peer(
        network, successor or _successor(spec, index), hello, timeout_s=startup_timeout_s
    )
    welcome = Welcome(node=NodeName(name), role="stage", swarm=spec.name)

    async def upstream(conn: Connection) -> None:
        try:
            await accept_peer(conn, welcome)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        await pump_in(NodeName(name), conn, inbox_send.clone())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.run)
        nursery.start_soon(_downstream, name, outbox_recv, downstream)
        if (seeder := make_seeder(spec, name, model_dir)) is not None:
            await nursery.start(seeder.run)  # a [[fetch.seeder]] named like this stage
        bound = await nursery.start(network.serve, str(node.listen), upstream)
        task_status.started(StageHandle(name, first, last, bound, executor))


async def _downstream(
    name: str, outbox: trio.MemoryReceiveChannel[Message], conn: Connection
) -> None:
    try:
        await pump_out(NodeName(name), outbox, conn)
    except TransportError as exc:
        raise StageLinkLost(f"{name}: downstream link to {conn.peer} lost: {exc}") from exc


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
        dtype = DTYPES[spec.dtype]
        if plan.draft_model is not None:
            draft_dir = Path(plan.draft_model)
            layers = ModelConfig.from_dir(draft_dir).n_layers
            model = load_stage(draft_dir, 0, layers, dtype=dtype)
        else:
            model = load_truncated(model_dir, plan.draft_layers, dtype=dtype)

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
    """Run the coordinator: serve the return endpoint and clients, dial stage 0.

    Ready when stage 0 answered (so the whole ring is up) and the tail has dialled back.
    """
    me: CoordinatorSpec = spec.coordinator
    name = NodeName(me.name)
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *tokenizer.eos_ids)))
    to_ring_send, to_ring_recv = trio.open_memory_channel[Message](0)
    from_ring_send, from_ring_recv = trio.open_memory_channel[Message](0)
    limits = CoordinatorLimits(
        max_len=spec.limits.max_len,
        prefill_chunk=spec.limits.prefill_chunk,
        max_sessions=spec.limits.max_sessions,
        verdict_timeout_s=spec.limits.verdict_timeout_s,
    )
    drafter = await trio.to_thread.run_sync(make_drafter, spec, model_dir)
    coordinator = Coordinator(
        node=name,
        eos_ids=eos,
        to_ring=to_ring_send,
        from_ring=from_ring_recv,
        limits=limits,
        drafter=drafter,
        signer=RunSigner(
            signing_identity(spec, name),
            coordinator=name,
            model=spec.model,
            n_layers=config.n_layers,
            n_stages=len(spec.stages),
        ),
        speculation=SpecConfig(
            k=spec.speculation.k,
            depth=spec.speculation.depth,
            k_max=spec.speculation.k_max,
            depth_max=spec.speculation.depth_max,
        ),
    )
    feed = StatusFeed(coordinator, swarm=spec.name, ring=[NodeName(n) for n in spec.ring()[:-1]])
    welcome = Welcome(node=name, role="coordinator", swarm=spec.name)
    tail_joined = trio.Event()

    async def handler(conn: Connection) -> None:
        try:
            hello = await accept_peer(conn, welcome)
        except (HandshakeError, trio.TooSlowError) as exc:
            log.warning("%s", exc)
            return
        if hello.role == "client":
            await _serve_client(coordinator, tokenizer, conn)
            return
        if hello.role == "monitor":  # the status feed (shard.status): read-only but for reset
            await feed.serve(conn)
            return
        tail = spec.stages[-1].name
        if hello.role != "stage" or hello.node != tail or tail_joined.is_set():
            # Only the tail, once, may open the return link: any other peer closing it
            # would otherwise be taken for the ring failing.
            log.warning("%s: refused %s (%s) on the return link", name, hello.node, hello.role)
            await conn.send(
                Fault(node=name, kind="handshake", detail=f"only {tail} may open the return link")
            )
            return
        tail_joined.set()
        coordinator.event("join", f"{hello.node} ({hello.role}) connected from {conn.peer}")
        lost = Fault(node=name, kind="link", detail=f"return link from {hello.node} closed")
        await pump_in(name, conn, from_ring_send.clone(), on_close=lost)

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        await nursery.start(feed.run)
        bound = await nursery.start(network.serve, str(me.listen), handler)
        first = successor or str(spec.stages[0].listen)
        conn = await dial_peer(
            network, first, _hello(spec, name, "coordinator"), timeout_s=startup_timeout_s
        )
        nursery.start_soon(pump_out, name, to_ring_recv, conn, from_ring_send.clone())
        with trio.fail_after(startup_timeout_s):
            await tail_joined.wait()
        task_status.started(CoordinatorHandle(name, bound, coordinator, tokenizer))


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
