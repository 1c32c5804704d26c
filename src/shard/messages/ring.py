"""Ring messages: the handshake on every link, heartbeats and probes, and what flows
through the stages (sessions, prefill, verify) and back from the tail (``Verdict``).
"""

from __future__ import annotations

import attrs

from shard.messages.ids import PROTOCOL_VERSION, ChunkSeq, Epoch, NodeName, SessionId
from shard.messages.receipts import StageReceipt
from shard.messages.values import DraftQ, Sampling, Tensor


@attrs.frozen
class Hello:
    """First message a dialer sends on a new connection."""

    node: NodeName
    role: str
    swarm: str
    protocol: int = PROTOCOL_VERSION
    link: str = "ring"  # "ring" (a ring edge or the return link), "control", "follow"
    #: a coordinator's generation (docs/failover.md, "Standby coordinator"): a stage refuses a
    #: ring link from a lower one than it has seen; 0 from every other node
    generation: int = 0


@attrs.frozen
class Welcome:
    """The listener's answer to ``Hello``: the connection is accepted."""

    node: NodeName
    role: str
    swarm: str
    protocol: int = PROTOCOL_VERSION
    generation: int = 0  # a coordinator's (as ``Hello.generation``): a control link checks it


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


@attrs.frozen
class OpenSession:
    """Allocate per-session state on every stage: KV cache of ``max_len``; the tail's sampler.

    ``features`` (0 to ``MAX_FEATURES``) asks the tail to return the target's features with
    each verdict, at most that many rows (``Verdict.features``); 0, the default, returns
    none, and the session's frames are byte for byte those of a build without features.

    ``feature_layers`` (strictly increasing global layer indices, at most
    ``MAX_FEATURE_LAYERS``, only with ``features``): the features are then the residual
    stream *entering* each of those layers, side by side in that order (``[rows, len x
    hidden]``, what an EAGLE-3 head reads) instead of the final norm's output. The stage
    holding a layer captures its rows and they ride the forward path to the tail
    (``Prefill.states``, ``Verify.states``); empty, the default, changes nothing.

    ``drafts`` (0 to ``MAX_TAIL_DRAFTS``) asks the tail to run the checkpoint's MTP block
    after its last layer and return that many draft ids with each verdict
    (``Verdict.drafts``; ``shard.stage.tail_drafts``); the tail reads its own features, so
    none travel, and a tail without the block refuses the session. Not with ``features``.
    """

    session: SessionId
    max_len: int
    sampling: Sampling = Sampling()
    job: str = ""  # with ``nonce``: the job each stage signs a receipt for ("" = no receipt)
    nonce: str = ""
    features: int = 0
    feature_layers: tuple[int, ...] = ()
    drafts: int = 0
    #: set only on the copy an edge's sender replays to a spliced-in standby: its chain over
    #: what it sent the replaced node for this job, where the standby's input chain begins
    receipt_base: str = ""


@attrs.frozen
class StageReceiptOut:
    """A stage's signed receipt for a session, sent downstream at ``EndSession`` and relayed
    by later stages to the coordinator."""

    session: SessionId
    receipt: StageReceipt


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
    """What one stage did for one chunk (for lap accounting).

    ``compute_s`` is the forward the chunk rode in (shared by every chunk of a batch);
    ``queued_s`` how long the chunk waited at the stage before it; ``batch_rows`` the rows that
    forward ran, all sessions together (0: not reported); ``forward`` the stage's count of
    forwards, this one included (chunks of one batch share it; 0: not reported).
    """

    node: NodeName
    compute_s: float
    received_at: float
    sent_at: float
    queued_s: float = 0.0
    batch_rows: int = 0
    forward: int = 0


@attrs.frozen
class Prefill:
    """Prompt positions ``[start, start+n)``. Only the ``final`` chunk makes the tail answer.

    Exactly one of ``ids`` (first edge) and ``hidden`` (later edges) is set. A ``replay``
    chunk re-sends what was sent before to a spliced-in node: it rebuilds that node's KV and
    goes no further (shard.failover.replay). ``states``: the session's feature-layer states
    captured upstream (``OpenSession.feature_layers``; ``shard.stage.features``), else None.
    ``tail_ids``: for a session whose tail drafts (``OpenSession.drafts``), the chunk's last
    ids (at most ``MAX_FEATURES``), which every stage passes on unchanged: the tail's MTP
    block reads the prompt's tokens, and only the first stage sees ``ids``.
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
    states: Tensor | None = None
    tail_ids: tuple[int, ...] = ()


@attrs.frozen
class Verify:
    """Positions ``[start, start+len(ids))``: the last committed token then K draft tokens.

    ``draft`` repeats the K drafted ids (``ids[1:]`` on the first edge) because later stages
    only see hidden states and the tail must compare against them. The tail answers with a
    ``Verdict`` holding the target's choice at every position. With no draft (plain decoding)
    this is a one-token decode step. ``q``, empty or one per drafted id, is the draft's
    distribution each was sampled from (``DraftQ``); every stage passes it on to the tail.
    ``states`` as ``Prefill.states``.
    """

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    ids: tuple[int, ...] = ()
    hidden: Tensor | None = None
    draft: tuple[int, ...] = ()
    hops: tuple[Hop, ...] = ()
    q: tuple[DraftQ, ...] = ()
    states: Tensor | None = None


@attrs.frozen
class Verdict:
    """Tail -> coordinator (direct return): target ids for the chunk and how many drafts held.

    ``features`` (only for a session opened with ``features > 0``; else None): the target's
    final hidden state after the final RMSNorm — the vector its head multiplies into logits —
    at stream positions ``features_start .. features_start + rows - 1``, a ``[rows, hidden]``
    tensor in bfloat16 when the tail computes in bfloat16, else float16. Row ``i`` is what the
    tail read to choose the token at position ``features_start + i + 1``, so the last row
    chose the verdict's last target id, and every row's input is committed once the verdict
    is folded in:

    - a ``Verify`` chunk: ``rows = min(features, len(target_ids))``, ending at its last
      committed input (``features_start + rows == start + len(target_ids)``);
    - the prompt's final ``Prefill`` chunk: up to ``min(features, len(prompt))`` rows ending
      at the prompt's last position (``features_start + rows == len(prompt)``), taken from
      the earlier prompt chunks too (the tail keeps each chunk's last rows); fewer only if the
      tail did not see the earlier chunks (it joined mid-prompt).

    With ``OpenSession.feature_layers`` the rows are the same positions' states entering those
    layers, side by side: ``[rows, len(layers) x hidden]``.

    ``drafts`` (only for a session opened with ``drafts > 0``; else empty): the tail's MTP
    block's guesses for the positions right after the verdict's last committed id, at most
    ``OpenSession.drafts`` of them (``shard.stage.tail_drafts``).
    """

    session: SessionId
    epoch: Epoch
    seq: ChunkSeq
    start: int
    target_ids: tuple[int, ...]
    accepted: int
    hops: tuple[Hop, ...] = ()
    features: Tensor | None = None
    features_start: int = 0
    drafts: tuple[int, ...] = ()
