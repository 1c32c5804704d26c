"""Batched stages: the packed forward, the gather rule, and the executor running many sessions'
chunks in one forward — each chunk's output as if it had run alone (or a checked numerical
tie), stale and bad chunks dropped from their batch alone, the KV budget refused cleanly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from shard.messages import (
    ChunkSeq,
    EndSession,
    Epoch,
    Fault,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Truncate,
    Verdict,
    Verify,
)
from shard.model.loader import load_stage
from shard.model.packed import Segment, forward_packed, segment_bounds
from shard.stage.batch import Queued, gather, pack
from shard.stage.chunks import Session
from shard.stage.config import ExecutorConfig
from shard.stage.executor import StageExecutor
from shard.testing import make_tiny_checkpoint

TIE = 1e-4  # a batched row may differ from its lone run only where a choice is this close
CHUNKS = [(0, 7), (0, 1), (0, 5)]  # (start, rows): a prefill chunk, a decode step, a verify


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("batch"), seed=21, n_layers=2)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, S]


@pytest.mark.parametrize("static", [False, True])
def test_one_segment_is_bit_identical_to_the_unbatched_forward(block: Path, static: bool) -> None:
    """A batch of one chunk computes exactly what ``forward`` (or ``forward_at``) does."""
    model = load_stage(block, 0, 2)
    x = _ids(9, 1)
    alone, packed = model.new_cache(32), model.new_cache(32)
    want = model.forward_at(x, torch.arange(9), alone) if static else model(x, 0, alone)
    got = forward_packed(model, x, [Segment(0, 9, packed)], static=static)
    assert torch.equal(got, want)
    assert torch.equal(packed.k, alone.k) and torch.equal(packed.v, alone.v)


def test_head_rows_are_the_last_rows_of_the_whole_chunk(block: Path) -> None:
    """The tail's head on only the rows a choice reads: those rows' logits, within float
    noise of the whole chunk's (the head treats rows alike; a kernel may sum a 1-row product
    in another order), with the same argmax; alone and packed; a bad count is refused."""
    model = load_stage(block, 0, 2)
    x = _ids(9, 4)
    whole = model(x, 0, model.new_cache(32))  # [1, 9, V]
    for n in (0, 1, 3, 9):
        got = model(x, 0, model.new_cache(32), head_rows=n)
        assert got.shape == (1, n, whole.shape[-1])
        torch.testing.assert_close(got, whole[:, 9 - n :], rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), whole[:, 9 - n :].argmax(-1))
    with pytest.raises(ValueError, match="head_rows 10"):
        model(x, 0, model.new_cache(32), head_rows=10)
    xs = [_ids(n, 5 + i) for i, (_, n) in enumerate(CHUNKS)]
    segs = [Segment(s, n, model.new_cache(32)) for s, n in CHUNKS]
    full = forward_packed(model, torch.cat(xs, dim=1), segs)
    segs = [Segment(s, n, model.new_cache(32)) for s, n in CHUNKS]
    got = forward_packed(model, torch.cat(xs, dim=1), segs, head_rows=[0, 1, 2])
    _, (_, b), (_, c) = segment_bounds(segs)
    torch.testing.assert_close(got, torch.cat([full[:, b - 1 : b], full[:, c - 2 : c]], dim=1))
    with pytest.raises(ValueError, match="do not fit"):
        forward_packed(model, torch.cat(xs, dim=1), segs, head_rows=[0, 2, 0])


@pytest.mark.parametrize(
    ("static", "dtype"), [(False, "float32"), (True, "float32"), (False, "bfloat16")]
)
def test_packed_segments_match_each_chunk_alone(
    block: Path, static: bool, dtype: str, report: Callable[[str], None]
) -> None:
    """Three sessions packed (prefill, decode, verify lengths), then a step of each: every row's
    logits within float noise of its lone run, and every greedy choice equal unless a tie. In
    fp32 and in bf16 (the tie rule stays for bf16: at some narrow shapes a bf16 row still
    rounds by batch; SmolLM2's bit-for-bit test is the next one)."""
    model = load_stage(block, 0, 2, dtype=getattr(torch, dtype))
    alone = [model.new_cache(32) for _ in CHUNKS]
    packed = [model.new_cache(32) for _ in CHUNKS]
    worst, ties = 0.0, 0
    chunks = list(CHUNKS)
    for step in range(3):
        xs = [_ids(n, 10 * step + i) for i, (_, n) in enumerate(chunks)]
        want = []
        for (start, n), x, cache in zip(chunks, xs, alone, strict=True):
            pos = torch.arange(start, start + n)
            want.append(model.forward_at(x, pos, cache) if static else model(x, start, cache))
        segs = [Segment(s, n, c) for (s, n), c in zip(chunks, packed, strict=True)]
        got = forward_packed(model, torch.cat(xs, dim=1), segs, static=static)
        for (lo, hi), w in zip(segment_bounds(segs), want, strict=True):
            g = got[:, lo:hi]
            worst = max(worst, (g - w).abs().max().item())
            top2 = w.topk(2, dim=-1).values  # [1, S, 2]
            flipped = g.argmax(-1) != w.argmax(-1)
            gaps = (top2[..., 0] - top2[..., 1])[flipped]
            assert bool((gaps < TIE).all()), f"a greedy choice flipped at gap {gaps.tolist()}"
            ties += int(flipped.sum())
        chunks = [(start + n, 1 + i) for i, (start, n) in enumerate(chunks)]  # the next steps
    assert worst < 1e-3
    report(f"packed forward (static={static}, {dtype}): max |logit diff| {worst:.2g}, ties {ties}")


def test_smollm2_in_bfloat16_batches_bit_for_bit(smollm2_dir: Path) -> None:
    """SmolLM2 in dense bf16 on the CPU: 16 decode rows and a verify chunk packed give exactly
    the bits each gives alone, over several steps (``shard.model.linear``: without the two-row
    rule a lone row's 1,536-wide down projection rounds differently)."""
    model = load_stage(smollm2_dir, 0, 4, dtype=torch.bfloat16, weights="bfloat16")
    chunks = [(0, 5)] + [(0, 1)] * 16  # (start, rows): a verify-sized chunk, 16 decode steps
    alone = [model.new_cache(32) for _ in chunks]
    packed = [model.new_cache(32) for _ in chunks]
    for step in range(4):
        xs = [_ids(n, 100 * step + i) for i, (_, n) in enumerate(chunks)]
        want = [model(x, s, c) for (s, _), x, c in zip(chunks, xs, alone, strict=True)]
        segs = [Segment(s, n, c) for (s, n), c in zip(chunks, packed, strict=True)]
        got = forward_packed(model, torch.cat(xs, dim=1), segs)
        for (lo, hi), w in zip(segment_bounds(segs), want, strict=True):
            assert torch.equal(got[:, lo:hi], w), f"step {step}, rows {lo}:{hi}"
        chunks = [(s + n, 1) for s, n in chunks]


def test_two_chunks_of_one_session_in_one_batch_see_each_others_kv(block: Path) -> None:
    """Pipelined chunks of one session in the same batch: the later one attends to what the
    earlier one wrote, exactly as when they run one after the other."""
    model = load_stage(block, 0, 2)
    a, b = _ids(6, 3), _ids(3, 4)
    alone, packed = model.new_cache(32), model.new_cache(32)
    want = torch.cat([model(a, 0, alone), model(b, 6, alone)], dim=1)
    got = forward_packed(
        model, torch.cat([a, b], 1), [Segment(0, 6, packed), Segment(6, 3, packed)]
    )
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_pack_lays_rows_end_to_end() -> None:
    """``pack`` concatenates the chunks' rows and records each one's bounds in order."""
    from shard.messages import Sampling
    from shard.stage.batch import Planned

    cache = object()
    planned = [
        Planned(
            Verify(SessionId(i), Epoch(0), ChunkSeq(0), 3 * i), _ids(n, i), cache, Sampling(), 0.0
        )  # type: ignore[arg-type]
        for i, n in enumerate((2, 1, 4))
    ]
    x, segments = pack(planned)
    assert tuple(x.shape) == (1, 7)
    assert [(s.start, s.rows) for s in segments] == [(0, 2), (3, 1), (6, 4)]
    assert segment_bounds(segments) == [(0, 2), (2, 3), (3, 7)]
    assert torch.equal(x[:, 2:3], planned[1].x)


def _verify(session: int, start: int, ids: tuple[int, ...], epoch: int = 0) -> Verify:
    return Verify(SessionId(session), Epoch(epoch), ChunkSeq(start), start, ids=ids)


async def test_gather_stops_at_a_control_message_and_at_the_row_cap() -> None:
    """What waits is batched up to ``max_rows``; a control message or an overflowing chunk ends
    the gather and comes back to be handled next; window 0 never waits."""
    send, recv = trio.open_memory_channel[Queued](16)
    first = Queued(_verify(1, 0, (1, 2)), 0.0)
    items = [
        Queued(_verify(2, 0, (3,)), 0.0),
        Queued(_verify(3, 0, (4, 5, 6)), 0.0),
        Queued(EndSession(SessionId(2)), 0.0),
        Queued(_verify(4, 0, (7,)), 0.0),
    ]
    for item in items:
        send.send_nowait(item)
    batch, after = await gather(first, recv, max_rows=16)
    assert [q.msg for q in batch] == [first.msg, items[0].msg, items[1].msg]
    assert after == items[2]  # the control message: handled after the batch
    batch, after = await gather(recv.receive_nowait(), recv, max_rows=16)
    assert batch == [items[3]] and after is None  # nothing waits: no wait, no block
    for item in items[:2]:
        send.send_nowait(item)
    batch, after = await gather(first, recv, max_rows=3)
    assert batch == [first, items[0]] and after is None  # 2 + 1 rows: full, the rest waits
    batch, after = await gather(first, recv, max_rows=4)
    assert batch == [first] and after == items[1]  # 2 + 3 rows would overflow: it comes back


async def test_gather_window_takes_what_arrives_within_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With a window, a chunk of an expected session sent during it joins the batch, and the
    gather ends as soon as every expected session is in (virtual time)."""
    send, recv = trio.open_memory_channel[Queued](4)
    late = Queued(_verify(2, 0, (3,)), 0.0)
    async with trio.open_nursery() as nursery:

        async def later() -> None:
            await trio.sleep(0.001)
            send.send_nowait(late)

        nursery.start_soon(later)
        began = trio.current_time()
        batch, after = await gather(
            Queued(_verify(1, 0, (1,)), 0.0),
            recv,
            max_rows=8,
            window_s=0.01,
            expected=[SessionId(1), SessionId(2)],
        )
        waited = trio.current_time() - began
    assert batch[1:] == [late] and after is None
    assert waited == pytest.approx(0.001)  # not the whole window: session 2 was all it awaited


async def test_gather_waits_only_for_expected_sessions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A lone session (nothing else expected) never waits, whatever the window; an expected
    session that does not come costs at most the window (virtual time)."""
    send, recv = trio.open_memory_channel[Queued](4)
    first = Queued(_verify(1, 0, (1,)), 0.0)
    for expected in ([], [SessionId(1)]):
        began = trio.current_time()
        batch, after = await gather(first, recv, max_rows=8, window_s=0.5, expected=expected)
        assert (batch, after) == ([first], None)
        assert trio.current_time() == began  # no wait at all
    began = trio.current_time()
    batch, after = await gather(
        first, recv, max_rows=8, window_s=0.5, expected=[SessionId(1), SessionId(3)]
    )
    assert (batch, after) == ([first], None)
    assert trio.current_time() - began == pytest.approx(0.5)  # session 3 never came
    send.close()


def test_session_rhythm_says_when_its_next_chunk_is_due() -> None:
    """A session is due one typical spacing of its verify chunks after its last (the median
    of its last three); prefill chunks (back to back once) and the opening say nothing of its
    rhythm, and a session with no spacing yet is never due (a gather does not wait for it)."""
    from shard.messages import Sampling

    sess = Session(cache=None, sampling=Sampling(), seen=0.0)  # type: ignore[arg-type]
    for now in (0.01, 0.02):
        sess.arrived(now, verify=False)  # prefill chunks
    assert sess.seen == 0.02 and not sess.due_by(1e9)
    sess.arrived(0.1, verify=True)
    assert not sess.due_by(1e9)  # one verify chunk: no spacing yet
    sess.arrived(1.3, verify=True)  # a first spacing far longer than the rhythm (a crowd's
    assert sess.period == pytest.approx(1.2)  # prompts in between)
    assert sess.due_by(2.5) and not sess.due_by(2.49)
    sess.arrived(1.5, verify=True)
    assert sess.period == pytest.approx(0.7)  # the median of two
    sess.arrived(1.7, verify=True)  # two spacings of the rhythm outvote the long first one
    assert sess.period == pytest.approx(0.2)
    assert sess.due_by(1.9) and not sess.due_by(1.89)
    sess.arrived(1.74, verify=True)  # one pipelined chunk close behind does not move it
    assert sess.period == pytest.approx(0.2)
    for now in (1.94, 2.14, 2.34):  # only the last three spacings count
        sess.arrived(now, verify=True)
    assert list(sess.gaps) == pytest.approx([0.2, 0.2, 0.2])


async def run_all(
    block: Path,
    msgs: list[Message],
    *,
    then: Sequence[Message] = (),
    after: int = 0,
    **kw: int,
) -> tuple[list[Message], StageExecutor]:
    """Queue ``msgs`` all at once into a whole-model executor and let it run them; with
    ``then``, queue those all at once after ``after`` messages have come out."""
    model = load_stage(block, 0, 2)
    total = len(msgs) + len(then)
    inbox_send, inbox_recv = trio.open_memory_channel[Message](total)
    outbox_send, outbox_recv = trio.open_memory_channel[Message](total + 1)
    executor = StageExecutor(model, ExecutorConfig(NodeName("s"), **kw), inbox_recv, outbox_send)
    out: list[Message] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.run)
            for msg in msgs:
                inbox_send.send_nowait(msg)
            while len(out) < after:
                out.append(await outbox_recv.receive())
            for msg in then:
                inbox_send.send_nowait(msg)
            inbox_send.close()
    async with outbox_recv:
        return [*out, *[m async for m in outbox_recv]], executor


def _session_msgs(sid: int) -> list[Message]:
    """One session: open, a prompt, a verify chunk with a two-token draft, a decode step."""
    s = SessionId(sid)
    prompt = tuple((7 * sid + j) % 250 for j in range(3 + sid % 4))
    n = len(prompt)
    return [
        OpenSession(s, max_len=64),
        Prefill(s, Epoch(0), ChunkSeq(0), 0, True, ids=prompt),
        Verify(s, Epoch(0), ChunkSeq(1), n, ids=(9, 4, 4), draft=(4, 4)),
        Verify(s, Epoch(0), ChunkSeq(2), n + 3, ids=(11,)),
    ]


def _answers(out: list[Message]) -> dict[tuple[int, int], tuple[tuple[int, ...], int]]:
    return {(m.session, m.seq): (m.target_ids, m.accepted) for m in out if isinstance(m, Verdict)}


async def test_sessions_batched_answer_as_they_do_alone(block: Path) -> None:
    """Six sessions' chunks interleaved in one queue run in few forwards, and every chunk's
    verdict equals the one it gets alone; each verdict's hop reports its batch."""
    sessions = range(1, 7)
    per = [_session_msgs(s) for s in sessions]
    opens = [m[0] for m in per]
    chunks = [m for i in range(1, 4) for msgs in per for m in msgs[i : i + 1]]  # round-robin
    out, executor = await run_all(block, [*opens, *chunks])
    want: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
    for msgs in per:
        alone, _ = await run_all(block, msgs, max_batch_rows=1)
        want.update(_answers(alone))
    assert _answers(out) == want
    stats = executor.statistics()
    assert stats.chunks == 18 and stats.forwards < stats.chunks  # batched
    assert stats.max_batch_rows > 7 and stats.rows_per_forward > 1
    assert max(h.batch_rows for m in out if isinstance(m, Verdict) for h in m.hops) > 7
    assert len(stats.session_queued_s) == 6


async def test_a_stale_or_bad_chunk_is_dropped_from_its_batch_alone(block: Path) -> None:
    """In one batch: session 1's chunk is stale (a Truncate overtook it) and session 2's holds
    a token outside the vocabulary; session 3's chunk still gets its own verdict."""
    opening = [*_session_msgs(1)[:2], *_session_msgs(2)[:2], *_session_msgs(3)[:2]]
    stale = _verify(1, len(_session_msgs(1)[1].ids), (5,))  # type: ignore[union-attr]
    bad = _verify(2, 5, (10**6,))
    good = _verify(3, len(_session_msgs(3)[1].ids), (5,))  # type: ignore[union-attr]
    trunc = Truncate(SessionId(1), Epoch(1), 0)
    # As on a ring, a Truncate comes only after the coordinator had its session's prefill
    # verdict: the prefills are answered first. Then the Truncate is queued ahead of the
    # chunk it makes stale (it is applied on arrival, ahead of the queue, either way).
    out, executor = await run_all(block, opening, then=[trunc, stale, bad, good], after=3)
    faults = [m for m in out if isinstance(m, Fault)]
    assert [(f.session, f.kind) for f in faults] == [(2, "chunk")]
    assert "out of range" in faults[0].detail
    answered = {(m.session, m.seq) for m in out if isinstance(m, Verdict)}
    assert answered == {(1, 0), (2, 0), (3, 0), (3, good.seq)}
    assert executor.statistics().stale_skipped == 1


async def test_kv_budget_refuses_a_session_before_allocating(block: Path) -> None:
    """With a KV budget for two sessions, a third OpenSession is a clear capacity fault and
    allocates nothing; ending a session makes room again."""
    model = load_stage(block, 0, 2)
    one = model.new_cache(64)
    per_session = one.k.nbytes + one.v.nbytes
    msgs: list[Message] = [OpenSession(SessionId(i), max_len=64) for i in (1, 2, 3)]
    msgs += [EndSession(SessionId(1)), OpenSession(SessionId(4), max_len=64)]
    out, executor = await run_all(block, msgs, kv_budget_bytes=2 * per_session)
    faults = [m for m in out if isinstance(m, Fault)]
    assert [(f.session, f.kind) for f in faults] == [(3, "capacity")]
    assert "limits.kv_budget_mib" in faults[0].detail and "shorter max_len" in faults[0].detail
    stats = executor.statistics()
    assert stats.sessions == 2 and stats.kv_bytes == 2 * per_session
