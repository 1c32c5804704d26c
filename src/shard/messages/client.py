"""Client messages: a generation request in, committed tokens streamed out, and the run's
statistics at the end.
"""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName
from shard.messages.receipts import RunReceipt
from shard.messages.values import Sampling


@attrs.frozen
class GenerateRequest:
    """A client asks the coordinator for a completion (``shard generate --spec``)."""

    request: int
    prompt: str
    max_tokens: int
    sampling: Sampling = Sampling()
    chat: bool = False
    receipt: bool = False  # ask for a signed run receipt (``GenerateDone.receipt``)
    k: int = -1  # drafted tokens per chunk for this request; -1: the swarm's policy, 0: plain
    depth: int = 0  # verify chunks in flight; 0: the swarm's policy
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks): EOS does not stop it
    #: the client's key for this request (random, ``[A-Za-z0-9_.-]{1,128}``; "": none): a
    #: standby coordinator that took over resumes the request under it
    resume: str = ""
    have: int = 0  # with ``resume``: output tokens the client already has (sent again: none)


@attrs.frozen
class TokensOut:
    """Newly committed tokens of a request, streamed to the client as they are committed."""

    request: int
    token_ids: tuple[int, ...]
    text: str


@attrs.frozen
class NodeStat:
    """Per-node totals for one request: compute seconds and chunks handled; ``queued_s`` the
    request's chunks' total wait at the node before their forward, ``batch_rows`` the mean
    rows of the forwards they rode in (all sessions together; 0: not reported)."""

    node: NodeName
    compute_s: float
    chunks: int
    queued_s: float = 0.0
    batch_rows: float = 0.0


@attrs.frozen
class EdgeStat:
    """Mean one-way transit of one ring edge over a request, from wall-clock hop stamps.

    Meaningful when the nodes share a clock (one host, or NTP-synced hosts); reported only.
    """

    src: NodeName
    dst: NodeName
    mean_s: float


@attrs.frozen
class RunStats:
    """What one request cost: tokens, wall seconds, laps through the ring, per-node compute."""

    tokens: int
    seconds: float
    tok_s: float
    prefill_s: float
    laps: int
    mean_lap_s: float
    nodes: tuple[NodeStat, ...] = ()
    edges: tuple[EdgeStat, ...] = ()
    drafted: int = 0
    accepted: int = 0
    tokens_per_lap: float = 0.0
    max_depth: int = 1
    stale_dropped: int = 0
    branches: int = 0  # branches sent beside a chunk (``shard.decode.speculation``)
    branches_won: int = 0  # of them, those whose guesses the target took


@attrs.frozen
class GenerateDone:
    """The end of a request. ``finish_reason`` is "stop" (EOS), "length" or "error"."""

    request: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stats: RunStats
    error: str = ""
    receipt: RunReceipt | None = None  # the signed run receipt, when asked for
