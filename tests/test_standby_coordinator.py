"""A standby coordinator follows the primary's checkpoints and takes over when it dies; the
stages fence the old generation off; a wire client reconnects and gets the rest of its output.

In process, on a memory network, in virtual time (``MockClock``): the primary's cancel scope
is its death (its connections close, as a killed process's sockets do).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from shard.compute.offload import inline_compute
from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.client import stream
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator
from shard.errors import HandshakeError
from shard.failover.events import RingControl
from shard.failover.fence import Fence
from shard.messages import (
    GenerateDone,
    GenerateRequest,
    Hello,
    Message,
    NodeName,
    OpenSession,
)
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.nodes.standby_coordinator import run_standby_coordinator
from shard.spec.limits import Limits
from shard.spec.swarm import SwarmSpec
from shard.testing import make_tiny_checkpoint
from shard.transport import ConnectionClosed, MemoryNetwork
from shard.transport.links import dial_peer

PROMPT = "the river runs to the sea"
MAX_TOKENS = 24
PRIMARY, STANDBY = "127.0.0.1:9000", "127.0.0.1:9100"


def standby_spec(model_dir: Path) -> SwarmSpec:
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 96, "prefill_chunk": 4, "max_sessions": 8, "retry_after_s": 3.0},
        "coordinator": {"name": "coord", "listen": PRIMARY, "standby": STANDBY},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": [2 * i, 2 * i + 2]}
            for i in range(3)
        ],
        "failover": {"dead_after_s": 1.0},
    }
    return SwarmSpec.from_dict(data, source="standby-test.toml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=11, n_layers=6)


def test_fence_admits_the_highest_generation_and_cancels_older_links() -> None:
    """A fence admits equal or higher generations, refuses lower ones, and cancels what a
    lower generation holds when a higher one is admitted."""
    fence = Fence()
    assert fence.admit(1)
    old = fence.hold(1)
    assert fence.admit(2)
    assert old.cancel_called
    assert not fence.admit(1)
    assert fence.admit(2)


def test_standby_takes_over_and_the_wire_client_gets_the_rest(model_dir: Path) -> None:
    """The primary dies mid-request: the standby takes over the warm ring (generation 2), the
    client reconnects with its key and token count, and its whole output — ids and streamed
    text — equals the uninterrupted run's; a stale generation-1 coordinator is then refused
    by stage 0's ring listener and by a stage's control-link fence."""
    spec = standby_spec(model_dir)
    runs: dict[str, tuple[GenerateDone, str]] = {}
    taken_send, taken = trio.open_memory_channel[CoordinatorHandle](1)

    async def main() -> None:
        network = MemoryNetwork()
        scopes: dict[str, trio.CancelScope] = {}
        with inline_compute(), trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(run_swarm, spec, model_dir=model_dir, network=network, scopes=scopes)
                )
                await nursery.start(
                    partial(
                        run_standby_coordinator,
                        spec,
                        network=network,
                        model_dir=model_dir,
                        takeovers=taken_send,
                    )
                )

                async def ask(label: str, kill_after: int | None) -> None:
                    texts: list[str] = []
                    seen, done = 0, None
                    req = GenerateRequest(request=1, prompt=PROMPT, max_tokens=MAX_TOKENS)
                    async with stream(network, (PRIMARY, STANDBY), req, swarm="test") as pieces:
                        async for piece in pieces:
                            if isinstance(piece, GenerateDone):
                                done = piece
                                continue
                            texts.append(piece.text)
                            seen += len(piece.token_ids)
                            if kill_after is not None and seen >= kill_after:
                                scopes["coord"].cancel()  # the primary dies
                    assert done is not None, "the stream ended without its completion"
                    runs[label] = (done, "".join(texts))

                await ask("whole", None)
                await ask("killed", 6)
                # a stale primary (generation 1) cannot drive the ring any more
                stale = Hello(node=NodeName("coord"), role="coordinator", swarm="test")
                conn = await dial_peer(network, "127.0.0.1:9001", stale, timeout_s=5)
                with pytest.raises(ConnectionClosed):
                    await conn.receive()
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert taken.statistics().current_buffer_used == 1, f"the standby never took over: {runs}"
    whole, whole_text = runs["whole"]
    killed, killed_text = runs["killed"]
    assert whole.finish_reason != "error", whole.error
    assert len(whole.token_ids) > 6, "the run ended before the kill point"
    assert killed.finish_reason == whole.finish_reason, killed.error
    assert killed.token_ids == whole.token_ids
    assert killed_text == whole_text
    assert killed.text == whole.text


def test_a_control_link_to_a_lower_generation_is_refused(model_dir: Path) -> None:
    """A stage's control client that has followed generation 2 refuses a coordinator whose
    Welcome says generation 1 (HandshakeError names the fencing)."""
    from answered import AnsweredClient
    from shard.messages import Register, Welcome
    from shard.transport.links import accept_peer

    fence = Fence()
    fence.admit(2)
    errors: list[BaseException] = []

    async def obey(order: object) -> None:
        return None

    async def main() -> None:
        network = MemoryNetwork()

        async def old_coordinator(conn: Any) -> None:
            await accept_peer(conn, Welcome(NodeName("coord"), "coordinator", "test"))
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            await nursery.start(network.serve, PRIMARY, old_coordinator)
            client = AnsweredClient(
                NodeName("s0"),
                network,
                PRIMARY,
                lambda: Register(NodeName("s0"), "stage", "127.0.0.1:9001"),
                "test",
                obey=obey,
                connect_timeout_s=1.0,
                fence=fence,
            )
            try:
                await client.run()
            except HandshakeError as exc:
                errors.append(exc)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (error,) = errors
    assert "fenced" in str(error)


def test_a_resumed_request_keeps_ignore_eos() -> None:
    """A checkpoint whose last token is EOS has stopped, unless its request ignores EOS:
    then the resumed request goes on through the ring, as its first run would have."""
    opened: list[int] = []

    async def ring(frames: trio.MemoryReceiveChannel[Message]) -> None:
        async for msg in frames:
            if isinstance(msg, OpenSession):
                opened.append(msg.session)

    async def main() -> None:
        to_ring, frames = trio.open_memory_channel[Message](0)
        _, from_ring = trio.open_memory_channel[Message](0)
        _, control = trio.open_memory_channel[RingControl](0)
        coordinator = Coordinator(
            CoordinatorConfig(
                node=NodeName("coord"), eos_ids=(2,), limits=Limits(max_len=64, max_sessions=4)
            ),
            CoordinatorChannels(to_ring=to_ring, from_ring=from_ring, control=control),
            CoordinatorAides(checkpoints=CheckpointStore(None)),
        )
        stopped = RequestCheckpoint("r1", (1, 7), (5, 2), 8)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ring, frames)
            await nursery.start(coordinator.run)
            done = await coordinator.resume_request(stopped)
            assert (done.finish_reason, done.token_ids, opened) == ("stop", (5, 2), [])
            going = attrs.evolve(stopped, request="r2", ignore_eos=True)
            nursery.start_soon(partial(coordinator.resume_request, going))
            await trio.testing.wait_all_tasks_blocked()
            assert len(opened) == 1, "the EOS-ignoring request was not resumed on the ring"
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
