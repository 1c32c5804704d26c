"""The scheduler's in-process messages: the problems it queues for itself, and what it tells
the coordinator's router while it repairs the ring.

None of these go on the wire (``shard.messages`` is the wire's union): they travel over Trio
memory channels inside the coordinator's process.

- ``NodeDead``, ``LinkLost``, ``Relink``, ``Rejoin``, ``Joined`` — the scheduler's own queue:
  a member died (closed control link or silence), a ring edge failed (reported by the node
  that sends on it, or by this coordinator's own ring link), a broken edge whose successor is
  still alive after the grace period (re-dial it), a node declared dead came back, and a node
  registered while a slot waits for one (try it);
- ``Pause``, ``Resume``, ``RingLost``, ``RingNote`` — scheduler -> router: requests wait
  instead of timing out; the ring is whole again (re-send); the ring cannot be repaired (fail
  every request); a ring event for the status feed (a node joined, a fault was reported).
"""

from __future__ import annotations

import attrs

from shard.messages import NodeName


@attrs.frozen
class NodeDead:
    """``node`` is dead; ``at`` is when it was last heard from (or its link closed)."""

    node: NodeName
    at: float


@attrs.frozen
class LinkLost:
    """The edge ``node`` -> ``successor`` failed at ``at`` (``node`` may be the coordinator)."""

    node: NodeName
    successor: NodeName
    at: float


@attrs.frozen
class Relink:
    """The edge ``node`` -> ``successor`` broke at ``at`` and ``successor`` is still alive and
    in place after the grace period: re-dial the same edge."""

    node: NodeName
    successor: NodeName
    at: float


@attrs.frozen
class Rejoin:
    """A node declared dead, whose slot nobody took, registered again: take it back."""

    node: NodeName
    at: float  # when it was lost


@attrs.frozen
class Joined:
    """``node`` registered while a ring slot waits for a node that can hold its block (no
    standby came within ``join_deadline_s``): see whether it, or anyone, can take it now."""

    node: NodeName


Problem = NodeDead | LinkLost | Relink | Rejoin | Joined


@attrs.frozen
class Pause:
    """The ring is being repaired (``detail`` says what broke): requests wait."""

    detail: str


@attrs.frozen
class Spliced:
    """Who replaced whom in which block, for the run receipts of the requests it crossed."""

    first: int
    last: int
    replaced: str
    by: str


@attrs.frozen
class Resume:
    """The ring is whole again (``detail``: who replaced what, how fast): requests re-send
    from their committed tokens in a new epoch. ``spliced``: the standby put in a dead node's
    place, if that was the repair (run receipts list it)."""

    detail: str
    spliced: Spliced | None = None


@attrs.frozen
class RingLost:
    """The ring cannot be repaired now: every request ends with the tokens it committed.
    The ring stays down until a ``Resume`` (a slot waiting for a node that can hold its block
    is spliced whenever one registers; ``detail`` then says what it waits for)."""

    detail: str


@attrs.frozen
class RingNote:
    """A ring event for the status feed (``kind``: ``join``, ``fault``, ``suspect``, ``audit``,
    ``mesh``)."""

    kind: str
    detail: str


RingControl = Pause | Resume | RingLost | RingNote

__all__ = [
    "Joined",
    "LinkLost",
    "NodeDead",
    "Pause",
    "Problem",
    "Rejoin",
    "Relink",
    "Resume",
    "RingControl",
    "RingLost",
    "RingNote",
    "Spliced",
]
