"""Control-plane messages between a node and the scheduler: registration, activation of a
standby, rewiring a predecessor after a splice, readiness.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName


@attrs.frozen
class Register:
    """Node -> scheduler, first message on a control link: who it is and what it holds.

    ``role`` is ``"stage"`` (in the ring, serving ``slot``), ``"standby"`` or ``"auditor"``
    (holds a block to audit, never spliced in); ``address`` is
    where it accepts its upstream; ``first``/``last`` the block it has loaded (both -1: a spare
    that loads the block it is given by ``Activate``, the cold path). A restarted coordinator
    learns the ring as it stands (spliced standbys included) from these.
    """

    node: NodeName
    role: str
    address: str
    first: int = -1
    last: int = -1
    slot: str = ""  # the ring slot (spec stage name) a stage serves; "" for a standby


@attrs.frozen
class Activate:
    """Scheduler -> standby: take ring slot ``slot`` (layers ``[first, last)``): dial
    ``successor`` (the next stage, or the coordinator's return endpoint for the tail) and serve
    whoever the scheduler rewires to you. Answered with ``Ready``."""

    slot: NodeName
    first: int
    last: int
    successor: str


@attrs.frozen
class Rewire:
    """Scheduler -> stage: re-dial the downstream link at ``address``. With ``replay`` the
    node first sends every live session's logged chunks as ``Prefill(replay=True)``, so a
    spliced-in standby rebuilds its KV. Answered with ``Ready``."""

    address: str
    replay: bool


@attrs.frozen
class Ready:
    """Node -> scheduler: an ``Activate`` or ``Rewire`` is done (``ok``) or failed (``detail``)."""

    node: NodeName
    action: str
    ok: bool = True
    detail: str = ""
