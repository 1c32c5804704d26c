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

import logging
from pathlib import Path

import attrs
import torch
import trio

from shard.config import CoordinatorSpec, StageSpec, SwarmSpec
from shard.coordinator import Coordinator, CoordinatorLimits
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
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.service import complete
from shard.stage import StageExecutor
from shard.transport import Connection, Network, TransportError

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
    config = ModelConfig.from_dir(model_dir)
    first, last = spec.blocks(config.n_layers)[index]
    model = await trio.to_thread.run_sync(
        lambda: load_stage(model_dir, first, last, dtype=DTYPES[spec.dtype])
    )
    inbox_send, inbox_recv = trio.open_memory_channel[Message](0)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](0)
    executor = StageExecutor(
        model,
        node=NodeName(name),
        inbox=inbox_recv,
        outbox=outbox_send,
        max_sessions=spec.limits.max_sessions,
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
    )
    coordinator = Coordinator(
        node=name, eos_ids=eos, to_ring=to_ring_send, from_ring=from_ring_recv, limits=limits
    )
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
        tail_joined.set()
        coordinator.event("join", f"{hello.node} ({hello.role}) connected from {conn.peer}")
        lost = Fault(node=hello.node, kind="link", detail=f"return link from {hello.node} closed")
        await pump_in(name, conn, from_ring_send.clone(), on_close=lost)

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
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
