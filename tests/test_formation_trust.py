"""Trusted boundaries by token: in a ``[formation]`` swarm with ``pin_boundaries``, a joined
node whose *verified* admission token grants the role ``trusted`` may hold the first and the
last block, exactly as one the spec names in ``trusted``; a node's own word counts for
nothing, and a plaintext link proves nothing.

In process, virtual time, memory network: the control links carry the ``authenticated``
record a ``SecureConnection`` carries (a real token, signed by a real authority key), so the
scheduler reads it as it reads a sealed link's.
"""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from shard.failover.events import RingControl
from shard.failover.scheduler import Scheduler
from shard.failover.scheduler_config import SchedulerChannels, SchedulerConfig
from shard.formation.formation import FormationError
from shard.messages import Hello, Message, Welcome
from shard.spec.failover import FailoverSpec
from shard.spec.formation import FormationSpec, read_formation
from shard.spec.swarm import SpecError
from shard.spec.validate import Table
from shard.transport import Connection, ConnectionStatistics, MemoryNetwork
from shard.transport.links import accept_peer
from shard.transport.secure import token_roles
from shard.trust.admission import Admitted, issue
from shard.trust.identity import NodeIdentity
from test_formation import COORD, GOOD, MESH, MODEL, SWARM, Joiner

AUTHORITY = NodeIdentity.generate()


def admitted(node: str, roles: tuple[str, ...]) -> Admitted:
    key = NodeIdentity.generate()
    token = issue(
        AUTHORITY,
        node_pub=key.public,
        swarm=SWARM,
        roles=roles,
        not_before=0,
        expires=2**40,
        serial=abs(hash(node)) % 1000,
    )
    return Admitted(key.public, "stage", token)


@attrs.define
class Vouched:
    """A control link whose peer a handshake admitted with ``authenticated`` (as on the
    secure wire)."""

    inner: Connection
    authenticated: Admitted

    @property
    def peer(self) -> str:
        return self.inner.peer

    async def send(self, msg: Message) -> None:
        await self.inner.send(msg)

    async def receive(self) -> Message:
        return await self.inner.receive()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> ConnectionStatistics:
        return self.inner.statistics()


async def form_with_tokens(roles: dict[str, tuple[str, ...]]) -> list[str]:
    """Three nodes join a swarm pinning its boundaries to no named node; each link carries
    the token ``roles`` gives it (absent: a plaintext link). The ring formed, in order."""
    to_router, _ = trio.open_memory_channel[RingControl](256)
    formation = FormationSpec(expect=3, wait_s=30.0, probes=3, pin_boundaries=True)
    sched = Scheduler(
        SchedulerConfig(
            node=COORD,
            slots=[],
            return_address="coord:9",
            policy=FailoverSpec(probe_s=0.5, dead_after_s=10.0),
            formation=(formation, MODEL),
        ),
        SchedulerChannels(to_router=to_router),
        ring_link=None,
    )
    assert sched.formation is not None
    welcome = Welcome(node=COORD, role="coordinator", swarm=SWARM)

    async def control(conn: Connection) -> None:
        hello: Hello = await accept_peer(conn, welcome)
        granted = roles.get(hello.node)
        link = conn if granted is None else Vouched(conn, admitted(hello.node, granted))
        await sched.serve(link, hello)

    network = MemoryNetwork()
    async with network, trio.open_nursery() as nursery:
        await nursery.start(sched.run)
        await nursery.start(network.serve, "coord", control)
        for name in ("a", "b", "c"):
            await nursery.start(Joiner(name, GOOD, MESH[name]).client(network, []).run)
        failed: FormationError | None = None
        try:
            with trio.fail_after(60):
                plan = await sched.formation.form()
        except FormationError as exc:  # raised out here, not as the nursery's group
            failed = exc
        nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return [s.node for s in plan.stages]


async def test_a_tokens_trusted_role_pins_the_boundaries(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Unpinned, the near pair b, c would form the ring (``test_formation``); with a and c
    trusted by their tokens (b's grants only ``stage``), the far a must hold a boundary."""
    ring = await form_with_tokens(
        {"a": ("stage", "trusted"), "b": ("stage",), "c": ("stage", "trusted")}
    )
    assert sorted(ring) == ["a", "c"]


async def test_without_a_trusted_token_the_pinned_plan_fails_clearly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Tokens granting only ``stage``, and plaintext links, trust nobody: the plan cannot pin
    its boundaries and the formation error says so."""
    with pytest.raises(FormationError, match="trusted"):
        await form_with_tokens({"a": ("stage",), "b": ("stage",)})


def test_token_roles_reads_only_a_verified_record() -> None:
    """A plaintext link grants nothing; a vouched one what its token says."""
    network_conn = object()
    assert token_roles(network_conn) == ()
    vouched = Vouched(network_conn, admitted("a", ("stage", "trusted")))  # type: ignore[arg-type]
    assert token_roles(vouched) == ("stage", "trusted")


def test_pin_boundaries_without_names_is_refused_only_on_a_plaintext_swarm() -> None:
    """With no ``trusted`` names, an insecure swarm has no one to trust: a SpecError naming
    the key; a secure one may trust by token."""
    table = Table.open("spec.toml", "formation", {"pin_boundaries": True}, ("pin_boundaries",))
    assert read_formation(table, secure=True).pin_boundaries
    with pytest.raises(SpecError) as info:
        read_formation(
            Table.open("spec.toml", "formation", {"pin_boundaries": True}, ("pin_boundaries",)),
            secure=False,
        )
    assert "token" in str(info.value)
