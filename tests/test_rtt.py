"""Control-link RTT: the tracker's median and bookkeeping, the scheduler's per-node RTT over
an emulated WAN, and a node answering probes while it obeys an order (virtual time)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast

import pytest
import trio
import trio.testing

from answered import AnsweredClient
from shard.failover.duties import Order
from shard.failover.events import RingControl, RingNote
from shard.failover.scheduler import Scheduler, Slot
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.membership.rtt import RttTracker, measure_row, serve_probes
from shard.messages import (
    Activate,
    Heartbeat,
    Hello,
    MeasureRtt,
    NodeName,
    Probe,
    ProbeReply,
    Ready,
    Register,
    Rewire,
    Welcome,
)
from shard.spec.failover import FailoverSpec
from shard.transport import Connection, ConnectionClosed, DelayNetwork, MemoryNetwork, Network
from shard.transport.links import accept_peer, dial_peer

SWARM = "rtt-test"
COORD = NodeName("coord")
NODE = NodeName("s0")
#: ``probe`` and ``on_reply`` never touch the connection (only ``run`` sends on it).
NO_CONN = cast(Connection, None)


class Clock:
    """A settable clock for the tracker."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ring_notes(messages: trio.MemoryReceiveChannel[RingControl]) -> list[str]:
    """What the scheduler told the router, as ``kind: detail``; anything but a ``RingNote``
    (a pause, resume or ring lost) is a recovery this test does not expect."""
    notes: list[str] = []
    while True:
        try:
            msg = messages.receive_nowait()
        except trio.WouldBlock:
            return notes
        assert isinstance(msg, RingNote), f"unexpected {msg}"
        notes.append(f"{msg.kind}: {msg.detail}")


def control_client(
    network: Network, role: str, obey: Callable[[Order], Awaitable[None]]
) -> AnsweredClient:
    """Node ``s0``'s control link to ``coord``, registering as ``role`` with layers 0..1."""
    return AnsweredClient(
        NODE,
        network,
        "coord",
        lambda: Register(node=NODE, role=role, address="s0:1", first=0, last=1),
        SWARM,
        role,
        obey,
    )


def reply_after(tracker: RttTracker, clock: Clock, rtt: float) -> float | None:
    probe = tracker.probe()
    clock.now += rtt
    return tracker.on_reply(ProbeReply(nonce=probe.nonce, sent_at=probe.sent_at))


def test_rtt_is_the_median_of_the_last_few() -> None:
    """rtt_s is None before a reply, then the median of the last ``keep`` round trips, so one
    late reply does not move it."""
    clock = Clock()
    tracker = RttTracker(NO_CONN, keep=5, clock=clock)
    assert tracker.rtt_s is None
    for rtt in (0.05, 0.05, 0.9, 0.05, 0.06):
        assert reply_after(tracker, clock, rtt) == pytest.approx(rtt)
    assert tracker.rtt_s == pytest.approx(0.05)
    for rtt in (0.2, 0.2, 0.2):  # the link got slower: the median follows within keep samples
        reply_after(tracker, clock, rtt)
    assert tracker.samples == pytest.approx((0.05, 0.06, 0.2, 0.2, 0.2))
    assert tracker.rtt_s == pytest.approx(0.2)


def test_unknown_duplicate_and_forgotten_replies_are_ignored() -> None:
    """Only a reply to a waiting probe is a sample, timed from this side's own send time (not
    the echoed one); probes never answered are forgotten after ``keep * 4`` newer ones."""
    clock = Clock()
    tracker = RttTracker(NO_CONN, keep=2, clock=clock)
    probe = tracker.probe()
    clock.now = 0.1
    assert tracker.on_reply(ProbeReply(nonce=probe.nonce + 99, sent_at=0.0)) is None
    assert tracker.on_reply(ProbeReply(nonce=probe.nonce, sent_at=0.09)) == pytest.approx(0.1)
    assert tracker.on_reply(ProbeReply(nonce=probe.nonce, sent_at=0.09)) is None  # duplicate
    lost = tracker.probe()
    for _ in range(8):
        tracker.probe()
    assert tracker.on_reply(ProbeReply(nonce=lost.nonce, sent_at=lost.sent_at)) is None
    assert tracker.samples == pytest.approx((0.1,))
    with pytest.raises(ValueError, match="keep"):
        RttTracker(NO_CONN, keep=0)


async def test_scheduler_reports_each_nodes_control_rtt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A node whose control link crosses 30 ms each way shows rtt_s of 60 ms in the
    scheduler's statistics, measured with Probe/ProbeReply while it heartbeats."""
    to_router, told = trio.open_memory_channel[RingControl](64)
    scheduler = Scheduler(
        SchedulerConfig(
            node=COORD,
            slots=[Slot(NODE, 0, 1, NODE, "s0:1")],
            return_address="coord:ret",
            policy=FailoverSpec(probe_s=0.5),
        ),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
    )
    welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)

    async def control(conn: Connection) -> None:
        await scheduler.serve(conn, await accept_peer(conn, welcome))

    async def no_orders(order: Activate | Rewire) -> None:
        raise AssertionError(f"unexpected order {order}")

    memory = MemoryNetwork()
    wan = DelayNetwork(memory, 0.03, local_name=NODE)
    async with memory, wan, trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        await nursery.start(memory.serve, "coord", control)
        await nursery.start(control_client(wan, "stage", no_orders).run)
        assert dict(scheduler.statistics().rtt_s) in ({}, {NODE: None})
        await trio.sleep(3.0)
        stats = scheduler.statistics()
        assert stats.members == ((NODE, "stage", True),)
        assert dict(stats.rtt_s)[NODE] == pytest.approx(0.06)
        nursery.cancel_scope.cancel()
    assert any(NODE in e for e in ring_notes(told))


async def test_node_answers_probes_while_obeying_an_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A probe that arrives while the node is still carrying out an Activate is answered at
    once (the order's 10 s do not inflate the RTT), and the order's Ready still follows."""
    activated = trio.Event()
    finish = trio.Event()

    async def slow_activate(order: Activate | Rewire) -> None:
        activated.set()
        await finish.wait()

    got: trio.MemorySendChannel[Ready | ProbeReply]
    got, replies = trio.open_memory_channel[Ready | ProbeReply](8)

    async def fake_scheduler(conn: Connection) -> None:
        await accept_peer(conn, Welcome(node=COORD, role="coordinator", swarm=SWARM))
        assert isinstance(await conn.receive(), Register)
        await conn.send(Activate(NODE, 0, 1, "next:1"))
        await activated.wait()
        await conn.send(Probe(nonce=7, sent_at=trio.current_time()))
        while True:
            msg = await conn.receive()
            if isinstance(msg, Ready | ProbeReply):
                await got.send(msg)
            else:
                assert isinstance(msg, Heartbeat)
                await conn.send(Heartbeat(node=COORD, sent_at=0.0))

    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        await nursery.start(network.serve, "coord", fake_scheduler)
        await nursery.start(control_client(network, "standby", slow_activate).run)
        t0 = trio.current_time()
        with trio.fail_after(5):  # a node that reads only between orders never answers
            assert await replies.receive() == ProbeReply(nonce=7, sent_at=t0)
        assert trio.current_time() == t0
        await trio.sleep(10.0)
        finish.set()
        assert await replies.receive() == Ready(node=NODE, action="activate")
        nursery.cancel_scope.cancel()


async def test_a_joining_node_measures_its_row_of_the_mesh_with_probes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``measure_row`` times probes to each address on a probe link ``serve_probes`` answers:
    60 ms across a 30 ms-each-way WAN, -1 for an address nobody listens on; a probe link
    carries nothing else (a Heartbeat ends it)."""
    welcome = Welcome(node=NodeName("peer"), role="stage", swarm=SWARM)

    async def peer(conn: Connection) -> None:
        await accept_peer(conn, welcome)
        await serve_probes(conn)

    memory = MemoryNetwork()
    wan = DelayNetwork(memory, 0.03, local_name=NODE)
    hello = Hello(node=NODE, role="stage", swarm=SWARM, link="probe")
    async with memory, wan, trio.open_nursery() as nursery:
        await nursery.start(memory.serve, "peer:1", peer)
        order = MeasureRtt(("peer", "gone"), ("peer:1", "gone:1"), 3)
        report = await measure_row(wan, hello, order, timeout_s=2.0)
        assert report.names == ("peer", "gone") and report.node == NODE
        assert report.rtt_ms[0] == pytest.approx(60.0) and report.rtt_ms[1] == -1.0
        conn = await dial_peer(memory, "peer:1", hello, timeout_s=1.0)
        await conn.send(Heartbeat(node=NODE, sent_at=0.0))
        with pytest.raises(ConnectionClosed):
            await conn.receive()
        nursery.cancel_scope.cancel()
