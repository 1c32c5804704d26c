"""A live ring under hostile input: thousands of random and mutated frames thrown at its stage
endpoints over real WebSockets while an honest request runs through the same stages.

The stages and the coordinator are ``shard.nodes.coordinator``'s composition roots (what ``shard
up`` runs)
in this process, on ``WebSocketNetwork`` and free loopback ports. A frame the wire cannot decode
must reset exactly its connection (close 1008); a frame that decodes but makes no sense for a
stage (an unknown session, a message a stage never gets) must be a typed ``Fault`` or ignored,
never a crash, and the connection stays open.

Charter: 127.0.0.1 only; every test under ``trio.fail_after``; the fuzz seed is printed (set
``SHARD_FUZZ_SEED`` to replay one).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio
import trio_websocket

from fuzzing import HIDDEN, Frames, decoded, harmless
from procs import LOOPBACK, free_ports
from shard.compute.tensors import to_wire
from shard.decode.reference import generate_reference
from shard.messages import (
    ChunkSeq,
    DraftQ,
    EndSession,
    Epoch,
    Fault,
    GenerateRequest,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Tensor,
    Verdict,
    Verify,
    Welcome,
)
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.nodes.coordinator import CoordinatorHandle, StageHandle, run_coordinator, run_stage
from shard.spec.swarm import SwarmSpec
from shard.transport import Connection, WebSocketNetwork
from shard.transport.links import accept_peer, dial_peer
from shard.transport.websocket import max_message_size
from shard.wire import WireLimits, decode, encode

SWARM = "fuzz"
MAX_LEN = 256
PROMPT = (5, 17, 99, 3, 200, 31, 7)
MAX_TOKENS = 12

#: Frames that must reset their connection, and frames that must not (they decode).
RESET_FRAMES = 4_000
KEPT_FRAMES = 6_000
WORKERS = 16
FUZZ_DEADLINE_S = 150


def fuzz_seed() -> int:
    seed = int(os.environ.get("SHARD_FUZZ_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"fuzz seed: {seed} (replay with SHARD_FUZZ_SEED={seed})")
    return seed


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=3, n_layers=4)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The honest requests' forward passes share a small machine with the event loop that
    serves thousands of connections; torch's spinning intra-op threads would starve it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ring_spec(model_dir: Path) -> SwarmSpec:
    """Coordinator + two stages ([0, 2), [2, 4)) on free loopback ports."""
    coord, s0, s1 = free_ports(3)
    return SwarmSpec.from_dict(
        {
            "swarm": {"name": SWARM, "model": str(model_dir), "insecure": True},
            "limits": {"max_len": MAX_LEN, "max_sessions": 16, "connect_timeout_s": 5.0},
            # The storm can starve a stage's heartbeats on a busy machine; this test is about
            # hostile frames, not about how soon a silent stage is declared dead.
            "failover": {"heartbeat_s": 0.5, "dead_after_s": 30.0},
            "coordinator": {"name": "coord", "listen": f"{LOOPBACK}:{coord}"},
            "stage": [
                {"name": "s0", "listen": f"{LOOPBACK}:{s0}", "layers": [0, 2]},
                {"name": "s1", "listen": f"{LOOPBACK}:{s1}", "layers": [2, 4]},
            ],
        },
        source="fuzz.toml",
    )


def reference(model_dir: Path) -> tuple[int, ...]:
    """The whole model in this process, with the coordinator's end-of-sequence ids."""
    config = ModelConfig.from_dir(model_dir)
    eos = (*config.eos_token_ids, *Tokenizer.from_dir(model_dir).eos_ids)
    model = load_stage(model_dir, 0, config.n_layers)
    result = generate_reference(model, PROMPT, max_tokens=MAX_TOKENS, eos_ids=eos, max_len=MAX_LEN)
    return result.token_ids


@attrs.frozen
class Ring:
    spec: SwarmSpec
    stages: dict[str, StageHandle]
    coordinator: CoordinatorHandle


@asynccontextmanager
async def live_ring(spec: SwarmSpec, model_dir: Path) -> AsyncIterator[Ring]:
    """Every node of ``spec`` in this process over WebSockets; a node that crashes fails the
    test (its exception leaves this nursery)."""
    async with WebSocketNetwork(connect_timeout_s=5.0) as network, trio.open_nursery() as nursery:
        handles: dict[str, Any] = {}

        async def start(name: str, run: Any) -> None:
            handles[name] = await nursery.start(run)

        async with trio.open_nursery() as starting:
            for stage in spec.stages:
                run = partial(run_stage, spec, stage.name, network=network, model_dir=model_dir)
                starting.start_soon(start, stage.name, run)
            run = partial(run_coordinator, spec, network=network, model_dir=model_dir)
            starting.start_soon(start, "coord", run)
        coordinator = handles.pop("coord")
        yield Ring(spec, handles, coordinator)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def raw_client(address: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A bare WebSocket (no wire codec) whose socket is closed on exit, whatever happened."""
    host, _, port = address.rpartition(":")
    async with (
        await trio.open_tcp_stream(host, int(port)) as stream,
        trio.open_nursery() as nursery,
    ):
        yield await trio_websocket.wrap_client_stream(
            nursery, stream, address, "/", max_message_size=2 * max_message_size(WireLimits())
        )
        nursery.cancel_scope.cancel()


# --- the fuzz test ---------------------------------------------------------------------------


@attrs.define
class Tally:
    reset: int = 0  # malformed frames, each answered by its connection's close
    kept: int = 0  # frames that decode (semantically bad): the connection stays up
    refused: int = 0  # valid frames that are not an acceptable Hello, sent first
    computes: dict[str, int] = attrs.field(factory=dict)  # Prefill/Verify kept, per stage
    connections: int = 0

    @property
    def frames(self) -> int:
        return self.reset + self.kept + self.refused


async def expect_reset(ws: trio_websocket.WebSocketConnection, frame: bytes | str) -> None:
    """Send one malformed frame; the stage must close this connection with 1008."""
    await ws.send_message(frame)
    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
        await ws.get_message()
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1008, closed.value.reason


async def handshake(ws: trio_websocket.WebSocketConnection, hello: Hello) -> Message:
    await ws.send_message(encode(hello))
    reply = await ws.get_message()
    assert isinstance(reply, bytes)
    return decode(reply)


def next_malformed(frames: Frames) -> bytes:
    while True:
        frame = frames.any()
        if decoded(frame) is None:
            return frame


def next_kept(frames: Frames) -> tuple[bytes, Message]:
    while True:
        frame = frames.mutated() if frames.rng.random() < 0.5 else frames.valid()
        msg = decoded(frame)
        if msg is not None and harmless(msg):
            return frame, msg


async def fuzz_connection(
    address: str, stage: str, frames: Frames, tally: Tally, want_kept: bool
) -> None:
    """One connection: a malformed first frame; or Hello, a few frames that decode, then a
    malformed one; or a first frame that is valid but not an acceptable Hello."""
    r = frames.rng
    tally.connections += 1
    async with raw_client(address) as ws:
        kind = r.random()
        if kind < 0.05:
            first = r.choice(
                [
                    encode(Hello(NodeName("evil"), "stage", "another-swarm")),
                    encode(Hello(NodeName("evil"), "stage", SWARM, protocol=99)),
                    frames.valid(),
                ]
            )
            msg = decoded(first)
            if isinstance(msg, Hello) and msg.swarm == SWARM and msg.protocol == 1:
                first = encode(Prefill(frames.session(), Epoch(0), ChunkSeq(0), 0, True, (1,)))
            await ws.send_message(first)
            reply = await ws.get_message()
            assert isinstance(reply, bytes)
            refusal = decode(reply)
            assert isinstance(refusal, Fault), refusal
            assert refusal.kind == "handshake"
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
            tally.refused += 1
            return
        if kind < 0.5 or not want_kept:
            await expect_reset(ws, next_malformed(frames))
            tally.reset += 1
            return
        welcome = await handshake(ws, Hello(NodeName("fuzzer"), "stage", SWARM))
        assert isinstance(welcome, Welcome), welcome
        for _ in range(r.randint(1, 10)):
            frame, msg = next_kept(frames)
            await ws.send_message(frame)
            tally.kept += 1
            if isinstance(msg, Prefill | Verify):
                tally.computes[stage] = tally.computes.get(stage, 0) + 1
        # A text message is malformed too; so is everything next_malformed returns.
        await expect_reset(ws, "not a frame" if r.random() < 0.01 else next_malformed(frames))
        tally.reset += 1


@pytest.mark.usefixtures("one_torch_thread")
async def test_fuzzed_frames_reset_connections_and_the_ring_keeps_serving(
    model_dir: Path,
) -> None:
    """10k+ hostile frames on both stages: each malformed one resets its connection, none
    crashes a node, and honest requests through the same ring still match the reference."""
    seed = fuzz_seed()
    want = reference(model_dir)
    spec = ring_spec(model_dir)
    tally = Tally()
    honest: list[tuple[int, ...]] = []
    with trio.fail_after(FUZZ_DEADLINE_S):
        async with live_ring(spec, model_dir) as ring:
            coordinator = ring.coordinator.coordinator
            fuzzing_done = trio.Event()

            async def honest_requests() -> None:
                while not fuzzing_done.is_set() or not honest:
                    done = await coordinator.generate(PROMPT, max_tokens=MAX_TOKENS)
                    honest.append(done.token_ids)

            async def worker(index: int) -> None:
                frames = Frames(random.Random(f"{seed}-{index}"))
                stage = ring.spec.stages[index % 2]
                address = ring.stages[stage.name].address
                while tally.reset < RESET_FRAMES or tally.kept < KEPT_FRAMES:
                    await fuzz_connection(
                        address, stage.name, frames, tally, want_kept=tally.kept < KEPT_FRAMES
                    )

            began = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(honest_requests)
                async with trio.open_nursery() as fuzzers:
                    for index in range(WORKERS):
                        fuzzers.start_soon(worker, index)
                fuzzing_done.set()
            elapsed = trio.current_time() - began
            # One more request after the storm: the ring still serves, and (each stage handles
            # its inbox in order) every fuzzed frame has been dealt with once it returns.
            after = await coordinator.generate(PROMPT, max_tokens=MAX_TOKENS)
            stats = {name: h.executor.statistics() for name, h in ring.stages.items()}
    print(
        f"{tally.frames} frames on {tally.connections} connections in {elapsed:.1f} s "
        f"({tally.frames / elapsed:.0f} frames/s): {tally.reset} reset, {tally.kept} kept, "
        f"{tally.refused} refused handshakes; {len(honest)} honest requests meanwhile"
    )
    assert tally.frames >= 10_000
    assert tally.reset >= RESET_FRAMES
    assert tally.refused > 0
    assert honest
    assert all(out == want for out in honest)
    assert after.token_ids == want
    for name, stat in stats.items():
        # Every kept Prefill/Verify named a session the stage never opened: one Fault each,
        # unless skipped as stale (an older epoch of a session already seen), if the stage
        # skips stale chunks.
        skipped = getattr(stat, "stale_skipped", 0)
        assert stat.faults + skipped == tally.computes.get(name, 0), name


# --- valid but hostile messages ---------------------------------------------------------------


@attrs.define
class Harness:
    """A ring whose coordinator is the test: it drives stage 0 and reads what the tail
    returns, so every answer to a hostile message is seen."""

    to_ring: Connection
    returned: trio.MemoryReceiveChannel[Message]
    marker: int = 500_000

    async def send(self, msg: Message) -> None:
        await self.to_ring.send(msg)

    async def next(self) -> Message:
        """The next answer from the tail (an idle link's heartbeats are not answers)."""
        with trio.fail_after(10):
            while isinstance(msg := await self.returned.receive(), Heartbeat):
                pass
            return msg

    async def quiet(self) -> None:
        """Assert the ring returned nothing for what was sent before: a marker chunk for an
        unknown session goes through the same FIFO and must be the next thing back."""
        self.marker += 1
        sid = SessionId(self.marker)
        await self.send(Prefill(sid, Epoch(0), ChunkSeq(0), 0, True, ids=(1,)))
        back = await self.next()
        assert isinstance(back, Fault), back
        assert (back.session, back.node, back.kind) == (sid, "s0", "gap"), back


@asynccontextmanager
async def harness_ring(spec: SwarmSpec, model_dir: Path) -> AsyncIterator[Harness]:
    """Stages s0, s1 for real; the test plays the coordinator (dials s0, serves the return)."""
    returned_send, returned_recv = trio.open_memory_channel[Message](0)
    welcome = Welcome(node=NodeName("coord"), role="coordinator", swarm=SWARM)

    async def return_link(conn: Connection) -> None:
        await accept_peer(conn, welcome)
        async with returned_send.clone() as sink:
            while True:
                await sink.send(await conn.receive())

    async with WebSocketNetwork(connect_timeout_s=5.0) as network, trio.open_nursery() as nursery:
        await nursery.start(network.serve, str(spec.coordinator.listen), return_link)
        for stage in spec.stages:
            nursery.start_soon(
                partial(
                    run_stage,
                    spec,
                    stage.name,
                    network=network,
                    model_dir=model_dir,
                    supervised=False,
                )
            )
        hello = Hello(NodeName("coord"), "coordinator", SWARM)
        to_ring = await dial_peer(network, str(spec.stages[0].listen), hello, timeout_s=30)
        yield Harness(to_ring, returned_recv)
        nursery.cancel_scope.cancel()


def tensor(dtype: torch.dtype, *shape: int) -> Tensor:
    return to_wire(torch.zeros(shape, dtype=dtype))


async def test_valid_but_hostile_messages_are_faults_or_ignored(model_dir: Path) -> None:
    """Messages that decode but make no sense at a stage get a typed Fault back (or are
    ignored), and the stages then still compute an honest prefill correctly."""
    spec = ring_spec(model_dir)
    want = reference(model_dir)
    sid = SessionId(77)
    e, q = Epoch(0), ChunkSeq(0)
    with trio.fail_after(60):
        async with harness_ring(spec, model_dir) as ring:
            # Messages a stage never gets from upstream are ignored.
            ignored: list[Message] = [
                Verdict(sid, e, q, 0, target_ids=(1,), accepted=0),
                Hello(NodeName("x"), "stage", SWARM),
                GenerateRequest(1, "hi", 4),
                Heartbeat(NodeName("x"), 0.0),
            ]
            for msg in ignored:
                await ring.send(msg)
                await ring.quiet()
            # A fault without a session is dropped, not relayed: no peer upstream may declare
            # the whole ring down (the coordinator learns of dead links from its own links).
            await ring.send(Fault(NodeName("evil"), "link", "made up"))
            await ring.quiet()
            # Sessions longer than the model allows are refused by stage 0.
            await ring.send(OpenSession(sid, max_len=10**9))
            refused = await ring.next()
            assert isinstance(refused, Fault), refused
            assert (refused.session, refused.node) == (sid, "s0")
            # 16 plain-mode sessions asking for the model's whole context, past the spec's
            # limits.max_len: each refused by stage 0 (none holds KV; tests/test_executor.py).
            context = ModelConfig.from_dir(model_dir).max_position_embeddings
            assert context > MAX_LEN
            for i in range(16):
                big = SessionId(1000 + i)
                await ring.send(OpenSession(big, max_len=context))
                refused = await ring.next()
                assert isinstance(refused, Fault), refused
                assert (refused.session, refused.node, refused.kind) == (big, "s0", "request")
                assert "limits.max_len" in refused.detail
            await ring.send(OpenSession(sid, max_len=64))
            await ring.quiet()
            hostile: list[tuple[Message, str]] = [
                # Hidden states where stage 0 needs token ids.
                (Prefill(sid, e, q, 0, True, hidden=tensor(torch.float32, 1, 1, HIDDEN)), "s0"),
                # Positions far past the session's KV length.
                (Prefill(sid, e, q, 2**62, True, ids=(1,)), "s0"),
                (Verify(sid, e, q, 2**63 - 1, ids=(1,)), "s0"),
                # A token id outside the vocabulary.
                (Prefill(sid, e, q, 0, True, ids=(10**9,)), "s0"),
                # More drafted tokens than positions in the chunk.
                (Verify(sid, e, q, 0, ids=(1,), draft=(1, 2, 3)), "s0"),
            ]
            for msg, node in hostile:
                await ring.send(msg)
                fault = await ring.next()
                assert isinstance(fault, Fault), (msg, fault)
                assert (fault.session, fault.node, fault.kind) == (sid, node, "chunk"), fault
            # The stages still compute: an honest prefill gives the reference's first token.
            await ring.send(Prefill(sid, e, ChunkSeq(1), 0, True, ids=PROMPT))
            verdict = await ring.next()
            assert isinstance(verdict, Verdict), verdict
            assert verdict.target_ids == want[:1]
            await ring.send(EndSession(sid))
            await ring.quiet()


async def test_hostile_hidden_states_at_the_tail_are_faults(model_dir: Path) -> None:
    """Hidden states of the wrong kind or shape, or too short for the draft, sent straight
    to the tail are Faults."""
    spec = ring_spec(model_dir)
    sid = SessionId(78)
    e, q = Epoch(0), ChunkSeq(0)
    with trio.fail_after(60):
        async with harness_ring(spec, model_dir) as ring:
            await ring.send(OpenSession(sid, max_len=64))
            await ring.quiet()
            async with WebSocketNetwork() as network:
                hello = Hello(NodeName("evil"), "stage", SWARM)
                tail = await dial_peer(network, str(spec.stages[1].listen), hello, timeout_s=10)
                hostile: list[Message] = [
                    Prefill(sid, e, q, 0, True, hidden=hidden)
                    for hidden in (
                        tensor(torch.int64, 1, 1, HIDDEN),  # integers, not activations
                        tensor(torch.float32, 1, 0, HIDDEN),  # no positions at all
                        tensor(torch.float32, 2, 1, HIDDEN),  # a batch of two
                        tensor(torch.float32, 1, 1, HIDDEN - 1),  # the wrong width
                        tensor(torch.float32, 1, HIDDEN),  # two dimensions
                    )
                ]
                # Two drafted tokens but hidden states for one position: nothing to verify.
                one = tensor(torch.float32, 1, 1, HIDDEN)
                hostile.append(Verify(sid, e, q, 0, hidden=one, draft=(1, 2)))
                # Draft distributions (a sampled draft's q) that no draft could have drawn from.
                two = tensor(torch.float32, 1, 2, HIDDEN)
                for bad in (
                    (DraftQ((1,), (1.0,)), DraftQ((1,), (1.0,))),  # two for one drafted token
                    (DraftQ((1, 2), (0.9, 0.9)),),  # sums to 1.8
                    (DraftQ((2,), (1.0,)),),  # the drafted token 1 is impossible under it
                    (DraftQ((10**9,), (1.0,)),),  # outside the vocabulary
                    (DraftQ((1, 2), (math.inf, 0.0)),),  # not finite
                ):
                    hostile.append(Verify(sid, e, q, 0, hidden=two, draft=(1,), q=bad))
                for msg in hostile:
                    await tail.send(msg)
                    fault = await ring.next()
                    assert isinstance(fault, Fault), (msg, fault)
                    assert (fault.session, fault.node, fault.kind) == (sid, "s1", "chunk")
                await tail.aclose()
            await ring.send(EndSession(sid))
            await ring.quiet()
