"""The scheduler's registry: who is a member, who is alive, and who holds which ring slot.

Plain state with synchronous queries (no I/O but a member's ``order``), owned by the scheduler
(``shard.failover.scheduler``) and read by its splicer (``shard.failover.splice``) and its
formation (``shard.formation``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from shard.audit.hub import Holder
from shard.membership.rtt import RttTracker
from shard.messages import Activate, NodeName, NodeProfile, Ready, Register, Rewire
from shard.spec.reach import NAT_PREFIX
from shard.transport import Connection, TransportError
from shard.transport.guard import ProtocolViolation
from shard.transport.secure import token_roles
from shard.trust.admission import Admitted

#: A spare standby's block: it holds none and loads the dead node's (the cold path).
NO_BLOCK = (-1, -1)


class RecoveryFailed(Exception):
    """A repair step failed; the message says which node and why."""


@attrs.define
class Slot:
    """One ring position: the spec's stage name, its block, and who holds it now."""

    name: NodeName
    first: int
    last: int
    holder: NodeName
    address: str


@attrs.define
class Member:
    """A node with a control link: what it registered, when it was last heard from, and the
    ``Ready`` replies its serve task forwards (in order: one order at a time per member)."""

    node: NodeName
    role: str
    address: str
    first: int
    last: int
    conn: Connection
    last_seen: float
    replies: trio.MemoryReceiveChannel[Ready]
    rtt: RttTracker
    alive: bool = True
    profile: NodeProfile | None = None  # a node started with --join: for placement
    #: What the peer's verified admission token grants (``()`` on a plaintext wire): a
    #: ``trusted`` role lets it hold pinned boundary blocks (``shard.formation``).
    token_roles: tuple[str, ...] = ()
    #: The key the peer's handshake proved (None on a plaintext wire): on a secure swarm only
    #: this key may register under this member's name while it lives (``Registry.name_refusal``).
    identity: bytes | None = None
    slot: str = ""  # the ring slot it said it serves ("" for a standby): a warm ring's

    @classmethod
    def registered(
        cls,
        register: Register,
        conn: Connection,
        at: float,
        replies: trio.MemoryReceiveChannel[Ready],
        rtt: RttTracker,
    ) -> Member:
        return cls(
            register.node,
            register.role,
            register.address,
            register.first,
            register.last,
            conn,
            at,
            replies,
            rtt,
            profile=register.profile,
            token_roles=token_roles(conn),
            identity=peer_identity(conn),
            slot=register.slot,
        )

    async def order(self, order: Activate | Rewire, *, timeout_s: float) -> None:
        """Send ``order`` and wait for its ``Ready``. Errors: ``RecoveryFailed`` (the link
        failed or ended before the reply, or the member reported failure),
        ``trio.TooSlowError`` (no reply in time)."""
        try:
            await self.conn.send(order)
        except TransportError as exc:
            raise RecoveryFailed(f"{self.node}: {exc}") from exc
        with trio.fail_after(timeout_s):
            try:
                reply = await self.replies.receive()
            except trio.EndOfChannel:  # its control link ended (it died, or re-registered)
                raise RecoveryFailed(f"{self.node}: its control link ended first") from None
        if not reply.ok:
            raise RecoveryFailed(f"{self.node}: {reply.action} failed: {reply.detail}")


class Registry:
    """Members by name, the ring's slots, and the nodes fenced off after being replaced.

    ``node`` is the coordinator (the ring's first node, always alive); ``return_address`` is
    where the tail sends its verdicts. ``behind_nat``: joined nodes that were activated behind
    NAT (nobody reached them): they are dialled at ``nat:NAME``, not where they listen.
    """

    def __init__(self, node: NodeName, slots: Sequence[Slot], return_address: str) -> None:
        self.node = node
        self.slots = list(slots)
        self.return_address = return_address
        self.members: dict[NodeName, Member] = {}
        self.fenced: dict[NodeName, NodeName] = {}  # replaced node -> who took its slot
        self.behind_nat: set[NodeName] = set()
        self._joined = trio.Event()

    def dial_address(self, member: Member) -> str:
        """Where ``member``'s predecessor dials it: ``nat:NAME`` once it was activated behind
        NAT, else the address it registered."""
        return f"{NAT_PREFIX}{member.node}" if member.node in self.behind_nat else member.address

    def join(self, member: Member, slot: str) -> Member | None:
        """Add ``member`` (it registered claiming ring slot ``slot``, or none); returns the
        member it replaces under the same name, if any. A claim takes a slot only from its
        own holder or a dead one: a live holder is never displaced (the ring as it stands, a
        standby spliced in before this coordinator started, wins)."""
        old = self.members.get(member.node)
        self.members[member.node] = member
        for s in self.slots:
            claims = member.role == "stage" and s.name == slot
            if claims and (s.holder == member.node or not self.alive(s.holder)):
                s.holder = member.node
            if s.holder == member.node:
                s.address = self.dial_address(member)
        self._joined.set()
        self._joined = trio.Event()
        return old

    def name_refusal(self, node: NodeName, identity: bytes | None, now: float) -> str | None:
        """Why a registration under ``node`` by a peer that proved ``identity`` (None: a
        plaintext wire) must be refused, or None. A name is owned by its live member: only
        the same key may register under it while it lives (a restarted or re-dialling node
        on a secure swarm takes its own link over); a member declared dead, or never seen,
        leaves the name free. The coordinator's own name is never free."""
        if node == self.node:
            return f"{node} is the coordinator's name; start this node under another --node"
        old = self.members.get(node)
        if old is None or not old.alive:
            return None
        if identity is not None and identity == old.identity:
            return None
        return (
            f"{node} is the name of a live member (registered from {old.conn.peer}, heard from "
            f"{max(0.0, now - old.last_seen):.1f} s ago); start this node under another --node, "
            "or, if that node is gone, wait until the scheduler declares it dead"
        )

    def replaced_by(self, reg: Register) -> NodeName | None:
        """Who holds the slot ``reg``'s node was replaced in, if it was: a node declared dead
        whose slot another took, or a stage claiming a slot another live node holds."""
        if reg.node in self.fenced:
            return self.fenced[reg.node]
        for slot in self.slots:
            if reg.role == "stage" and slot.name == reg.slot and slot.holder != reg.node:
                return slot.holder if self.alive(slot.holder) else None
        return None

    async def wait_joined(self) -> None:
        """Wait until the next member joins."""
        await self._joined.wait()

    def alive(self, node: NodeName | None) -> bool:
        if node == self.node:
            return True
        member = self.members.get(node) if node is not None else None
        return member is not None and member.alive

    def live_standbys(self) -> list[Member]:
        """Live nodes a splice may put in the ring (never an ``auditor``)."""
        return [m for m in self.members.values() if m.alive and m.role == "standby"]

    def standbys(self) -> tuple[NodeName, ...]:
        return tuple(m.node for m in self.live_standbys())

    def holders(self) -> list[Holder]:
        """The ring's slots as the spot checks read them: who holds which block."""
        return [Holder(s.holder, s.first, s.last) for s in self.slots]

    def auditor_for(self, first: int, last: int, accused: NodeName) -> Member | None:
        """A live node out of the ring holding ``[first, last)`` that is not ``accused`` — a
        dedicated auditor first, else a standby — or None."""
        able = [
            m
            for m in self.members.values()
            if m.alive and m.role in ("auditor", "standby") and m.node != accused
            if (m.first, m.last) == (first, last)
        ]
        return min(able, key=lambda m: m.role != "auditor", default=None)

    def ring(self) -> tuple[NodeName, ...]:
        """Node names from the coordinator to the tail, as the ring stands now."""
        return (self.node, *(s.holder for s in self.slots))

    def tail(self) -> NodeName:
        """The node that may open the return link now (nobody's while a ring forms)."""
        return self.slots[-1].holder if self.slots else self.node

    def slot_of(self, node: NodeName) -> int | None:
        for i, slot in enumerate(self.slots):
            if slot.holder == node:
                return i
        return None

    def successor_of(self, node: NodeName) -> NodeName | None:
        if node == self.node and not self.slots:
            return None
        if node == self.node:
            return self.slots[0].holder
        i = self.slot_of(node)
        if i is None:
            return None
        return self.slots[i + 1].holder if i + 1 < len(self.slots) else self.node

    def predecessor_of(self, i: int) -> NodeName:
        """Who sends into slot ``i``."""
        return self.slots[i - 1].holder if i > 0 else self.node

    def address_after(self, i: int) -> str:
        """Where slot ``i`` sends: the next slot, or (the tail) the return address."""
        return self.slots[i + 1].address if i + 1 < len(self.slots) else self.return_address


def peer_identity(conn: object) -> bytes | None:
    """The key ``conn``'s peer proved in its handshake; None on a plaintext wire."""
    who = getattr(conn, "authenticated", None)
    return who.identity if isinstance(who, Admitted) else None


def forward_reply(replies: trio.MemorySendChannel[Ready], reply: Ready, node: NodeName) -> None:
    """Hand a member's ``Ready`` to the order waiting for it; replies come one per order, so
    a full buffer means the member sent replies nobody asked for.

    Errors: ``ProtocolViolation`` then (its control link is closed)."""
    try:
        replies.send_nowait(reply)
    except trio.WouldBlock:
        raise ProtocolViolation(f"{node} sent a Ready that no order asked for") from None


__all__ = [
    "NO_BLOCK",
    "Member",
    "RecoveryFailed",
    "Registry",
    "Slot",
    "forward_reply",
    "peer_identity",
]
