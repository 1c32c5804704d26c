"""Names are owned: a registration under the name of a live member — a second node started
with the same ``--node`` (``--join``), or a raw ``Register`` — is refused with a typed reply
(``Fault`` kind ``name``; a ``ControlClient`` ends with ``NameTaken``), and the live member's
control link is never dropped. A member declared dead frees its name: a restart goes through,
also while the crashed holder's link still hangs open. On a secure swarm the same key may take
its own name over (``Registry.name_refusal``).

In process, virtual time, memory network.
"""

from __future__ import annotations

from typing import cast

import pytest
import trio
import trio.testing

from answered import AnsweredClient
from shard.failover.control import JoinRefused, NameTaken
from shard.failover.events import RingControl, RingNote
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.membership.registry import Member, Registry, Slot
from shard.membership.rtt import RttTracker
from shard.messages import (
    Activate,
    Fault,
    Hello,
    NodeName,
    NodeProfile,
    Ready,
    Register,
    Rewire,
    Welcome,
)
from shard.spec.failover import FailoverSpec
from shard.transport import Connection, ConnectionClosed, MemoryNetwork
from shard.transport.links import accept_peer, dial_peer

SWARM = "names"
COORD = NodeName("coord")
S1 = NodeName("s1")
POLICY = FailoverSpec(heartbeat_s=0.25, dead_after_s=2.0, probe_s=1.0)


class Swarm:
    """A scheduler with slots s0, s1 serving control links at ``coord`` on a memory network,
    and what it told the router."""

    def __init__(self) -> None:
        to_router, self.told = trio.open_memory_channel[RingControl](1024)
        slots = [Slot(NodeName(f"s{i}"), 2 * i, 2 * i + 2, NodeName(f"s{i}"), "") for i in (0, 1)]
        self.sched = Scheduler(
            SchedulerConfig(node=COORD, slots=slots, return_address="coord:9", policy=POLICY),
            SchedulerChannels(to_router=to_router),
            ring_link=None,
        )
        self.network = MemoryNetwork()
        self.orders: list[Activate | Rewire] = []

    async def start(self, nursery: trio.Nursery) -> None:
        welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)

        async def control(conn: Connection) -> None:
            await self.sched.serve(conn, await accept_peer(conn, welcome))

        await nursery.start(self.sched.run)
        await nursery.start(self.network.serve, "coord", control)

    def client(self, node: str, *, role: str = "stage", name_wait_s: float = 3.0) -> AnsweredClient:
        """A control client of node ``node``: the stage holding its slot, or (``standby``) a
        node started with ``--join`` under that name, carrying a profile."""
        name = NodeName(node)

        async def obey(order: Activate | Rewire) -> None:
            self.orders.append(order)

        profile = NodeProfile("cpu", 1 << 30, 1.0, 1.2, 5) if role == "standby" else None
        register = Register(name, role, f"{node}:7001", 2, 4, node if role == "stage" else "",
                            profile=profile)  # fmt: skip
        return AnsweredClient(
            name, self.network, "coord", lambda: register, SWARM, obey=obey,
            heartbeat_s=POLICY.heartbeat_s, dead_after_s=POLICY.dead_after_s,
            name_wait_s=name_wait_s,
        )  # fmt: skip

    def registrations(self, node: str) -> int:
        """How many times ``node`` registered so far (the router's ``join`` notes)."""
        count = 0
        while True:
            try:
                note = self.told.receive_nowait()
            except trio.WouldBlock:
                return count
            if isinstance(note, RingNote) and note.detail.startswith(f"{node} ("):
                count += note.kind == "join"

    def member(self, node: str) -> Member:
        return self.sched._registry.members[NodeName(node)]


async def test_a_join_under_a_live_name_is_refused_and_the_live_link_untouched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A second node under s1's name (a --join standby with a profile, and a second stage) is
    refused with NameTaken after its wait; s1's link is the same one throughout, was never
    declared dead nor re-registered, and still carries an order."""
    swarm = Swarm()
    async with swarm.network, trio.open_nursery() as nursery:
        await swarm.start(nursery)
        await nursery.start(swarm.client("s1").run)
        await trio.testing.wait_all_tasks_blocked()
        live = swarm.member("s1")
        assert swarm.registrations("s1") == 1
        for role in ("standby", "stage"):
            with trio.fail_after(60), pytest.raises(NameTaken, match="s1 is the name of a live"):
                await swarm.client("s1", role=role).run()
        assert isinstance(NameTaken("x"), JoinRefused)  # the CLI's one-line error
        await trio.sleep(10 * POLICY.heartbeat_s)  # the live link beats on undisturbed
        assert swarm.member("s1") is live and live.alive
        assert swarm.registrations("s1") == 0  # no re-registration: never dropped
        with trio.fail_after(10):
            await live.order(Rewire("s0:7001", True), timeout_s=5.0)
        assert swarm.orders == [Rewire("s0:7001", True)]
        assert swarm.sched.ring() == (COORD, NodeName("s0"), S1)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("name", ["s1", "coord"])
async def test_raw_registers_claiming_live_names_are_refused(
    autojump_clock: trio.testing.MockClock, name: str
) -> None:
    """A raw peer registering as live s1, or as the coordinator, gets a Fault of kind name
    and is closed; s1's link stays the one it was."""
    swarm = Swarm()
    async with swarm.network, trio.open_nursery() as nursery:
        await swarm.start(nursery)
        await nursery.start(swarm.client("s1").run)
        await trio.testing.wait_all_tasks_blocked()
        live = swarm.member("s1")
        swarm.registrations("s1")
        with trio.fail_after(10):
            hello = Hello(NodeName(name), "stage", SWARM, link="control")
            raw = await dial_peer(swarm.network, "coord", hello, timeout_s=5)
            await raw.send(Register(NodeName(name), "stage", "evil:1", 2, 4, "s1"))
            fault = await raw.receive()
            assert isinstance(fault, Fault) and fault.kind == "name"
            assert f"{name} is the" in fault.detail
            with pytest.raises(ConnectionClosed):
                await raw.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert swarm.member("s1") is live and live.alive and swarm.registrations("s1") == 0
        assert NodeName("coord") not in swarm.sched._registry.members
        nursery.cancel_scope.cancel()


async def test_a_restart_of_a_dead_node_registers_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """s1's process ends (its link closes): it is declared dead, and s1 started again under
    the same name registers and takes its slot back."""
    swarm = Swarm()
    async with swarm.network, trio.open_nursery() as nursery:
        await swarm.start(nursery)
        first = trio.CancelScope()

        async def run_first(*, task_status: trio.TaskStatus[None]) -> None:
            with first:
                await swarm.client("s1").run(task_status=task_status)

        await nursery.start(run_first)
        await trio.testing.wait_all_tasks_blocked()
        old = swarm.member("s1")
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert not old.alive
        await nursery.start(swarm.client("s1").run)
        await trio.testing.wait_all_tasks_blocked()
        assert swarm.member("s1") is not old and swarm.member("s1").alive
        assert swarm.sched.ring() == (COORD, NodeName("s0"), S1)
        nursery.cancel_scope.cancel()


async def test_a_restart_while_the_crashed_holders_link_hangs_open_waits_for_its_death(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """s1's old link stays open but silent (a crashed host): the restarted s1 is refused
    while the old one is live, tries again, and registers once the detector declares the
    old one dead — within its name wait, without NameTaken."""
    swarm = Swarm()
    async with swarm.network, trio.open_nursery() as nursery:
        await swarm.start(nursery)
        hello = Hello(S1, "stage", SWARM, link="control")
        hung = await dial_peer(swarm.network, "coord", hello, timeout_s=5)
        await hung.send(Register(S1, "stage", "s1:7001", 2, 4, "s1"))
        await trio.testing.wait_all_tasks_blocked()
        old = swarm.member("s1")
        started = trio.current_time()
        wait = 5 * POLICY.dead_after_s
        await nursery.start(swarm.client("s1", name_wait_s=wait).run)
        with trio.fail_after(wait):
            await swarm.sched._registry.wait_joined()
        assert not old.alive and swarm.member("s1").alive
        assert trio.current_time() - started < wait
        nursery.cancel_scope.cancel()


def test_name_refusal_owns_names_by_liveness_and_key() -> None:
    """A live member's name is refused to another key or a plaintext peer, free to its own
    key, and free once the member is dead; the coordinator's name is never free."""
    reg = Registry(COORD, [], "coord:9")
    conn = cast(Connection, None)
    _, replies = trio.open_memory_channel[Ready](1)
    register = Register(S1, "stage", "s1:1", 0, 2, "s1")
    member = Member.registered(register, conn, 0.0, replies, RttTracker(conn))
    member.conn = cast(Connection, type("C", (), {"peer": "10.0.0.1:5"})())
    member.identity = b"k" * 32
    reg.join(member, "s1")
    assert reg.name_refusal(NodeName("s2"), None, 1.0) is None
    assert "live member" in (reg.name_refusal(S1, None, 1.0) or "")
    assert "live member" in (reg.name_refusal(S1, b"x" * 32, 1.0) or "")
    assert reg.name_refusal(S1, b"k" * 32, 1.0) is None
    assert "coordinator's name" in (reg.name_refusal(COORD, None, 1.0) or "")
    member.alive = False
    assert reg.name_refusal(S1, b"x" * 32, 1.0) is None
