"""The wire client's channel (``shard.coordinator.client.stream``): a request's pieces — each
commit's ``TokensOut``, then its ``GenerateDone`` — against a scripted coordinator on the
in-process network; a reader that leaves early closes the connection, and a link that breaks
raises its own error, not a group."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from shard.coordinator.client import ClientError, request, stream
from shard.messages import (
    GenerateDone,
    GenerateRequest,
    Message,
    NodeName,
    RunStats,
    TokensOut,
    Welcome,
)
from shard.transport import Connection, ConnectionClosed, Handler
from shard.transport.links import accept_peer
from shard.transport.memory import MemoryNetwork

ADDRESS = "coordinator:1"
WELCOME = Welcome(node=NodeName("coord"), role="coordinator", swarm="s")
STATS = RunStats(tokens=3, seconds=1.0, tok_s=3.0, prefill_s=0.1, laps=3, mean_lap_s=0.3)
REQ = GenerateRequest(request=7, prompt="hi", max_tokens=3)


def scripted(pieces: Sequence[Message], closed: trio.Event) -> Handler:
    """A coordinator that answers one request with ``pieces`` (then waits to be closed)."""

    async def handler(conn: Connection) -> None:
        await accept_peer(conn, WELCOME)
        await conn.receive()
        for piece in pieces:
            await conn.send(piece)
        try:
            await conn.receive()
        except ConnectionClosed:
            closed.set()
        finally:
            await conn.aclose()

    return handler


def tokens(ids: Sequence[int]) -> TokensOut:
    return TokensOut(request=7, token_ids=tuple(ids), text="".join(f"<{i}>" for i in ids))


DONE = GenerateDone(request=7, token_ids=(1, 2, 3), text="<1><2><3>", finish_reason="length",
                    stats=STATS)  # fmt: skip


async def test_the_channel_carries_each_commit_then_the_completion() -> None:
    network, closed = MemoryNetwork(), trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            network.serve, ADDRESS, scripted([tokens([1]), tokens([2, 3]), DONE], closed)
        )
        async with stream(network, ADDRESS, REQ, swarm="s") as pieces:
            got = [piece async for piece in pieces]
        assert got == [tokens([1]), tokens([2, 3]), DONE]
        assert await request(network, ADDRESS, REQ, swarm="s") == DONE
        nursery.cancel_scope.cancel()


async def test_a_reader_that_leaves_early_closes_the_connection() -> None:
    network, closed = MemoryNetwork(), trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(network.serve, ADDRESS, scripted([tokens([1]), tokens([2])], closed))
        async with stream(network, ADDRESS, REQ, swarm="s") as pieces:
            first = await pieces.receive()
        assert first == tokens([1])
        with trio.fail_after(5):
            await closed.wait()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("script", ["closes", "answers-wrongly"])
async def test_a_broken_link_raises_its_own_error(script: str) -> None:
    """One address: a coordinator that closes mid-request raises ``ConnectionClosed``, one
    that sends what no request expects raises ``ClientError`` — each as itself, after the
    pieces that came first."""
    network, closed = MemoryNetwork(), trio.Event()
    stray = TokensOut(request=8, token_ids=(9,), text="x")

    async def closes(conn: Connection) -> None:
        await accept_peer(conn, WELCOME)
        await conn.receive()
        await conn.send(tokens([1]))
        await conn.aclose()

    handler = closes if script == "closes" else scripted([tokens([1]), stray], closed)
    error = ConnectionClosed if script == "closes" else ClientError
    got: list[Message] = []

    async def read() -> None:
        async with stream(network, ADDRESS, REQ, swarm="s") as pieces:
            async for piece in pieces:
                got.append(piece)

    async with trio.open_nursery() as nursery:
        await nursery.start(network.serve, ADDRESS, handler)
        with pytest.raises(error):
            await read()
        nursery.cancel_scope.cancel()
    assert got == [tokens([1])]
