"""DelayRelay on real loopback: bytes intact both ways, latency added, clean shutdown.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
Timing assertions are lower bounds only (a loaded machine may always be slower).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from shard.messages import ChunkSeq, Epoch, Probe, SessionId, Tensor, Verify
from shard.transport import Connection, DelayRelay, WebSocketNetwork
from shard.transport.base import split_address

LATENCY_S = 0.02


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(1 << 16):
            await stream.send_all(data)


@asynccontextmanager
async def echo_behind_relay(
    latency_s: float, bandwidth_bps: float = 0.0
) -> AsyncIterator[tuple[str, DelayRelay]]:
    """An echo TCP server and a relay in front of it; yields (relay address, relay)."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
        target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        relay = DelayRelay("127.0.0.1:0", target, latency_s=latency_s, bandwidth_bps=bandwidth_bps)
        address = await nursery.start(relay.run)
        yield address, relay
        nursery.cancel_scope.cancel()


async def _read_exactly(stream: trio.SocketStream, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = await stream.receive_some(n - len(chunks))
        assert chunk, "relay closed early"
        chunks += chunk
    return bytes(chunks)


async def test_bytes_forwarded_intact_both_ways() -> None:
    """1 MiB of random bytes comes back through the relay unchanged and in order."""
    payload = random.Random(0).randbytes(1 << 20)
    with trio.fail_after(20):
        async with echo_behind_relay(LATENCY_S) as (address, relay):
            stream = await trio.open_tcp_stream(*split_address(address))
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, payload)
                echoed = await _read_exactly(stream, len(payload))
            stats = relay.statistics()
    assert echoed == payload
    assert stats.connections == 1
    assert stats.bytes_to_target == stats.bytes_to_client == len(payload)


async def test_round_trip_takes_at_least_two_latencies() -> None:
    """A small round trip through the relay is at least 2x the one-way latency."""
    with trio.fail_after(20):
        async with echo_behind_relay(LATENCY_S) as (address, _):
            stream = await trio.open_tcp_stream(*split_address(address))
            async with stream:
                rtts = []
                for i in range(5):
                    t0 = trio.current_time()
                    await stream.send_all(bytes([i]) * 10)
                    assert await _read_exactly(stream, 10) == bytes([i]) * 10
                    rtts.append(trio.current_time() - t0)
    print(f"\nrelay RTT at {LATENCY_S * 1e3:g} ms one way: {[f'{r * 1e3:.1f}' for r in rtts]} ms")
    assert min(rtts) >= 2 * LATENCY_S


async def test_bandwidth_cap_slows_a_bulk_transfer() -> None:
    """With a cap, 256 KiB each way takes at least its serialization time."""
    bps = 16e6  # 2 MB/s: 256 KiB serializes in ~0.13 s per direction
    payload = random.Random(1).randbytes(256 * 1024)
    with trio.fail_after(20):
        async with echo_behind_relay(0.0, bandwidth_bps=bps) as (address, _):
            stream = await trio.open_tcp_stream(*split_address(address))
            async with stream, trio.open_nursery() as nursery:
                t0 = trio.current_time()
                nursery.start_soon(stream.send_all, payload)
                assert await _read_exactly(stream, len(payload)) == payload
                elapsed = trio.current_time() - t0
    assert elapsed >= len(payload) * 8 / bps


async def test_websocket_network_through_relay() -> None:
    """A WebSocketNetwork connection works through the relay, 1 MiB tensor included."""
    tensor = Tensor(dtype="float32", shape=(1 << 18,), data=random.Random(2).randbytes(1 << 20))
    msg = Verify(session=SessionId(1), epoch=Epoch(0), seq=ChunkSeq(3), start=7, hidden=tensor)

    async def echo(conn: Connection) -> None:
        while True:
            await conn.send(await conn.receive())

    with trio.fail_after(20):
        async with WebSocketNetwork() as network, trio.open_nursery() as nursery:
            server = await nursery.start(network.serve, "127.0.0.1:0", echo)
            relay = DelayRelay("127.0.0.1:0", server, latency_s=LATENCY_S)
            address = await nursery.start(relay.run)
            conn = await network.dial(address)
            t0 = trio.current_time()
            await conn.send(Probe(nonce=1, sent_at=0.0))
            assert await conn.receive() == Probe(nonce=1, sent_at=0.0)
            assert trio.current_time() - t0 >= 2 * LATENCY_S
            await conn.send(msg)
            assert await conn.receive() == msg
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_clean_shutdown_closes_relayed_connections() -> None:
    """Cancelling the relay closes its listener and every relayed connection."""
    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            listeners = await outer.start(partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
            target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            relay = DelayRelay("127.0.0.1:0", target, latency_s=LATENCY_S)
            relay_scope = trio.CancelScope()
            address = await outer.start(_run_in_scope, relay, relay_scope)
            stream = await trio.open_tcp_stream(*split_address(address))
            await stream.send_all(b"ping")
            assert await _read_exactly(stream, 4) == b"ping"
            relay_scope.cancel()
            assert await stream.receive_some(10) == b""  # the relay closed our connection
            await stream.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert relay.statistics().open_connections == 0
            outer.cancel_scope.cancel()


async def _run_in_scope(
    relay: DelayRelay,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await relay.run(task_status=task_status)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_relay_main_cli_runs_until_ctrl_c(sig: signal.Signals) -> None:
    """`relay_main` prints its status line, relays, and exits 0 on Ctrl-C (SIGINT), SIGTERM
    or SIGHUP — SIGINT also when the run inherited it ignored (a shell's `&`, or a
    backgrounded test run)."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
            target = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            code = (
                "import sys; from shard.cli.relay import relay_main; "
                "sys.exit(relay_main(sys.argv[1:]))"
            )
            argv = [sys.executable, "-c", code, "--listen", "127.0.0.1:0", "--target", target]
            argv += ["--latency-ms", "5"]
            process = await trio.lowlevel.open_process(
                argv, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
            try:
                assert process.stdout is not None
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(1)
                    assert chunk, "relay exited before printing its status line"
                    line += chunk
                fields = dict(item.split("=", 1) for item in line.decode().split()[1:])
                stream = await trio.open_tcp_stream(*split_address(fields["listening"]))
                async with stream:
                    await stream.send_all(b"hello")
                    assert await _read_exactly(stream, 5) == b"hello"
                process.send_signal(sig)
                assert await process.wait() == 0
                await process.stdout.aclose()
            finally:  # whatever failed, the relay does not outlive the test
                if process.returncode is None:
                    process.kill()
                    with trio.CancelScope(shield=True):
                        await process.wait()
            nursery.cancel_scope.cancel()
