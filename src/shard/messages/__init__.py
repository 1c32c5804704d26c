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

One module per conversation::

    ring.py      the handshake on every link, heartbeats, probes, and what flows round the ring
    client.py    a generation request in, committed tokens out, the run's statistics
    follow.py    a standby coordinator following the primary's committed tokens
    control.py   a node and the scheduler: registration, profiles, rewiring, RTT reports
    fetch.py     a joining node and a seeder: manifest chunks
    audit.py     spot checks: audited chunks, inclusion proofs, signed evidence
    receipts.py  signed receipts: a stage's account of a job, the coordinator's of a run
    status.py    the coordinator's live snapshot for monitors
    reach.py     the relay's signalling link (nodes behind NAT)
    values.py    value types inside messages: tensor payloads, sampling parameters
    ids.py       ids, protocol constants, the dtypes a tensor may carry
    bounds.py    the one table of bounds on every number a generation request carries
"""

from __future__ import annotations

from shard.messages.audit import (
    AuditCopy,
    AuditRequest,
    AuditVerdict,
)
from shard.messages.client import (
    EdgeStat,
    GenerateDone,
    GenerateRequest,
    NodeStat,
    RunStats,
    TokensOut,
)
from shard.messages.control import (
    Activate,
    MeasureRtt,
    NodeProfile,
    Ready,
    Register,
    Rewire,
    RttReport,
)
from shard.messages.fetch import (
    ChunkData,
    ChunkMissing,
    ChunkRequest,
)
from shard.messages.follow import (
    FollowCommit,
    FollowEnd,
)
from shard.messages.ids import (
    HANDSHAKE_TIMEOUT_S,
    MAX_FEATURE_LAYERS,
    MAX_FEATURES,
    MAX_TAIL_DRAFTS,
    PROTOCOL_VERSION,
    RUN_DTYPES,
    SESSION_BITS,
    TENSOR_DTYPES,
    ChunkSeq,
    Epoch,
    NodeName,
    SessionId,
    incarnation_of,
)
from shard.messages.reach import (
    CallMe,
    CallPlaced,
    CallRequest,
)
from shard.messages.receipts import (
    EdgeRecord,
    ResumeRecord,
    RunReceipt,
    SpliceRecord,
    StageReceipt,
    VerdictRecord,
)
from shard.messages.ring import (
    EndSession,
    Fault,
    Heartbeat,
    Hello,
    Hop,
    OpenSession,
    Prefill,
    Probe,
    ProbeReply,
    StageReceiptOut,
    Truncate,
    Verdict,
    Verify,
    Welcome,
)
from shard.messages.status import (
    AuditCounts,
    DeviceStatus,
    EdgeStatus,
    EventRecord,
    StageReport,
    StageStatus,
    StatusReset,
    StatusSnapshot,
)
from shard.messages.values import (
    DraftQ,
    Sampling,
    Tensor,
)

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
    | StageReport
    | AuditCopy
    | AuditRequest
    | AuditVerdict
    | MeasureRtt
    | RttReport
    | CallRequest
    | CallMe
    | CallPlaced
    | FollowCommit
    | FollowEnd
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
    StageReport,
    AuditCopy,
    AuditRequest,
    AuditVerdict,
    MeasureRtt,
    RttReport,
    CallRequest,
    CallMe,
    CallPlaced,
    FollowCommit,
    FollowEnd,
)

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_FEATURES",
    "MAX_FEATURE_LAYERS",
    "MAX_TAIL_DRAFTS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "RUN_DTYPES",
    "SESSION_BITS",
    "TENSOR_DTYPES",
    "Activate",
    "AuditCopy",
    "AuditCounts",
    "AuditRequest",
    "AuditVerdict",
    "CallMe",
    "CallPlaced",
    "CallRequest",
    "ChunkData",
    "ChunkMissing",
    "ChunkRequest",
    "ChunkSeq",
    "DeviceStatus",
    "DraftQ",
    "EdgeRecord",
    "EdgeStat",
    "EdgeStatus",
    "EndSession",
    "Epoch",
    "EventRecord",
    "Fault",
    "FollowCommit",
    "FollowEnd",
    "GenerateDone",
    "GenerateRequest",
    "Heartbeat",
    "Hello",
    "Hop",
    "MeasureRtt",
    "Message",
    "NodeName",
    "NodeProfile",
    "NodeStat",
    "OpenSession",
    "Prefill",
    "Probe",
    "ProbeReply",
    "Ready",
    "Register",
    "ResumeRecord",
    "Rewire",
    "RttReport",
    "RunReceipt",
    "RunStats",
    "Sampling",
    "SessionId",
    "SpliceRecord",
    "StageReceipt",
    "StageReceiptOut",
    "StageReport",
    "StageStatus",
    "StatusReset",
    "StatusSnapshot",
    "Tensor",
    "TokensOut",
    "Truncate",
    "Verdict",
    "VerdictRecord",
    "Verify",
    "Welcome",
    "incarnation_of",
]
