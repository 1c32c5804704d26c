"""DelayRelay's bounds: at most ``max_connections`` relayed at once (one more is closed at once,
with a log line), and a bounded number of bytes held in flight, with backpressure to the
sender, however many connections feed a target that never reads.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from shard.cli.relay import relay_main
from shard.transport import DelayRelay
from shard.transport.base import split_address
from shard.transport.relay import MAX_BUFFERED_BYTES, MAX_CONNECTIONS

SENT_PER_CONNECTION = 40 << 20
CONNECTIONS = 8


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def _never_read(stream: trio.SocketStream) -> None:
    async with stream:
        await trio.sleep_forever()


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(1 << 16):
            await stream.send_all(data)


@asynccontextmanager
async def relay_in_front_of(
    handler: Callable[[trio.SocketStream], Awaitable[None]], **bounds: int
) -> AsyncIterator[tuple[str, DelayRelay]]:
    """A TCP server running ``handler`` and a zero-latency relay in front of it."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        relay = DelayRelay("127.0.0.1:0", target, latency_s=0.0, **bounds)
        yield await nursery.start(relay.run), relay
        nursery.cancel_scope.cancel()


async def test_a_non_reading_target_costs_one_share_per_connection() -> None:
    """Eight connections pushing 40 MiB each into a target that never reads: the relay holds
    at most its per-direction share for each (2 MiB by default), its RSS grows by far less
    than what was pushed, and every sender is held back (none finished)."""
    payload = memoryview(bytes(SENT_PER_CONNECTION))
    finished: list[int] = []

    async def push(stream: trio.SocketStream, i: int) -> None:
        await stream.send_all(payload)
        finished.append(i)

    rss_before = _rss_bytes()
    with trio.fail_after(60):
        async with relay_in_front_of(_never_read) as (address, relay):
            streams = [await trio.open_tcp_stream(*split_address(address)) for _ in range(8)]
            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(streams):
                    nursery.start_soon(push, stream, i)
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                stats = relay.statistics()
                grown = _rss_bytes() - rss_before
                nursery.cancel_scope.cancel()
            for stream in streams:
                await stream.aclose()
    share = MAX_BUFFERED_BYTES // (2 * MAX_CONNECTIONS)
    print(
        f"\nrelay under {CONNECTIONS} non-reading connections: buffered {stats.buffered_bytes} "
        f"bytes (share {share} per direction), RSS grew {grown >> 20} MiB, "
        f"forwarded {stats.bytes_to_target >> 20} MiB of {CONNECTIONS * 40} MiB pushed"
    )
    assert finished == []
    assert stats.open_connections == CONNECTIONS
    assert 0 < stats.buffered_bytes <= CONNECTIONS * share
    assert grown < 96 << 20  # unbounded, the relay held ~30 MiB per connection here


async def test_connections_over_the_cap_are_closed_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a cap of 2, a third connection is closed at once and logged; once one of the two
    closes, a new connection is relayed again."""
    caplog.set_level(logging.WARNING, logger="shard.transport.relay")
    with trio.fail_after(20):
        async with relay_in_front_of(_echo, max_connections=2) as (address, relay):
            first, second = [await trio.open_tcp_stream(*split_address(address)) for _ in "ab"]
            for stream in (first, second):  # both hold a slot: each round trip went through
                await stream.send_all(b"hi")
                assert await stream.receive_some(2) == b"hi"
            async with await trio.open_tcp_stream(*split_address(address)) as third:
                assert await third.receive_some(10) == b""
            assert relay.statistics().refused_connections == 1
            await first.aclose()
            await trio.testing.wait_all_tasks_blocked()
            async with await trio.open_tcp_stream(*split_address(address)) as fourth:
                await fourth.send_all(b"ok")
                assert await fourth.receive_some(2) == b"ok"
            await second.aclose()
    assert relay.statistics().refused_connections == 1
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1 and "2 relayed already" in refusals[0].getMessage()


def test_relay_main_refuses_a_budget_below_one_read_per_direction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard relay` exits 2 with a reason when --max-buffer-mib cannot give each of
    --max-connections one read each way."""
    argv = ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:1", "--latency-ms", "1"]
    assert relay_main([*argv, "--max-connections", "100", "--max-buffer-mib", "1"]) == 2
    assert "at least 131072 per connection" in capsys.readouterr().err
