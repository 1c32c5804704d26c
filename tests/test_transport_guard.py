"""One connection's failure is that connection's alone (``shard.transport.guard``), and the
deadlines and caps a node applies to its peers.

Links are driven through a scripted ``Connection`` (what the peer sends, in order; a
``WireError`` where its frame was malformed) in virtual time (``autojump_clock``), so the
tests are exact about deadlines and need no sockets; the per-host cap is checked on real
loopback WebSockets (127.0.0.1, port 0, every test under a deadline).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

import shard.nodes.coordinator as coordinator_root
from shard.errors import HandshakeError
from shard.failover.events import RingControl
from shard.failover.scheduler import Scheduler, Slot
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.messages import (
    Fault,
    GenerateDone,
    GenerateRequest,
    Heartbeat,
    Hello,
    Message,
    NodeName,
    Ready,
    Register,
    RunStats,
    StatusReset,
    TokensOut,
)
from shard.spec.limits import Limits
from shard.transport import ConnectionClosed, TransportError, WebSocketNetwork
from shard.transport.base import Connection
from shard.transport.guard import (
    IdleDeadline,
    PeerTooSlow,
    ProtocolViolation,
    connection_failure,
    serve_one,
)
from shard.wire import WireError

ME = NodeName("coord")


class Scripted:
    """A ``Connection`` whose peer sends ``script`` (a message, or an exception the receive
    raises) and then nothing; ``reading=False`` is a peer that never reads (sends block)."""

    def __init__(self, script: list[Message | Exception] | None = None, *, reading: bool = True):
        self._in_send, self._in = trio.open_memory_channel[Message | Exception](math.inf)
        for item in script or []:
            self._in_send.send_nowait(item)
        self.sent: list[Message] = []
        self.reading = reading
        self.closed = False

    @property
    def peer(self) -> str:
        return "10.0.0.9:4242"

    def push(self, item: Message | Exception) -> None:
        self._in_send.send_nowait(item)

    async def send(self, msg: Message) -> None:
        if self.closed:
            raise ConnectionClosed(f"{self.peer}: closed")
        if not self.reading:
            await trio.sleep_forever()
        self.sent.append(msg)

    async def receive(self) -> Message:
        if self.closed:
            raise ConnectionClosed(f"{self.peer}: closed")
        item = await self._in.receive()
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


def faults(conn: Scripted) -> list[Fault]:
    return [m for m in conn.sent if isinstance(m, Fault)]


# --- the guard ---------------------------------------------------------------------------------


def test_connection_failure_sees_through_exception_groups() -> None:
    """A group of connection errors (nested too) is one; a bug or cancellation beside is not."""
    wire, closed = WireError("frame: truncated"), ConnectionClosed("gone")
    assert connection_failure(wire) is wire
    assert connection_failure(HandshakeError("no")) is not None
    assert connection_failure(ExceptionGroup("x", [closed, ExceptionGroup("y", [wire])])) is wire
    assert connection_failure(ExceptionGroup("x", [closed])) is closed
    assert connection_failure(ExceptionGroup("x", [wire, ValueError("bug")])) is None
    assert connection_failure(ValueError("bug")) is None
    assert connection_failure(KeyboardInterrupt()) is None


async def test_serve_one_ends_the_connection_on_a_grouped_wire_error() -> None:
    """A WireError raised inside a handler's nursery ends that connection, closed, silently
    for the caller; a bug propagates unchanged."""
    conn = Scripted([WireError("header: malformed msgpack")])

    async def handler(c: Connection) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await c.receive()

    await serve_one(conn, handler, what="client link")
    assert conn.closed

    async def buggy(c: Connection) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        await serve_one(Scripted(), buggy)


async def test_serve_one_tells_the_peer_why_it_was_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A deadline or protocol violation is answered with a Fault naming it, then a close."""
    for error, kind in ((PeerTooSlow("idle"), "timeout"), (ProtocolViolation("bad"), "protocol")):
        conn = Scripted()

        async def handler(c: Connection, error: Exception = error) -> None:
            raise error

        await serve_one(conn, handler, what="client link", node=ME)
        assert [(f.kind, f.detail) for f in faults(conn)] == [(kind, str(error))]
        assert conn.closed


async def test_idle_deadline_is_off_while_work_runs(autojump_clock: trio.testing.MockClock) -> None:
    """The deadline fires idle_s after the last work ended, never while work runs."""
    idle = IdleDeadline(5.0)
    began = trio.current_time()
    with idle.scope:
        idle.begin()
        await trio.sleep(20)  # longer than idle_s: work is running
        idle.end()
        await trio.sleep_forever()
    assert idle.fired
    assert trio.current_time() - began == pytest.approx(25.0)


# --- the coordinator's client link --------------------------------------------------------------

LIMITS = Limits(idle_timeout_s=30.0, message_timeout_s=5.0)


@pytest.fixture
def fake_complete(monkeypatch: pytest.MonkeyPatch) -> dict[int, trio.Event]:
    """The coordinator's request service replaced: request N streams N TokensOut, then waits
    for its event (if the test set one), then is done."""
    gates: dict[int, trio.Event] = {}

    async def complete(
        _coordinator: Any,
        _text: Any,
        request: GenerateRequest,
        emit: Callable[[Message], Awaitable[None]],
        _store: Any = None,
    ) -> None:
        for i in range(request.max_tokens):
            await emit(TokensOut(request.request, (i,), "x"))
        if request.request in gates:
            await gates[request.request].wait()
        await emit(
            GenerateDone(request.request, (), "", "length", RunStats(0, 0.0, 0.0, 0.0, 0, 0.0))
        )

    monkeypatch.setattr(coordinator_root, "complete", complete)
    return gates


async def serve_client(conn: Scripted, limits: Limits = LIMITS) -> None:
    serve = partial(
        coordinator_root._serve_client,
        None,  # type: ignore[arg-type]  # the fake ``complete`` needs no coordinator
        None,  # type: ignore[arg-type]  # nor a text adapter
        limits=limits,
    )
    await serve_one(conn, serve, what="client link", node=ME)


@pytest.mark.usefixtures("fake_complete")
async def test_malformed_frame_on_a_client_link_ends_only_that_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request, then a malformed frame: the link ends (no exception group escapes)."""
    conn = Scripted([GenerateRequest(1, "hi", 2), WireError("frame: truncated")])
    await serve_client(conn)
    assert conn.closed


@pytest.mark.usefixtures("fake_complete")
async def test_idle_client_is_cut_after_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that asks for nothing — heartbeats and other messages do not count — is cut
    idle_timeout_s after its Hello, with a Fault saying so."""
    conn = Scripted([Heartbeat(NodeName("c"), 0.0), StatusReset(NodeName("c"))])
    began = trio.current_time()
    await serve_client(conn)
    assert trio.current_time() - began == pytest.approx(LIMITS.idle_timeout_s)
    (fault,) = faults(conn)
    assert fault.kind == "timeout" and "idle_timeout_s" in fault.detail
    assert conn.closed


@pytest.mark.usefixtures("fake_complete")
async def test_a_heartbeating_client_is_cut_at_its_idle_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends a Heartbeat every 3 s and no request after its first is cut
    idle_timeout_s after that request ended — heartbeats never reset the deadline — and the
    ignored heartbeats are logged once at warning, not once each."""
    conn = Scripted([GenerateRequest(1, "hi", 1)])
    ended_at: list[float] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            await serve_client(conn)
            ended_at.append(trio.current_time())

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        done_at = trio.current_time()  # the request is done: its GenerateDone was sent
        assert [type(m).__name__ for m in conn.sent] == ["TokensOut", "GenerateDone"]
        while not conn.closed:
            conn.push(Heartbeat(NodeName("c"), trio.current_time()))
            await trio.sleep(3)
    assert ended_at[0] - done_at == pytest.approx(LIMITS.idle_timeout_s)
    (fault,) = faults(conn)
    assert fault.kind == "timeout" and "idle_timeout_s" in fault.detail
    warned = [r for r in caplog.records if "sent Heartbeat" in r.getMessage()]
    assert len([r for r in warned if r.levelno == logging.WARNING]) == 1


async def test_client_is_not_idle_while_its_request_runs(
    autojump_clock: trio.testing.MockClock, fake_complete: dict[int, trio.Event]
) -> None:
    """A request that runs longer than idle_timeout_s is served to the end; the idle clock
    starts when it is done."""
    gate = fake_complete[7] = trio.Event()
    conn = Scripted([GenerateRequest(7, "hi", 3)])
    ended_at: list[float] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            await serve_client(conn)
            ended_at.append(trio.current_time())

        nursery.start_soon(run)
        await trio.sleep(3 * LIMITS.idle_timeout_s)
        assert not conn.closed
        done_at = trio.current_time()
        gate.set()
    assert [type(m).__name__ for m in conn.sent] == ["TokensOut"] * 3 + ["GenerateDone", "Fault"]
    assert ended_at[0] - done_at == pytest.approx(LIMITS.idle_timeout_s)


@pytest.mark.usefixtures("fake_complete")
async def test_client_that_stops_reading_is_cut_after_message_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client that sends a request and never reads is cut message_timeout_s after the
    first reply could not be written; its request is cancelled."""
    conn = Scripted([GenerateRequest(1, "hi", 50)], reading=False)
    began = trio.current_time()
    await serve_client(conn)
    assert conn.closed
    elapsed = trio.current_time() - began
    assert elapsed == pytest.approx(LIMITS.message_timeout_s + 0.5)  # + the reason's grace


# --- the scheduler's control link -------------------------------------------


def scheduler() -> Scheduler:
    """A scheduler whose messages to the router (joins, faults) go into a roomy buffer
    nobody reads: this test watches only the control link."""
    to_router, _ = trio.open_memory_channel[RingControl](64)
    slot = Slot(NodeName("s0"), 0, 2, NodeName("s0"), "127.0.0.1:1")
    return Scheduler(
        SchedulerConfig(node=ME, slots=[slot], return_address="x"),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
    )


@pytest.mark.parametrize(
    "last",
    [WireError("sealed frame: tampered"), HandshakeError("role mismatch"), Ready(ME, "activate")],
)
async def test_control_link_failure_ends_only_that_link(
    autojump_clock: trio.testing.MockClock, last: Message | Exception
) -> None:
    """A registered member's malformed frame, refused Hello or flood of unsolicited Ready
    (more than one order's worth) ends its control link (it is dead to the scheduler); the
    scheduler serves on."""
    sched = scheduler()
    evil = NodeName("evil")
    script: list[Message | Exception] = [Register(evil, "standby", "127.0.0.1:2", -1, -1)]
    script += [last] * (5 if isinstance(last, Ready) else 1)
    conn = Scripted(script)
    hello = Hello(evil, "stage", "t", link="control")
    await serve_one(conn, partial(sched.serve, hello=hello), what="control link")
    assert conn.closed
    assert sched.statistics().members == ((evil, "standby", False),)


# --- the per-host connection cap -----------------------------------------------------------------


async def test_connections_per_host_are_capped() -> None:
    """With max_peer_connections = 2, a third connection from the same host is refused with
    HTTP 503 naming the limit; once one closes, a new one is served."""
    release = trio.Event()
    served = 0

    async def hold(conn: Connection) -> None:
        nonlocal served
        served += 1
        await release.wait()

    with trio.fail_after(30):
        server = WebSocketNetwork(max_peer_connections=2, connect_timeout_s=5.0)
        async with WebSocketNetwork(connect_timeout_s=5.0) as client, trio.open_nursery() as n:
            address = await n.start(server.serve, "127.0.0.1:0", hold)
            held = [await client.dial(address), await client.dial(address)]
            with pytest.raises(TransportError) as refused:
                await client.dial(address)
            assert "503" in str(refused.value) and "max_peer_connections" in str(refused.value)
            release.set()
            for conn in held:
                await conn.aclose()
            again = None
            while again is None:  # the server releases its slots as the closes complete
                await trio.testing.wait_all_tasks_blocked()
                try:
                    again = await client.dial(address)
                except TransportError as exc:
                    refusals = str(exc)
                    assert "503" in refusals, refusals
            await again.aclose()
            n.cancel_scope.cancel()
    assert served == 3
