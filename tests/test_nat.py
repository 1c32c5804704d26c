"""NAT-friendly edges in one process: who dials an edge is independent of which way its data
flows (``shard.transport.nat``). Nodes behind a ``Firewall`` (no dial reaches them) are
called back by nodes that accept inbound connections and meet each other at the relay;
either way the dialer gets an ordinary connection and speaks first. On real WebSockets the
relay carries only sealed records in a secure swarm, and a bit it flips is rejected by the
receiver; the relay's own paths survive hostile input (``test_relay_hostile.py``).

Charter: memory networks, or 127.0.0.1 and port 0; every I/O test under a deadline.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from procs import free_ports
from shard.messages import CallMe, Fault, Hello, NodeName, Probe, Welcome
from shard.testing import Firewall, TamperingHub
from shard.testing.nat import SEALED_RECORD, WIRE_FRAME
from shard.transport import Connection, ConnectionClosed, MemoryNetwork, WebSocketNetwork
from shard.transport.links import accept_peer, dial_peer
from shard.transport.nat import (
    Callback,
    Direct,
    NatNetwork,
    Relayed,
    nat_address,
    route_to,
)
from shard.transport.paths import PathNetwork, Sealed
from shard.transport.relayhub import RelayHub
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.sealer import TamperedFrame
from shard.wire import WireError
from trust_fixtures import NOW, credentials, policy

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


# --- real WebSockets: what the relay sees ---------------------------------------------------

MARKER = "the-ring-frame-the-relay-must-not-read"
#: First bytes of the four handshake messages (msgpack arrays of 8, 9, 3 and 2 items).
HANDSHAKE = (0x98, 0x99, 0x93, 0x92)


def wire(name: str, role: str, *, secure: bool) -> PathNetwork:
    if not secure:
        return WebSocketNetwork(connect_timeout_s=5.0)
    creds = credentials(name, (role,))
    return SecureWebSocketNetwork(
        creds, policy(), role=role, clock=lambda: NOW, connect_timeout_s=5.0
    )


class Echo:
    """Answers Hello, then echoes; keeps the error that ended its connection."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors: list[BaseException] = []

    async def __call__(self, conn: Connection) -> None:
        await accept_peer(conn, Welcome(node=NodeName(self.name), role="stage", swarm=SWARM))
        try:
            while True:
                await conn.send(await conn.receive())
        except WireError as exc:
            self.errors.append(exc)
            raise


@asynccontextmanager
async def relayed_pair(
    hub: TamperingHub, *, secure: bool
) -> AsyncIterator[tuple[Connection, Echo]]:
    """Stages a and b behind NAT and a coordinator holding ``hub``, on loopback: a's
    connection to b (through the relay) and b's echo."""
    (port,) = free_ports(1)
    relay = f"127.0.0.1:{port}"
    echo = Echo("b")
    nets = {
        "coord": NatNetwork(
            wire("coord", "coordinator", secure=secure),
            node=NodeName("coord"),
            role="coordinator",
            swarm=SWARM,
            advertise=relay,
            relay=relay,
            hub=hub,
            owns_inner=True,
        )
    }
    for name in ("a", "b"):
        nets[name] = NatNetwork(
            wire(name, "stage", secure=secure),
            node=NodeName(name),
            role="stage",
            swarm=SWARM,
            advertise=nat_address(name),
            relay=relay,
            owns_inner=True,
        )
    async with nets["coord"], nets["a"], nets["b"], trio.open_nursery() as nursery:
        await nursery.start(nets["coord"].serve, relay, echo)
        for name in ("a", "b"):
            await nursery.start(nets[name].serve, "127.0.0.1:0", echo)
            await hub.wait_registered(NodeName(name))
        hello = Hello(node=NodeName("a"), role="stage", swarm=SWARM)
        conn = await dial_peer(nets["a"], nat_address("b"), hello, timeout_s=10.0)
        yield conn, echo
        nursery.cancel_scope.cancel()


def carried(hub: TamperingHub) -> Counter[int]:
    return hub.first_bytes


@pytest.mark.parametrize("secure", [True, False], ids=["sealed", "plain"])
async def test_the_relay_carries_only_sealed_records_on_the_sealed_wire(secure: bool) -> None:
    """Through the relay a's frames reach b and come back; on the sealed wire everything the
    relay carried is a handshake message or a sealed record (never a wire frame, never the
    marker's bytes); on the plain wire it could read them (the control)."""
    seen: list[bytes] = []

    class Recording(TamperingHub):
        def carry(self, item: object, way: int, n: int) -> object:
            if isinstance(item, bytes):
                seen.append(item)
            return super().carry(item, way, n)

    hub = Recording(NodeName("coord"), SWARM, "coordinator", times=0)
    probe = Fault(node=NodeName("a"), kind="test", detail=MARKER)
    with trio.fail_after(DEADLINE_S):
        async with relayed_pair(hub, secure=secure) as (conn, _):
            for _ in range(3):
                await conn.send(probe)
                assert await conn.receive() == probe
    assert hub.statistics().pairs == 1
    readable = [item for item in seen if MARKER.encode() in item or item[0] == WIRE_FRAME]
    if secure:
        assert readable == []
        assert carried(hub)[SEALED_RECORD] >= 8  # Hello, Welcome, 3 probes and 3 echoes
        assert set(carried(hub)) == {SEALED_RECORD, *HANDSHAKE}, carried(hub)
    else:
        assert len(readable) >= 6


async def test_a_bit_the_relay_flips_is_rejected_by_the_receiver() -> None:
    """The relay flips one bit of the first large record after Hello: b's sealer rejects it
    (TamperedFrame), b resets the connection, and a learns its edge is gone — nothing altered
    ever reaches b's handler."""
    hub = TamperingHub(NodeName("coord"), SWARM, "coordinator", at=3, min_bytes=200)
    noise = random.Random(17).randbytes(300).hex()  # incompressible: no zstd below 200 bytes
    probe = Fault(node=NodeName("a"), kind="test", detail=noise)
    with trio.fail_after(DEADLINE_S):
        async with relayed_pair(hub, secure=True) as (conn, echo):
            await conn.send(probe)
            with pytest.raises(ConnectionClosed):
                await conn.receive()
    assert hub.tampered == 1
    (error,) = echo.errors
    assert isinstance(error, TamperedFrame), error


async def test_a_hostile_relay_cannot_make_a_callee_dial_garbage_or_exit() -> None:
    """A relay that sends malformed calls, then a message a relay never sends: the callee
    dials nothing, drops the link, registers again, and serves on."""
    shared = MemoryNetwork()
    links = 0
    again = trio.Event()

    async def hostile(conn: Connection) -> None:
        nonlocal links
        links += 1
        await accept_peer(conn, Welcome(node=NodeName("coord"), role="stage", swarm=SWARM))
        if links > 1:
            again.set()
            await trio.sleep_forever()
        await conn.send(CallMe(NodeName("x"), "zz"))  # malformed ticket
        await conn.send(CallMe(NodeName("x"), "0" * 32, back="no address"))
        await conn.send(Probe(nonce=1, sent_at=0.0))  # not a relay's message

    def router(path: str) -> Sealed | None:
        return Sealed(hostile, dialer=False) if path == "/signal" else None

    callee = NatNetwork(
        shared,
        node=NodeName("a"),
        role="stage",
        swarm=SWARM,
        advertise=nat_address("a"),
        relay=RELAY,
    )
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(shared.serve_paths, RELAY, hostile, router)
            await nursery.start(callee.serve, "192.168.1.2:7701", hostile)
            await again.wait()
            stats = callee.statistics()
            nursery.cancel_scope.cancel()
    assert stats.answered == 0 and stats.registered
