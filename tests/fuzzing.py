"""Frames for fuzz tests: valid encodings of real messages, and seeded mutations of them.

Shared by ``test_fuzz_endpoint`` (stages in this process) and ``test_fuzz_links`` (every link
kind of live processes). ``Frames(rng, swarm)`` draws from one seeded ``random.Random``, so a
printed seed replays a run; ``malformed(frames)`` draws one frame the wire must refuse (random
bytes and mutations that no longer decode, text frames, zstd bombs, negative fields, frames
over the cap); ``raw_ws(address)`` is a bare WebSocket to throw them down. ``test_fuzz_fetch``
(a live seeder) uses them too.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
import trio
import trio_websocket
import zstandard

from shard.compute.tensors import to_wire
from shard.messages import (
    AuditCopy,
    AuditRequest,
    AuditVerdict,
    ChunkSeq,
    EndSession,
    Epoch,
    Fault,
    GenerateRequest,
    Heartbeat,
    Hello,
    MeasureRtt,
    Message,
    NodeName,
    Prefill,
    Probe,
    ProbeReply,
    RttReport,
    SessionId,
    Tensor,
    TokensOut,
    Verdict,
    Verify,
    Welcome,
)
from shard.messages.audit import AuditedChunk, Blob, ChainProof
from shard.transport.websocket import max_message_size
from shard.wire import WireError, WireLimits, decode, encode
from shard.wire.frame import HEADER_ZSTD, PREFIX, WIRE_VERSION

HIDDEN = 64  # hidden size of the tiny checkpoints
#: Fuzzed sessions are >= this, so they never touch the coordinator's own (1, 2, 3, ...).
SAFE_SESSION = 1_000_000


# --- frames ----------------------------------------------------------------------------------


class Frames:
    """Seeded source of frames: valid encodings of real messages, and mutations of them."""

    def __init__(self, rng: random.Random, swarm: str = "fuzz") -> None:
        self.rng = rng
        self.swarm = swarm

    def session(self) -> SessionId:
        return SessionId(SAFE_SESSION + self.rng.randrange(1 << 20))

    def ids(self, most: int = 8) -> tuple[int, ...]:
        return tuple(self.rng.randrange(300) for _ in range(self.rng.randint(1, most)))

    def hidden(self) -> Tensor:
        s = self.rng.randint(1, 3)
        values = torch.randn(1, s, HIDDEN, generator=torch.Generator().manual_seed(s))
        return to_wire(values)

    def message(self) -> Message:
        r, sid = self.rng, self.session()
        epoch, seq, start = Epoch(r.randrange(4)), ChunkSeq(r.randrange(100)), r.randrange(300)
        choices: list[Callable[[], Message]] = [
            lambda: Prefill(sid, epoch, seq, start, r.random() < 0.5, ids=self.ids()),
            lambda: Prefill(sid, epoch, seq, start, r.random() < 0.5, hidden=self.hidden()),
            lambda: Prefill(
                sid, epoch, seq, start, False, hidden=self.hidden(), tail_ids=self.ids(80)
            ),
            lambda: Verify(sid, epoch, seq, start, ids=self.ids(3), draft=self.ids(2)),
            lambda: Verify(sid, epoch, seq, start, hidden=self.hidden()),
            lambda: Verdict(sid, epoch, seq, start, target_ids=self.ids(3), accepted=0),
            lambda: Verdict(sid, epoch, seq, start, self.ids(3), 0, drafts=self.ids(40)),
            lambda: EndSession(sid),
            lambda: Fault(NodeName("evil"), "chunk", "made up", session=sid),
            lambda: Hello(NodeName("evil"), "stage", self.swarm),
            lambda: Welcome(NodeName("evil"), "stage", self.swarm),
            lambda: Heartbeat(NodeName("evil"), sent_at=r.random()),
            lambda: Probe(r.randrange(1 << 30), r.random()),
            lambda: ProbeReply(r.randrange(1 << 30), r.random()),
            lambda: GenerateRequest(r.randrange(100), "hi there", 4),
            lambda: TokensOut(r.randrange(100), self.ids(), "text"),
            lambda: AuditCopy("sent", "chunk", r.randrange(9), sid, hidden=self.hidden()),
            lambda: AuditVerdict(
                NodeName("s1"), NodeName("evil"), sid, 0, False, "exact", None, ""
            ),
            lambda: self.audit_request(sid),
            lambda: MeasureRtt(("s1", "coord"), ("127.0.0.1:9", "127.0.0.1:9"), 3),
            lambda: RttReport(NodeName("evil"), ("s1",), (r.random(),)),
        ]
        return r.choice(choices)()

    def audit_request(self, sid: SessionId) -> AuditRequest:
        blob = Blob("float32", (1, 1, 1), "AAAAAA==")
        chunk = AuditedChunk(0, 0, 0, ids=self.ids())
        return AuditRequest(
            NodeName("s1"), "00" * 32, 0, 2, sid, 0, "00" * 32, "00" * 32, 1.0, (), chunk, blob,
            ChainProof("00" * 32), ChainProof("00" * 32), "cpu", "float32",
        )  # fmt: skip

    def valid(self) -> bytes:
        return encode(self.message(), compress=self.rng.random() < 0.5)

    def mutated(self) -> bytes:
        frame = bytearray(self.valid())
        for _ in range(self.rng.randint(1, 3)):
            frame = self.rng.choice(MUTATIONS)(self.rng, frame)
        return bytes(frame)

    def garbage(self) -> bytes:
        r = self.rng
        if r.random() < 0.1:
            return b""
        return r.randbytes(r.randint(1, 300))

    def any(self) -> bytes:
        return self.mutated() if self.rng.random() < 0.8 else self.garbage()


def _flip(r: random.Random, f: bytearray) -> bytearray:
    for _ in range(r.randint(1, 8)):
        if f:
            i = r.randrange(len(f))
            f[i] ^= 1 << r.randrange(8)
    return f


def _truncate(r: random.Random, f: bytearray) -> bytearray:
    return f[: r.randrange(len(f))] if f else f


def _extend(r: random.Random, f: bytearray) -> bytearray:
    return f + r.randbytes(r.randint(1, 64))


def _overwrite(r: random.Random, f: bytearray) -> bytearray:
    if f:
        i = r.randrange(len(f))
        f[i : i + 4] = r.randbytes(4)
    return f


def _prefix(r: random.Random, f: bytearray) -> bytearray:
    """Corrupt the 6-byte prefix: version, flags or the declared header length."""
    if len(f) >= 6:
        field = r.randrange(3)
        if field == 2:
            f[2:6] = r.randrange(1 << 32).to_bytes(4, "big")
        else:
            f[field] = r.randrange(256)
    return f


def _splice(r: random.Random, f: bytearray) -> bytearray:
    if len(f) < 2:
        return f
    a, b = sorted(r.sample(range(len(f)), 2))
    return f[:a] + f[b:] if r.random() < 0.5 else f[:b] + f[a:]


MUTATIONS = (_flip, _truncate, _extend, _overwrite, _prefix, _splice)

#: Message types a stage may receive from upstream, fuzzed, without hurting other sessions:
#: computes and ends for unknown sessions fault or pass by; the rest a stage ignores.
HARMLESS = (
    Prefill,
    Verify,
    Verdict,
    EndSession,
    Fault,
    Hello,
    Welcome,
    Heartbeat,
    Probe,
    ProbeReply,
    GenerateRequest,
    TokensOut,
    AuditCopy,  # control-link messages a stage's ring link ignores
    AuditRequest,
    AuditVerdict,
    MeasureRtt,  # a joining node's mesh, on the control link only
    RttReport,
)


def decoded(frame: bytes) -> Message | None:
    """What the stage will make of ``frame``: the message, or None when it cannot decode."""
    try:
        return decode(frame)
    except WireError:
        return None


def harmless(msg: Message) -> bool:
    """Whether a stage may be fed ``msg`` while an honest session shares it."""
    if not isinstance(msg, HARMLESS):
        return False  # OpenSession would take capacity; anything else is not fuzzed
    session = getattr(msg, "session", SAFE_SESSION)
    if session is None:
        return False  # a ring-wide Fault: the coordinator would declare the ring down
    return bool(session >= SAFE_SESSION)


# --- frames every link must refuse ------------------------------------------------------


def zstd_bomb(rng: random.Random) -> bytes:
    """A frame whose compressed header declares (or inflates to) far more than allowed."""
    inflated = b"\x00" * rng.choice((2 << 20, 8 << 20))
    packed = zstandard.ZstdCompressor(level=1, write_content_size=rng.random() < 0.5).compress(
        inflated
    )
    return PREFIX.pack(WIRE_VERSION, HEADER_ZSTD, len(packed)) + packed


def negative(rng: random.Random) -> bytes:
    """A header that decodes as msgpack but holds a negative count or position."""
    import msgpack

    field = rng.choice(["session", "seq", "start", "max_tokens", "request", "epoch"])
    header = msgpack.packb({"t": rng.choice(["Prefill", "GenerateRequest", "Verdict"]), field: -1})
    return PREFIX.pack(WIRE_VERSION, 0, len(header)) + header


def oversized(rng: random.Random) -> bytes:
    """Larger than the frame cap (the transport refuses it before decoding: close 1009)."""
    return b"\x01" + bytes(max_message_size(WireLimits()) + rng.randint(1, 4096))


def malformed(frames: Frames) -> bytes | str:
    """One frame the wire must refuse."""
    r = frames.rng.random()
    if r < 0.03:
        return "a text frame"
    if r < 0.05:
        return zstd_bomb(frames.rng)
    if r < 0.09:
        return negative(frames.rng)
    if r < 0.0905:
        return oversized(frames.rng)
    while True:
        frame = frames.any()
        if decoded(frame) is None:
            return frame


# --- a raw connection -------------------------------------------------------------------


@asynccontextmanager
async def raw_ws(address: str) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    host, _, port = address.rpartition(":")
    async with (
        await trio.open_tcp_stream(host, int(port)) as stream,
        trio.open_nursery() as nursery,
    ):
        yield await trio_websocket.wrap_client_stream(
            nursery, stream, address, "/", max_message_size=2 * max_message_size(WireLimits())
        )
        nursery.cancel_scope.cancel()
