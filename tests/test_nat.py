"""NAT-friendly edges in one process: who dials an edge is independent of which way its data
flows (``shard.transport.nat``). Nodes behind a ``Firewall`` (no dial reaches them) are
called back by nodes that accept inbound connections and meet each other at the relay;
either way the dialer gets an ordinary connection and speaks first. On real WebSockets the
relay carries only sealed records in a secure swarm, and a bit it flips is rejected by the
receiver; the relay's own paths survive hostile input (``test_relay_hostile.py``).

Charter: memory networks, or 127.0.0.1 and port 0; every I/O test under a deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from shard.messages import Hello, NodeName, Probe, Welcome
from shard.testing import Firewall
from shard.transport import Connection, MemoryNetwork
from shard.transport.links import accept_peer, dial_peer
from shard.transport.nat import (
    Callback,
    Direct,
    NatNetwork,
    Relayed,
    nat_address,
    route_to,
)
from shard.transport.paths import PathNetwork
from shard.transport.relayhub import RelayHub

DEADLINE_S = 20
SWARM = "lab"
#: (name, listen address, reachable). "coord" holds the relay; "c" accepts inbound too.
NODES = (
    ("coord", "10.0.0.1:7700", True),
    ("a", "192.168.1.2:7701", False),
    ("b", "192.168.2.2:7702", False),
    ("c", "10.0.0.3:7703", True),
)
RELAY = "10.0.0.1:7700"


def test_route_depends_on_the_address_and_on_the_dialer() -> None:
    """host:port is dialled directly; nat:NAME is a callback from a reachable dialer, else
    the relay."""
    assert route_to("10.0.0.1:7700", reachable=True) == Direct("10.0.0.1:7700")
    assert route_to("10.0.0.1:7700", reachable=False) == Direct("10.0.0.1:7700")
    assert route_to(nat_address("s1"), reachable=True) == Callback(NodeName("s1"))
    assert route_to(nat_address("s1"), reachable=False) == Relayed(NodeName("s1"))


def advertised(name: str, listen: str, reachable: bool) -> str:
    return listen if reachable else nat_address(name)


class Node:
    """One node's NAT network and an echo server that names itself in ``Welcome``."""

    def __init__(self, shared: PathNetwork, name: str, listen: str, reachable: bool) -> None:
        self.name = name
        self.listen = listen
        self.address = advertised(name, listen, reachable)
        hub = RelayHub(NodeName(name), SWARM, "stage") if name == "coord" else None
        self.net = NatNetwork(
            shared,
            node=NodeName(name),
            role="stage",
            swarm=SWARM,
            advertise=self.address,
            relay=RELAY,
            hub=hub,
            call_timeout_s=5.0,
        )
        self.registered = trio.Event()

    async def echo(self, conn: Connection) -> None:
        welcome = Welcome(node=NodeName(self.name), role="stage", swarm=SWARM)
        await accept_peer(conn, welcome)
        while True:
            await conn.send(await conn.receive())

    async def dial(self, address: str) -> tuple[Connection, str]:
        """Dial ``address`` as a ring edge would; returns the connection and who answered."""
        hello = Hello(node=NodeName(self.name), role="stage", swarm=SWARM)
        conn = await dial_peer(self.net, address, hello, timeout_s=10.0)
        await conn.send(Probe(nonce=7, sent_at=0.0))
        assert await conn.receive() == Probe(nonce=7, sent_at=0.0)
        return conn, conn.peer


@asynccontextmanager
async def swarm_of(shared: PathNetwork) -> AsyncIterator[dict[str, Node]]:
    """Every node of ``NODES`` serving on ``shared``; the unreachable ones registered."""
    nodes = {name: Node(shared, name, listen, ok) for name, listen, ok in NODES}
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        for node in nodes.values():
            await stack.enter_async_context(node.net)
            bound = await nursery.start(node.net.serve, node.listen, node.echo)
            assert bound == node.address
        hub = nodes["coord"].net.hub
        assert hub is not None
        for name, _, reachable in NODES:
            if not reachable:
                await hub.wait_registered(NodeName(name))
        yield nodes
        nursery.cancel_scope.cancel()


async def test_every_edge_forms_though_the_nat_nodes_accept_nothing() -> None:
    """Reachable -> NAT is a callback, NAT -> NAT goes through the relay, NAT -> reachable is
    direct; the firewall never saw a dial to a node behind it, and the dialer spoke first."""
    closed = [listen for _, listen, reachable in NODES if not reachable]
    firewall = Firewall(MemoryNetwork(encode_frames=True), closed)
    with trio.fail_after(DEADLINE_S):
        async with swarm_of(firewall) as nodes:
            await nodes["coord"].dial(nat_address("a"))  # the coordinator's edge to stage 0
            await nodes["c"].dial(nat_address("b"))  # a reachable stage, its relay elsewhere
            await nodes["a"].dial(nat_address("b"))  # both behind NAT
            await nodes["b"].dial("10.0.0.3:7703")  # out of the NAT: as today
            stats = {name: node.net.statistics() for name, node in nodes.items()}
            hub = nodes["coord"].net.hub
            assert hub is not None
            relayed = hub.statistics()
    assert firewall.refused == []
    assert (stats["coord"].callbacks, stats["c"].callbacks) == (1, 1)
    assert (stats["a"].relayed, stats["b"].direct) == (1, 1)
    assert (stats["a"].answered, stats["b"].answered) == (1, 2)  # b: c's call, a's call
    assert stats["a"].registered and stats["b"].registered
    assert relayed.pairs == 1 and relayed.calls == 3 and relayed.refused == 0
    # the relayed pair carried Hello, Welcome and the echoed probe, undecoded
    assert relayed.forwarded >= 4


async def test_without_the_relay_a_nat_node_cannot_be_reached_and_the_error_says_why() -> None:
    """Dialling nat:NAME when NAME never registered at the relay fails with the relay's
    reason (dial_peer keeps retrying it until its deadline)."""
    with trio.fail_after(DEADLINE_S):
        async with swarm_of(MemoryNetwork()) as nodes:
            hello = Hello(node=NodeName("c"), role="stage", swarm=SWARM)
            with pytest.raises(Exception) as caught:
                await dial_peer(nodes["c"].net, nat_address("nobody"), hello, timeout_s=0.5)
    assert "nobody is not registered at relay coord" in str(caught.value)


async def test_a_dropped_called_back_edge_is_dialled_again_the_same_way() -> None:
    """Closing a called-back connection and dialling again makes a fresh callback: the
    callee dials out once more, as supervision would re-dial after a relink."""
    with trio.fail_after(DEADLINE_S):
        async with swarm_of(MemoryNetwork()) as nodes:
            for _ in range(3):
                conn, _ = await nodes["coord"].dial(nat_address("b"))
                await conn.aclose()
            conn, _ = await nodes["a"].dial(nat_address("b"))
            await conn.aclose()
            conn, _ = await nodes["a"].dial(nat_address("b"))
            stats = nodes["b"].net.statistics()
    assert stats.answered == 5
    assert nodes["coord"].net.statistics().callbacks == 3


def test_firewall_helper_is_a_path_network() -> None:
    """The firewall stands in for the inner network of a NatNetwork."""
    factory: Callable[[], object] = lambda: Firewall(MemoryNetwork(), ())  # noqa: E731
    assert isinstance(factory(), PathNetwork)
