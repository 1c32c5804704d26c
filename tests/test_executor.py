"""The stage executor at its boundary: what an OpenSession may ask for, what sampling it may set."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import trio

from shard.compute.offload import inline_compute
from shard.decode.reference import generate_reference
from shard.messages import (
    ChunkSeq,
    Epoch,
    Fault,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    Verdict,
)
from shard.model.loader import load_stage
from shard.stage.config import ExecutorConfig
from shard.stage.executor import StageExecutor
from shard.testing import make_tiny_checkpoint

PROMPT = (5, 17, 99, 3)


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), seed=21, n_layers=2)


async def run_stage(
    block: Path, msgs: list[Message], **kw: int
) -> tuple[list[Message], StageExecutor, list[int]]:
    """Run a whole-model executor over ``msgs``; returns what it sent, the executor, and its
    KV bytes after each message was handled."""
    model = load_stage(block, 0, 2, dtype=torch.float32)  # first and last: a whole ring
    inbox_send, inbox_recv = trio.open_memory_channel[Message](0)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](len(msgs) + 1)
    executor = StageExecutor(model, ExecutorConfig(NodeName("s"), **kw), inbox_recv, outbox_send)
    kv: list[int] = []
    # inline: a session's KV is allocated in a worker thread, which would still be running
    # when wait_all_tasks_blocked returns; in the loop's thread each reading is exact
    with inline_compute(), trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.run)
            async with inbox_send:
                for msg in msgs:
                    await inbox_send.send(msg)
                    await trio.testing.wait_all_tasks_blocked()
                    kv.append(executor.statistics().kv_bytes)
    out = []
    async with outbox_recv:
        async for msg in outbox_recv:
            out.append(msg)
    return out, executor, kv


async def test_sixteen_oversized_sessions_hold_no_memory(block: Path) -> None:
    """16 OpenSessions asking for the model's whole context past limits.max_len are refused
    and allocate nothing; 16 within it hold exactly 16 x max_len of KV."""
    model = load_stage(block, 0, 2, dtype=torch.float32)
    context = model.config.max_position_embeddings
    assert context > 64
    big = [OpenSession(SessionId(i + 1), max_len=context) for i in range(16)]
    fit = [OpenSession(SessionId(i + 101), max_len=64) for i in range(16)]
    out, executor, kv = await run_stage(block, [*big, *fit], max_len=64, max_sessions=16)
    faults = [m for m in out if isinstance(m, Fault)]
    assert [(f.kind, f.session) for f in faults] == [("request", m.session) for m in big]
    assert all("limits.max_len" in f.detail for f in faults)
    assert kv[:16] == [0] * 16  # the refused sessions allocated nothing
    one = model.new_cache(64)
    per_session = one.k.nbytes + one.v.nbytes
    assert kv[16:] == [per_session * (i + 1) for i in range(16)]
    assert executor.statistics().sessions == 16
    assert max(kv) == 16 * per_session  # max_sessions x limits.max_len, whatever peers ask


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1e-40, seed=3),
        Sampling(temperature=5e-324, top_p=5e-324, seed=3),
        Sampling(temperature=1.0, top_p=5e-324, seed=3),
        Sampling(temperature=1e-40, top_p=1e-40, top_k=1, seed=3),
    ],
)
async def test_tail_serves_tiny_sampling_values_as_greedy(block: Path, sampling: Sampling) -> None:
    """A session with a tiny temperature or top-p gets the greedy token; the tail lives on."""
    model = load_stage(block, 0, 2, dtype=torch.float32)
    want = generate_reference(model, list(PROMPT), eos_ids=(), max_tokens=1, max_len=64)
    sid = SessionId(7)
    out, _, _ = await run_stage(
        block,
        [
            OpenSession(sid, max_len=64, sampling=sampling),
            Prefill(sid, Epoch(0), ChunkSeq(0), 0, True, ids=PROMPT),
        ],
    )
    assert len(out) == 1 and isinstance(out[0], Verdict), out
    assert out[0].target_ids == want.token_ids[:1]


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=math.nan),
        Sampling(temperature=math.inf),
        Sampling(temperature=1.0, top_p=math.nan),
        Sampling(temperature=1.0, top_p=0.0),
    ],
)
async def test_meaningless_sampling_is_refused_at_open(block: Path, sampling: Sampling) -> None:
    """A peer's OpenSession with NaN/inf sampling values is a request fault, no session."""
    sid = SessionId(8)
    out, _, kv = await run_stage(block, [OpenSession(sid, max_len=64, sampling=sampling)])
    assert len(out) == 1 and isinstance(out[0], Fault), out
    assert (out[0].kind, out[0].session) == ("request", sid)
    assert kv == [0]
