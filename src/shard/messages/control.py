"""Control-plane messages between a node and the scheduler: registration (with a joining
node's measured profile), the RTT mesh a joining node measures for placement, activation of a
standby, rewiring a predecessor after a splice, readiness.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName


@attrs.frozen
class NodeProfile:
    """What a node started with ``--join`` tells the scheduler about itself, for placement:
    its device (a label, printed only), the memory it offers for weights (bytes, net of its
    KV cache), and its measured compute per layer (ms) for a 1-token chunk and for a
    ``chunk_tokens``-token verify chunk (K+1), timed on its own device at start-up.

    The node's word, checked for shape only (``shard.formation.registration``): a node can claim
    to be fast, never to be trusted (trust comes from the coordinator's spec)."""

    device: str
    memory_bytes: int
    ms_per_layer_one: float
    ms_per_layer_chunk: float
    chunk_tokens: int


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
    profile: NodeProfile | None = None  # a node started with --join (None: a spec's node)


@attrs.frozen
class MeasureRtt:
    """Scheduler -> joining node: measure the round trip to each of ``addresses`` (the other
    candidates' listen addresses and the coordinator's, named ``names``) with ``probes``
    ``Probe``/``ProbeReply`` exchanges each, and answer ``RttReport``."""

    names: tuple[str, ...]
    addresses: tuple[str, ...]
    probes: int


@attrs.frozen
class RttReport:
    """Node -> scheduler: the median round trip (ms) to each of ``names``, in the order asked;
    -1.0 for a peer it could not reach."""

    node: NodeName
    names: tuple[str, ...]
    rtt_ms: tuple[float, ...]


@attrs.frozen
class Activate:
    """Scheduler -> standby: take ring slot ``slot`` (layers ``[first, last)``): dial
    ``successor`` (the next stage, or the coordinator's return endpoint for the tail) and serve
    whoever the scheduler rewires to you. Answered with ``Ready``.

    ``behind_nat``: the scheduler found that nobody reaches this node (a joined one) at its
    listen address: before anything else, register at the relay (it is dialled at
    ``nat:NAME`` from now on) and dial ``nat:`` addresses through the relay."""

    slot: NodeName
    first: int
    last: int
    successor: str
    behind_nat: bool = False


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
