"""The pieces failover rests on, in isolation: the replay log's pruning, and a stage's guards
(never compute on missing KV, keep KV on a repeated OpenSession, replay chunks go nowhere,
sessions of a dead coordinator are freed)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import trio

from shard.failover.replay import ReplayLog
from shard.messages import (
    SESSION_BITS,
    ChunkSeq,
    EndSession,
    Epoch,
    Fault,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Verdict,
    Verify,
)
from shard.model.loader import load_stage
from shard.stage.config import ExecutorConfig
from shard.stage.executor import StageExecutor
from shard.testing import make_tiny_checkpoint

S = SessionId(7)


def verify(start: int, n: int, epoch: int = 0, seq: int = 0) -> Verify:
    return Verify(S, Epoch(epoch), ChunkSeq(seq), start, ids=tuple(range(1, n + 1)))


def test_replay_log_keeps_what_later_chunks_were_computed_against() -> None:
    log = ReplayLog()
    log.record(OpenSession(S, max_len=64))
    log.record(Prefill(S, Epoch(0), ChunkSeq(0), 0, True, ids=(1, 2, 3, 4)))
    log.record(verify(4, 3, seq=1))  # [4, 7)
    log.record(verify(7, 3, seq=2))  # [7, 10)
    log.record(verify(6, 2, epoch=1, seq=3))  # rejection: [6, 8) rewrites from 6 on
    starts = [c.start for c in log.chunks(S)]
    # [7, 10) started after 6: dropped (nothing kept read it); [4, 7) is kept whole.
    assert starts == [0, 4, 6]
    replay = list(log.replay())
    assert replay[0] == OpenSession(S, max_len=64)
    assert [m.start for m in replay[1:] if isinstance(m, Prefill)] == [0, 4, 6]
    assert all(isinstance(m, Prefill) and m.replay and not m.final for m in replay[1:])
    log.record(EndSession(S))
    assert list(log.replay()) == [] and not log.replayable(S)


def test_replay_log_bound_drops_the_session_not_the_edge() -> None:
    log = ReplayLog(max_bytes=8 * 10)
    log.record(OpenSession(S, max_len=64))
    log.record(verify(0, 8))
    assert log.replayable(S)
    log.record(verify(8, 8, seq=1))  # 16 ids: past the bound
    assert not log.replayable(S)
    assert log.statistics().dropped == 1 and log.statistics().nbytes == 0


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=21, n_layers=2)


async def run_stage(block: Path, msgs: list[Message]) -> tuple[list[Message], StageExecutor]:
    model = load_stage(block, 0, 2, dtype=torch.float32)  # first and last: a whole ring
    inbox_send, inbox_recv = trio.open_memory_channel[Message](100)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](100)
    executor = StageExecutor(model, ExecutorConfig(NodeName("s")), inbox_recv, outbox_send)
    for msg in msgs:
        inbox_send.send_nowait(msg)
    inbox_send.close()
    with trio.fail_after(30):
        await executor.run()
    out = []
    async with outbox_recv:
        async for msg in outbox_recv:
            out.append(msg)
    return out, executor


async def test_stage_reports_a_gap_instead_of_computing_on_missing_kv(block: Path) -> None:
    out, _ = await run_stage(
        block,
        [
            OpenSession(S, max_len=64),
            Prefill(S, Epoch(0), ChunkSeq(0), 0, True, ids=(1, 2, 3)),
            verify(5, 1, seq=1),  # positions 3, 4 were never written here
            Verify(SessionId(99), Epoch(0), ChunkSeq(0), 0, ids=(1,)),  # never opened
        ],
    )
    assert isinstance(out[0], Verdict)
    gaps = [m for m in out if isinstance(m, Fault)]
    assert [(f.kind, f.session) for f in gaps] == [("gap", S), ("gap", SessionId(99))]
    assert gaps[0].epoch == Epoch(0)


async def test_repeated_open_keeps_kv_and_replay_goes_nowhere(block: Path) -> None:
    prompt = Prefill(S, Epoch(0), ChunkSeq(0), 0, False, ids=(1, 2, 3))
    out, executor = await run_stage(
        block,
        [
            OpenSession(S, max_len=64),
            attrs.evolve(prompt, replay=True),  # computed into the KV, answered by nothing
            OpenSession(S, max_len=64),  # re-sent after a repair: must not wipe positions 0..2
            verify(3, 1, seq=1),
        ],
    )
    assert [type(m).__name__ for m in out] == ["Verdict"]
    assert executor.statistics().chunks == 2


async def test_sessions_of_a_previous_coordinator_are_freed(block: Path) -> None:
    old, new = SessionId((5 << SESSION_BITS) + 1), SessionId((6 << SESSION_BITS) + 1)
    _, executor = await run_stage(
        block,
        [
            OpenSession(old, max_len=64),
            OpenSession(SessionId(old + 1), max_len=64),
            OpenSession(new, max_len=64),
        ],
    )
    assert executor.statistics().sessions == 1


async def test_a_previous_coordinators_open_coming_later_frees_nothing(block: Path) -> None:
    """After a takeover the new coordinator's sessions live here; an ``OpenSession`` of the
    old incarnation replayed afterwards (a log that still held it) is ignored and not
    forwarded, where it used to free the new coordinator's live sessions (the soak of issue
    40: three requests stalled after a splice that followed a takeover)."""
    old, new = SessionId((5 << SESSION_BITS) + 1), SessionId((6 << SESSION_BITS) + 1)
    prompt = Prefill(new, Epoch(0), ChunkSeq(0), 0, False, ids=(1, 2, 3))
    out, executor = await run_stage(
        block,
        [
            OpenSession(old, max_len=64),
            OpenSession(new, max_len=64),  # the new coordinator: old is freed, retired
            prompt,
            OpenSession(SessionId(old + 1), max_len=64),  # replayed late: ignored
            Verify(new, Epoch(0), ChunkSeq(1), 3, ids=(4,)),
        ],
    )
    assert executor.statistics().sessions == 1
    assert [type(m).__name__ for m in out] == ["Verdict"]  # new's KV was kept: no gap


def test_the_log_drops_a_previous_coordinators_sessions_at_the_new_ones_first_open() -> None:
    old, new = SessionId((5 << SESSION_BITS) + 1), SessionId((6 << SESSION_BITS) + 1)
    log = ReplayLog(max_bytes=8 * 10)
    log.record(OpenSession(old, max_len=64))
    log.record(Prefill(old, Epoch(0), ChunkSeq(0), 0, True, ids=(1, 2)))
    log.record(OpenSession(SessionId(old + 1), max_len=64))
    log.record(Verify(SessionId(old + 1), Epoch(0), ChunkSeq(0), 0, ids=tuple(range(11))))
    assert log.statistics().dropped == 1  # old + 1 passed the bound
    log.record(OpenSession(new, max_len=64))
    assert [m.session for m in log.replay()] == [new]
    assert log.statistics().nbytes == 0 and log.statistics().dropped == 0


def test_replaying_the_log_rebuilds_bit_identical_kv(block: Path) -> None:
    """What a spliced-in standby gets: the log's chunks, replayed into a fresh cache, give
    exactly the KV the lost node had for every position before the frontier — through a
    rejection that rolled positions back and chunks that partly overwrote earlier ones."""
    model = load_stage(block, 0, 2, dtype=torch.float32)
    sent = [  # (start, ids) in the order the edge sent them
        (0, (5, 6, 7, 8)),  # prefill
        (4, (9, 10, 11, 12)),  # a verify chunk with 3 drafts
        (8, (13, 14, 15)),  # pipelined behind it
        (6, (21, 22)),  # rejection at 6: rolls back from 6
        (8, (23, 24, 25)),
    ]
    log = ReplayLog()
    log.record(OpenSession(S, max_len=32))
    live = model.new_cache(32)
    with torch.inference_mode():
        for seq, (start, ids) in enumerate(sent):
            model(torch.tensor([ids]), start, live)
            log.record(Verify(S, Epoch(0), ChunkSeq(seq), start, ids=ids))
        rebuilt = model.new_cache(32)
        for msg in log.replay():
            if isinstance(msg, Prefill):
                model(torch.tensor([msg.ids]), msg.start, rebuilt)
    frontier = 11  # positions written by the last chunk: [8, 11)
    assert [c.start for c in log.chunks(S)] == [0, 4, 6, 8]
    assert torch.equal(live.k[..., :frontier, :], rebuilt.k[..., :frontier, :])
    assert torch.equal(live.v[..., :frontier, :], rebuilt.v[..., :frontier, :])
