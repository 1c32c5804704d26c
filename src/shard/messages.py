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
#: A session id is ``incarnation << SESSION_BITS | n``: each coordinator start draws a new
#: incarnation, so stages recognise (and free) sessions a coordinator that died left behind.
SESSION_BITS = 32

#: dtypes a ``Tensor`` payload may carry, with their item size in bytes.
TENSOR_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,  # raw bytes: manifest chunks (ChunkData)
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
    link: str = "ring"  # "ring" (a ring edge or the return link) or "control" (to the scheduler)


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
    epoch: Epoch | None = None  # the session's epoch the fault was seen in (stale ones are ignored)


# --- supervision and failover (node <-> scheduler, on the control link) -----------------------


@attrs.frozen
class Register:
    """Node -> scheduler, first message on a control link: who it is and what it holds.

    ``role`` is ``"stage"`` (in the ring, serving ``slot``) or ``"standby"``; ``address`` is
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


# --- sessions and compute --------------------------------------------------------------------


@attrs.frozen
class OpenSession:
    """Allocate per-session state on every stage: KV cache of ``max_len``; the tail's sampler."""

    session: SessionId
    max_len: int
    sampling: Sampling = Sampling()
    job: str = ""  # with ``nonce``: the job each stage signs a receipt for ("" = no receipt)
    nonce: str = ""


@attrs.frozen
class StageReceiptOut:
    """A stage's signed receipt for a session (JSON of ``shard.receipts.StageReceipt``),
    sent downstream at ``EndSession`` and relayed by later stages to the coordinator."""

    session: SessionId
    receipt: str


@attrs.frozen
class EndSession:
    """Free a session's state on every stage. Travels the ring like any chunk (FIFO)."""

    session: SessionId


@attrs.frozen
class Truncate:
    """The coordinator bumped a session's epoch: queued chunks of older epochs are stale.

    Sent right after a rejection, ahead of the re-drafted chunk, so every stage can skip
    stale chunks still waiting in its queue (early cancellation). Positions at and after
    ``position`` written by older epochs will be overwritten before they are read.
    """

    session: SessionId
    epoch: Epoch
    position: int


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

    Exactly one of ``ids`` (first edge) and ``hidden`` (later edges) is set. A ``replay``
    chunk re-sends what was sent before to a spliced-in node: it rebuilds that node's KV and
    goes no further (shard.replay).
    """

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    final: bool
    ids: tuple[int, ...] = ()
    hidden: Tensor | None = None
    hops: tuple[Hop, ...] = ()
    replay: bool = False


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
    receipt: bool = False  # ask for a signed run receipt (``GenerateDone.receipt``)
    k: int = -1  # drafted tokens per chunk for this request; -1: the swarm's policy, 0: plain
    depth: int = 0  # verify chunks in flight; 0: the swarm's policy


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
    drafted: int = 0
    accepted: int = 0
    tokens_per_lap: float = 0.0
    max_depth: int = 1
    stale_dropped: int = 0


@attrs.frozen
class GenerateDone:
    """The end of a request. ``finish_reason`` is "stop" (EOS), "length" or "error"."""

    request: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    stats: RunStats
    error: str = ""
    receipt: str = ""  # JSON of ``shard.receipts.RunReceipt`` when asked for


# --- status feed (coordinator -> monitors) ---------------------------------------------------


@attrs.frozen
class EdgeStatus:
    """One ring edge's one-way transit over the recent window, in seconds: the last sample and
    the median; None before the first sample. Taken from the wall-clock stamps in ``Hop``, so
    only meaningful when the nodes share a clock (one host, or NTP-synced hosts)."""

    src: NodeName
    dst: NodeName
    last_s: float | None = None
    median_s: float | None = None


@attrs.frozen
class StageStatus:
    """One stage's compute per chunk over the recent window (seconds; None before a sample).

    ``chunks`` counts the samples in the window; ``queue`` is the stage's inbox depth, None
    while stages do not report it (a monitor shows it as unknown, never as 0).
    """

    node: NodeName
    compute_last_s: float | None = None
    compute_median_s: float | None = None
    chunks: int = 0
    queue: int | None = None


@attrs.frozen
class EventRecord:
    """Something that happened to the ring (join, fault, splice, epoch, reset); ``at`` is the
    coordinator's wall clock."""

    at: float
    kind: str
    detail: str


@attrs.frozen
class StatusSnapshot:
    """The coordinator's view of the ring, published to monitors a few times a second.

    ``seq`` counts snapshots since the coordinator started at ``started`` (wall clock; a new
    value means the coordinator restarted). ``ring`` is the node order from the coordinator
    round to the last stage; ``edges`` follow it, closing back at the coordinator. Rolling
    values cover the last laps of every request: ``lap_*`` are full laps (the ring's round
    trip), ``alpha`` is accepted / drafted (None before a draft was verified), ``tok_s``
    counts committed tokens over the last seconds. ``tokens``, ``requests_*`` are totals.
    """

    swarm: str
    coordinator: NodeName
    seq: int
    at: float
    started: float
    ring: tuple[NodeName, ...]
    edges: tuple[EdgeStatus, ...]
    stages: tuple[StageStatus, ...]
    laps: int
    lap_last_s: float | None
    lap_median_s: float | None
    tokens_per_lap: float | None
    drafted: int
    accepted: int
    alpha: float | None
    k: int
    depth: int
    tok_s: float
    tokens: int
    sessions: int
    requests_done: int
    requests_failed: int
    standbys: tuple[NodeName, ...] = ()
    events: tuple[EventRecord, ...] = ()


@attrs.frozen
class StatusReset:
    """Monitor -> coordinator: clear the rolling statistics (the monitor's reset binding).

    The only thing a monitor may ask; the coordinator logs it as a ``reset`` event.
    """

    node: NodeName


# --- verified fetch (fetcher -> seeder; shard.fetch, shard.seeder) ---------------------------


@attrs.frozen
class ChunkRequest:
    """Fetcher -> seeder: send chunk ``index`` of ``file`` of the manifest whose root is ``root``.

    One request, one answer (``ChunkData`` or ``ChunkMissing``), in order, per connection.
    """

    root: str
    file: str
    index: int


@attrs.frozen
class ChunkData:
    """Seeder -> fetcher: the chunk's bytes (a ``uint8`` tensor of shape ``(len,)``).

    Untrusted until the fetcher has checked it against the signed manifest's chunk hash.
    """

    root: str
    file: str
    index: int
    data: Tensor


@attrs.frozen
class ChunkMissing:
    """Seeder -> fetcher: this seeder cannot serve that chunk (``reason`` says why)."""

    root: str
    file: str
    index: int
    reason: str


Message = (
    Hello
    | Welcome
    | Heartbeat
    | Probe
    | ProbeReply
    | Fault
    | Register
    | Activate
    | Rewire
    | Ready
    | OpenSession
    | EndSession
    | StageReceiptOut
    | Truncate
    | Prefill
    | Verify
    | Verdict
    | GenerateRequest
    | TokensOut
    | GenerateDone
    | StatusSnapshot
    | StatusReset
    | ChunkRequest
    | ChunkData
    | ChunkMissing
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
    StageReceiptOut,
    Truncate,
    Prefill,
    Register,
    Activate,
    Rewire,
    Ready,
    Verify,
    Verdict,
    GenerateRequest,
    TokensOut,
    GenerateDone,
    StatusSnapshot,
    StatusReset,
    ChunkRequest,
    ChunkData,
    ChunkMissing,
)
