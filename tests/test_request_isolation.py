"""One request's failure is that request's alone (``shard.coordinator.supervise``): against a
scripted ring whose link encodes every frame as a real edge does, a request the wire cannot
carry, a bug on a request's path and a wire client's out-of-bounds numbers each end their own
request with a typed error, while the link, the router and the next request carry on.

In virtual time (Trio's autojump clock); the scripted link raising would fail the test (its
exception leaves the nursery), as the real edge's did take the coordinator down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator, RingError
from shard.coordinator.events import CallerLeft, Committed, RequestFailed
from shard.coordinator.service import complete
from shard.coordinator.text import TextAdapter, TextRequest
from shard.messages import (
    GenerateDone,
    GenerateRequest,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    Verdict,
    Verify,
)
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits
from shard.testing import tiny_tokenizer
from shard.wire import encode


@attrs.define
class Link:
    """The ring as the coordinator's edge sees it: every frame is encoded (a ``WireError``
    here is the crash the issue saw), each final chunk answered with token 7."""

    frames: int = 0
    opened: list[OpenSession] = attrs.field(factory=list)

    async def run(
        self, to_ring: trio.MemoryReceiveChannel[Message], back: trio.MemorySendChannel[Message]
    ) -> None:
        async for msg in to_ring:
            encode(msg)
            self.frames += 1
            if isinstance(msg, OpenSession):
                self.opened.append(msg)
            if isinstance(msg, Prefill | Verify) and (not isinstance(msg, Prefill) or msg.final):
                verdict = Verdict(msg.session, msg.epoch, msg.seq, msg.start, (7,), accepted=0)
                await back.send(verdict)


@asynccontextmanager
async def ring(aides: CoordinatorAides | None = None) -> AsyncIterator[tuple[Coordinator, Link]]:
    to_send, to_recv = trio.open_memory_channel[Message](0)
    from_send, from_recv = trio.open_memory_channel[Message](0)
    config = CoordinatorConfig(NodeName("coord"), [0], Limits(max_len=64, prefill_chunk=4))
    coord = Coordinator(
        config, CoordinatorChannels(to_send, from_recv), aides or CoordinatorAides()
    )
    link = Link()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run, to_recv, from_send)
        await nursery.start(coord.run)
        yield coord, link
        nursery.cancel_scope.cancel()


async def honest(coord: Coordinator) -> tuple[int, ...]:
    done = await coord.generate([5, 6, 7], max_tokens=3)
    return done.token_ids


async def test_a_request_the_wire_cannot_carry_fails_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """top_k = 2**64 reaches generate (no schema in the way): it ends with RequestFailed
    before its OpenSession enters the link; the link never sees it, the next request runs."""
    async with ring() as (coord, link):
        assert await honest(coord) == (7, 7, 7)
        with pytest.raises(RequestFailed, match="top_k"):
            await coord.generate([5, 6, 7], max_tokens=3, sampling=Sampling(top_k=1 << 64))
        assert [o.sampling.top_k for o in link.opened] == [0]
        assert await honest(coord) == (7, 7, 7)
        assert coord.sessions() == 0


class BrokenStore(CheckpointStore):
    """A checkpoint store that fails from its ``fails``-th save on (1: the request's start, 2:
    its first token): a bug on the request's own path."""

    def __init__(self, directory: Path, fails: int) -> None:
        super().__init__(directory)
        self.saves, self.fails = 0, fails

    def save(self, checkpoint: RequestCheckpoint) -> None:
        self.saves += 1
        if self.saves >= self.fails:
            raise OSError("disk full")
        super().save(checkpoint)


@pytest.mark.parametrize(("fails", "committed"), [(1, ()), (2, (7,))])
async def test_a_bug_on_a_request_path_ends_that_request_typed(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    fails: int,
    committed: tuple[int, ...],
) -> None:
    """An exception inside the request (its checkpoint's write, as it starts or at its first
    token) is that request's RequestFailed, with the tokens committed by then; a request
    without a checkpoint then runs."""
    store = BrokenStore(tmp_path, fails)
    async with ring(CoordinatorAides(checkpoints=store)) as (coord, _):
        with pytest.raises(RequestFailed, match="disk full") as failed:
            await coord.generate([5, 6, 7], max_tokens=3, request_id="r1")
        assert failed.value.committed == committed
        assert isinstance(failed.value.__cause__, OSError)
        assert await honest(coord) == (7, 7, 7)


async def test_the_callers_own_errors_reach_it_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the caller's own code raises while it reads a request's text is the caller's: it
    comes back as it was (not as RequestFailed, not inside a group), and the request's
    session ends. A caller that closes its token channel mid-request ends that request with
    CallerLeft. The ring serves the next request either way."""
    text = TextAdapter(tokenizer())
    async with ring() as (coord, link):

        async def read_and_fail() -> None:
            async with text.stream(coord, TextRequest((5, 6, 7), 3)) as stream:
                async for _piece in stream:
                    raise KeyError("the caller's own")

        with pytest.raises(KeyError, match="the caller's own"):
            await read_and_fail()
        assert coord.sessions() == 0
        assert await honest(coord) == (7, 7, 7)
        send, receive = trio.open_memory_channel[Committed](0)
        receive.close()
        with pytest.raises(CallerLeft):
            await coord.generate([5, 6, 7], max_tokens=3, tokens=send)
        assert coord.sessions() == 0 and len(link.opened) == 3
        assert await honest(coord) == (7, 7, 7)


def tokenizer() -> Tokenizer:
    return Tokenizer(
        tiny_tokenizer(), eos_ids=(), bos_id=None, chat_template=None, special_tokens={}
    )


@pytest.mark.parametrize(
    "request_",
    [
        GenerateRequest(1, "hi", 3, Sampling(top_k=(1 << 63) - 1)),
        GenerateRequest(1, "hi", 3, Sampling(temperature=float("nan"))),
        GenerateRequest(1, "hi", 3, Sampling(temperature=1e309)),
        GenerateRequest(1, "hi", 3, Sampling(top_p=float("inf"))),
        GenerateRequest(1, "hi", 3, Sampling(seed=1 << 64)),
        GenerateRequest(1, "hi", 1 << 40),
        GenerateRequest(1, "hi", 3, k=1 << 62),
        GenerateRequest(1, "hi", 3, depth=-5),
    ],
)
async def test_a_wire_clients_numbers_are_bounded_where_they_enter(
    autojump_clock: trio.testing.MockClock, request_: GenerateRequest
) -> None:
    """Each number past the table of bounds is a GenerateDone with finish_reason "error"
    naming the field, before anything is tokenized or sent to the ring."""
    sent: list[Message] = []

    async def emit(msg: Message) -> None:
        sent.append(msg)

    async with ring() as (coord, link):
        done = await complete(coord, TextAdapter(tokenizer()), request_, emit)
        assert isinstance(done, GenerateDone) and sent == [done]
        assert done.finish_reason == "error" and "must be" in done.error
        assert link.frames == 0
        assert await honest(coord) == (7, 7, 7)


async def test_a_dead_edge_fails_its_requests_as_the_ring(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The ring link's edge has ended (its end of the channel is closed): a request fails
    with RingError (a 503 at the API), not as a bug (RequestFailed, a 500)."""
    to_send, to_recv = trio.open_memory_channel[Message](0)
    _, from_recv = trio.open_memory_channel[Message](0)
    coord = Coordinator(
        CoordinatorConfig(node=NodeName("coord"), eos_ids=[0]),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )
    to_recv.close()
    async with trio.open_nursery() as nursery:
        await nursery.start(coord.run)
        with pytest.raises(RingError, match="edge ended") as failed:
            await coord.generate([5, 6, 7], max_tokens=3)
        assert not isinstance(failed.value, RequestFailed)
        nursery.cancel_scope.cancel()
