"""Typed messages: everything that crosses an actor boundary.

Every message is a frozen attrs class. Actors exchange them over trio memory channels when they
share a process and over the wire (``shard.wire``) when they do not; an actor never knows which.
Serialization lives only in ``shard.wire``; this module imports neither torch nor msgpack, so a
light process (the monitor, a fuzzer) can import it cheaply.

Flow of one request through the ring (plain decoding)::

    coordinator --OpenSession--> stage 0 --> ... --> tail      (each stage allocates KV)
    coordinator --Prefill*-----> stage 0 --h--> ... --> tail --Verdict--> coordinator
    coordinator --Verify-------> stage 0 --h--> ... --> tail --Verdict--> coordinator
    coordinator --EndSession---> stage 0 --> ... --> tail

``Prefill`` and ``Verify`` carry token ids (``ids``) on the first edge and hidden states
(``hidden``) on every later one; the tail turns its logits into token ids, so only small
integers travel back to the coordinator (direct return, one hop).
"""

from __future__ import annotations

from typing import NewType

import attrs

SessionId = NewType("SessionId", int)
Epoch = NewType("Epoch", int)
ChunkSeq = NewType("ChunkSeq", int)
NodeName = NewType("NodeName", str)

PROTOCOL_VERSION = 1

#: dtypes a ``Tensor`` payload may carry, with their item size in bytes.
TENSOR_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
}


@attrs.frozen
class Tensor:
    """A raw tensor payload: dtype name, shape and the row-major bytes.

    The wire sends ``data`` after the header, unencoded; ``shard.model.tensors`` converts to and
    from ``torch.Tensor`` without copying more than once.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")

    @property
    def nbytes(self) -> int:
        n = TENSOR_DTYPES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n


@attrs.frozen
class Sampling:
    """How the tail turns logits into a token. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


# --- handshake and control -------------------------------------------------------------------


@attrs.frozen
class Hello:
    """First message a dialer sends on a new connection."""

    node: NodeName
    role: str
    swarm: str
    protocol: int = PROTOCOL_VERSION


@attrs.frozen
class Welcome:
    """The listener's answer to ``Hello``: the connection is accepted."""

    node: NodeName
    role: str
    swarm: str
    protocol: int = PROTOCOL_VERSION


@attrs.frozen
class Heartbeat:
    """Sent on idle edges so a dead neighbour is noticed; ``sent_at`` is the sender's clock."""

    node: NodeName
    sent_at: float


@attrs.frozen
class Probe:
    """RTT probe; the receiver answers with ``ProbeReply`` carrying the same nonce."""

    nonce: int
    sent_at: float


@attrs.frozen
class ProbeReply:
    nonce: int
    sent_at: float


@attrs.frozen
class Fault:
    """A clear, typed error report. ``kind`` is a short machine-readable tag."""

    node: NodeName
    kind: str
    detail: str
    session: SessionId | None = None


# --- sessions and compute --------------------------------------------------------------------


@attrs.frozen
class OpenSession:
    """Allocate per-session state on every stage: KV cache of ``max_len``; the tail's sampler."""

    session: SessionId
    max_len: int
    sampling: Sampling = Sampling()


@attrs.frozen
class EndSession:
    """Free a session's state on every stage. Travels the ring like any chunk (FIFO)."""

    session: SessionId


@attrs.frozen
class Hop:
    """What one stage did for one chunk (for lap accounting)."""

    node: NodeName
    compute_s: float
    received_at: float
    sent_at: float


@attrs.frozen
class Prefill:
    """Prompt positions ``[start, start+n)``. Only the ``final`` chunk makes the tail answer.

    Exactly one of ``ids`` (first edge) and ``hidden`` (later edges) is set.
    """

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    final: bool
    ids: tuple[int, ...] = ()
    hidden: Tensor | None = None
    hops: tuple[Hop, ...] = ()


@attrs.frozen
class Verify:
    """Positions ``[start, start+len(ids))``: the last committed token then K draft tokens.

    ``draft`` repeats the K drafted ids (``ids[1:]`` on the first edge) because later stages
    only see hidden states and the tail must compare against them. The tail answers with a
    ``Verdict`` holding the target's choice at every position. With no draft (plain decoding)
    this is a one-token decode step.
    """

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    ids: tuple[int, ...] = ()
    hidden: Tensor | None = None
    draft: tuple[int, ...] = ()
    hops: tuple[Hop, ...] = ()


@attrs.frozen
class Verdict:
    """Tail -> coordinator (direct return): target ids for the chunk and how many drafts held."""

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    target_ids: tuple[int, ...]
    accepted: int
    hops: tuple[Hop, ...] = ()


# --- clients ----------------------------------------------------------------------------------


@attrs.frozen
class GenerateRequest:
    """A client asks the coordinator for a completion (``shard generate --spec``)."""

    request: int
    prompt: str
    max_tokens: int
    sampling: Sampling = Sampling()
    chat: bool = False


@attrs.frozen
class TokensOut:
    """Newly committed tokens of a request, streamed to the client as they are committed."""

    request: int
    token_ids: tuple[int, ...]
    text: str


@attrs.frozen
class NodeStat:
    """Per-node totals for one request: compute seconds and chunks handled."""

    node: NodeName
    compute_s: float
    chunks: int


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


@attrs.frozen
class GenerateDone:
    """The end of a request. ``finish_reason`` is "stop" (EOS), "length" or "error"."""

    request: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stats: RunStats
    error: str = ""


Message = (
    Hello
    | Welcome
    | Heartbeat
    | Probe
    | ProbeReply
    | Fault
    | OpenSession
    | EndSession
    | Prefill
    | Verify
    | Verdict
    | GenerateRequest
    | TokensOut
    | GenerateDone
)

#: Every concrete message class, in a fixed order (the wire's tag table is derived from names).
MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    Welcome,
    Heartbeat,
    Probe,
    ProbeReply,
    Fault,
    OpenSession,
    EndSession,
    Prefill,
    Verify,
    Verdict,
    GenerateRequest,
    TokensOut,
    GenerateDone,
)
