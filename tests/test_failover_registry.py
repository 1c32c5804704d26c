"""The scheduler's registry and splicer with a dedicated auditor (``[[standby]] role =
"auditor"``): it is asked for audits before a standby holding the same block, and never put in
the ring — not by a splice, not by a claim of its own.

Plain state, no network: members carry no live connection (nothing here sends an order to an
auditor, which is the point), and the splicer's wait for a standby runs in virtual time.
"""

from __future__ import annotations

from typing import cast

import trio
import trio.testing

from shard.failover.events import NodeDead, RingControl, RingLost
from shard.failover.splice import Splicer
from shard.membership.registry import Member, Registry, Slot
from shard.membership.rtt import RttTracker
from shard.messages import NodeName, Ready, Register
from shard.spec.failover import FailoverSpec
from shard.transport import Connection

COORD = NodeName("coord")


def member(node: str, role: str, first: int, last: int, slot: str = "") -> tuple[Member, str]:
    """A registered member with no live link (``conn`` is never used here)."""
    conn = cast(Connection, None)
    _, replies = trio.open_memory_channel[Ready](4)
    register = Register(NodeName(node), role, f"127.0.0.1:{9100 + len(node)}", first, last, slot)
    return Member.registered(register, conn, 0.0, replies, RttTracker(conn)), slot


def registry() -> Registry:
    slots = [
        Slot(NodeName(f"s{i}"), 2 * i, 2 * i + 2, NodeName(f"s{i}"), f"127.0.0.1:{9001 + i}")
        for i in range(3)
    ]
    reg = Registry(COORD, slots, "127.0.0.1:9000")
    for i in range(3):
        reg.join(*member(f"s{i}", "stage", 2 * i, 2 * i + 2, slot=f"s{i}"))
    return reg


def test_an_auditor_is_asked_first_and_is_no_standby() -> None:
    """For its block, the auditor is picked over a standby holding it; it is not a standby."""
    reg = registry()
    reg.join(*member("s1-standby", "standby", 2, 4))
    assert reg.auditor_for(2, 4, NodeName("s1")) is reg.members[NodeName("s1-standby")]
    reg.join(*member("auditor1", "auditor", 2, 4))
    assert reg.auditor_for(2, 4, NodeName("s1")) is reg.members[NodeName("auditor1")]
    assert reg.auditor_for(0, 2, NodeName("s0")) is None  # nobody holds s0's block
    assert reg.standbys() == (NodeName("s1-standby"),)
    assert [m.node for m in reg.live_standbys()] == [NodeName("s1-standby")]


def test_an_auditor_claiming_a_dead_stages_slot_does_not_take_it() -> None:
    """An auditor registering with a slot (even a dead holder's) never becomes its holder."""
    reg = registry()
    reg.members[NodeName("s1")].alive = False
    reg.join(*member("auditor1", "auditor", 2, 4, slot="s1"))
    assert reg.ring() == (COORD, NodeName("s0"), NodeName("s1"), NodeName("s2"))


def test_a_dead_stage_is_never_replaced_by_an_auditor() -> None:
    """s1 dies with only an auditor holding its block (hot) and no standby: the splice waits
    ``join_deadline_s`` for a standby, then gives up; the auditor is never ordered in."""
    reg = registry()
    reg.join(*member("auditor1", "auditor", 2, 4))
    reg.members[NodeName("s1")].alive = False
    notes: list[RingControl] = []

    async def main() -> None:
        to_router, from_splicer = trio.open_memory_channel[RingControl](64)
        splicer = Splicer(
            reg,
            ring_link=None,
            to_router=to_router,
            policy=FailoverSpec(join_deadline_s=5.0),
            clock=trio.current_time,
        )
        with trio.fail_after(60):
            await splicer.recover(NodeDead(NodeName("s1"), trio.current_time()))
        to_router.close()
        notes.extend([note async for note in from_splicer])
        assert [r.kind for r in splicer.recoveries] == ["failed"]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    lost = [n for n in notes if isinstance(n, RingLost)]
    assert lost and "no standby for layers 2..4" in lost[0].detail, notes
    assert reg.slots[1].holder == NodeName("s1")
    assert reg.members[NodeName("auditor1")].role == "auditor"
