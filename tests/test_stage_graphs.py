"""CUDA graphs per chunk shape (``shard.stage.graphs``): the shape-keyed cache, the eager
fallback and the static buffers, driven on the CPU by an injected capturer that runs the
captured function eagerly; and, on a GPU only, real captures bit-identical to eager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.stage.graphs import ChunkGraphs, Replay, chunk_rows

PROMPT = [12, 200, 7, 99, 260, 31, 31, 5]
MAX_LEN = 40
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class FakeCapture:
    """Records each capture; its replay runs the captured function eagerly (a CPU stand-in)."""

    def __init__(self) -> None:
        self.captures = 0

    def __call__(self, fn: Callable[[], Tensor]) -> Replay:
        self.captures += 1
        return fn


@pytest.fixture
def model(tiny_checkpoint: Callable[..., Path]) -> StageModel:
    return load_stage(tiny_checkpoint(arch="qwen2"), 0, 4)


def prefilled(model: StageModel) -> torch.Tensor:
    cache = model.new_cache(MAX_LEN)
    model(torch.tensor([PROMPT]), 0, cache)
    return cache


def at(start: int, rows: int) -> Tensor:
    return torch.arange(start, start + rows)


def test_chunk_rows_are_decode_and_verify_shapes() -> None:
    """Decode is 1 row; verify is K+1 rows for the fixed K, or for every K up to k_max."""
    assert chunk_rows(4, 8) == {1, 5}
    assert chunk_rows(None, 3) == {1, 2, 3, 4}
    assert chunk_rows(0, 8) == {1}


def test_forward_at_agrees_with_forward(model: StageModel) -> None:
    """The static-position forward computes the same logits (to rounding) and the same K/V."""
    a, b = model.new_cache(MAX_LEN), model.new_cache(MAX_LEN)
    x = torch.tensor([PROMPT])
    torch.testing.assert_close(model(x, 0, a), model.forward_at(x, at(0, len(PROMPT)), b))
    step = torch.tensor([[44, 2, 190]])
    n = len(PROMPT)
    torch.testing.assert_close(model(step, n, a), model.forward_at(step, at(n, 3), b))
    torch.testing.assert_close(a.k, b.k)
    torch.testing.assert_close(a.v, b.v)


def test_forward_at_never_reads_past_the_chunk(model: StageModel) -> None:
    """Garbage past the frontier (a rejected draft) is masked, exactly as ``forward`` slices."""
    clean, dirty = prefilled(model), prefilled(model)
    n = len(PROMPT)
    model.forward_at(torch.tensor([[250, 1, 77, 3]]), at(n, 4), dirty)  # rejected
    step = torch.tensor([[42]])
    assert torch.equal(
        model.forward_at(step, at(n, 1), clean), model.forward_at(step, at(n, 1), dirty)
    )


def test_off_is_exactly_eager_forward(model: StageModel) -> None:
    """Mode ``off`` runs ``StageModel.forward`` bit for bit and never captures."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="off", rows={1}, capture=fake)
    a, b = prefilled(model), prefilled(model)
    x = torch.tensor([[42]])
    assert torch.equal(graphs(x, len(PROMPT), a), model(x, len(PROMPT), b))
    assert graphs.mode == "off" and fake.captures == 0
    assert graphs.statistics().eager == 1


def test_a_cpu_stage_without_a_capturer_is_off(model: StageModel) -> None:
    """On a CPU nothing can capture: lazy and warm fall back to ``forward`` for every chunk."""
    for mode in ("lazy", "warm"):
        graphs = ChunkGraphs(model, mode=mode, rows={1})
        assert graphs.mode == "off"
        a, b = prefilled(model), prefilled(model)
        graphs.opened(a)
        x = torch.tensor([[42]])
        assert torch.equal(graphs(x, len(PROMPT), a), model(x, len(PROMPT), b))


def test_lazy_captures_once_per_session_and_shape(model: StageModel) -> None:
    """The first chunk of a shape in a session captures; the next ones replay; another session
    or another shape in use captures its own."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="lazy", rows={1, 3}, capture=fake)
    a, b = prefilled(model), prefilled(model)
    n = len(PROMPT)
    for i in range(4):
        graphs(torch.tensor([[7 + i]]), n + i, a)
    assert fake.captures == 1
    graphs(torch.tensor([[7, 8, 9]]), n + 4, a)
    graphs(torch.tensor([[7]]), n, b)
    assert fake.captures == 3
    stats = graphs.statistics()
    assert (stats.graphs, stats.captures, stats.replays, stats.eager) == (3, 3, 6, 0)


def test_graphed_equals_eager_forward_at_bit_for_bit(model: StageModel) -> None:
    """Replays through the static buffers give exactly eager ``forward_at``'s logits and K/V,
    at every position (the buffers are refilled per chunk)."""
    graphs = ChunkGraphs(model, mode="lazy", rows={1, 3}, capture=FakeCapture())
    a, b = prefilled(model), prefilled(model)
    start = len(PROMPT)
    for ids in ([5], [9], [4, 8, 15], [16], [23, 42, 3]):
        x = torch.tensor([ids])
        got = graphs(x, start, a)
        want = model.forward_at(x, at(start, len(ids)), b)
        assert torch.equal(got, want)
        start += len(ids)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_other_shapes_run_eager_forward_at(model: StageModel) -> None:
    """A row count not in use (a prefill chunk, a request's own K) is not captured, and runs
    the same arithmetic as the graphs (``forward_at``), so output never depends on which
    chunks happened to be graphed."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="lazy", rows={1}, capture=fake)
    a, b = model.new_cache(MAX_LEN), model.new_cache(MAX_LEN)
    x = torch.tensor([PROMPT])
    assert torch.equal(graphs(x, 0, a), model.forward_at(x, at(0, len(PROMPT)), b))
    assert fake.captures == 0 and graphs.statistics().eager == 1
    assert not graphs.graphed(len(PROMPT), a) and graphs.graphed(1, a)


def test_max_graphs_bounds_captures(model: StageModel) -> None:
    """Past ``max_graphs`` new (session, shape) keys run eagerly; held graphs still replay."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="lazy", rows={1}, capture=fake, max_graphs=1)
    a, b = prefilled(model), prefilled(model)
    n = len(PROMPT)
    graphs(torch.tensor([[1]]), n, a)
    graphs(torch.tensor([[1]]), n, b)
    graphs(torch.tensor([[2]]), n + 1, a)
    assert fake.captures == 1
    assert graphs.statistics().replays == 2 and graphs.statistics().eager == 1


def test_forget_drops_a_sessions_graphs(model: StageModel) -> None:
    """An ended session's graphs go (and with them the last reference to its cache)."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="lazy", rows={1, 2}, capture=fake)
    a, b = prefilled(model), prefilled(model)
    n = len(PROMPT)
    graphs(torch.tensor([[1]]), n, a)
    graphs(torch.tensor([[1, 2]]), n, a)
    graphs(torch.tensor([[1]]), n, b)
    graphs.forget(a)
    assert graphs.statistics().graphs == 1
    graphs(torch.tensor([[1]]), n, b)
    assert fake.captures == 3


def test_warm_captures_every_shape_at_open_and_leaves_no_trace(model: StageModel) -> None:
    """``warm`` captures each shape in use (that fits the cache) when the session opens, then
    zeroes the cache; the session's chunks replay without capturing."""
    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="warm", rows={1, 3, 64}, capture=fake)
    cache = model.new_cache(MAX_LEN)
    graphs.opened(cache)
    assert fake.captures == 2  # 64 rows do not fit a 40-position cache
    assert not cache.k.any() and not cache.v.any()
    ref = model.new_cache(MAX_LEN)
    model.forward_at(torch.tensor([PROMPT]), at(0, len(PROMPT)), ref)
    graphs(torch.tensor([PROMPT]), 0, cache)  # prefill: eager forward_at
    n = len(PROMPT)
    assert torch.equal(
        graphs(torch.tensor([[5, 6, 7]]), n, cache),
        model.forward_at(torch.tensor([[5, 6, 7]]), at(n, 3), ref),
    )
    assert fake.captures == 2


def test_warm_on_a_middle_stage_captures_hidden_rows(tiny_checkpoint: Callable[..., Path]) -> None:
    """A stage fed hidden states captures on dummy ``[1, S, D]`` rows in its dtype."""
    middle = load_stage(tiny_checkpoint(arch="llama"), 1, 3)
    fake = FakeCapture()
    graphs = ChunkGraphs(middle, mode="warm", rows={1, 2}, capture=fake)
    cache = middle.new_cache(MAX_LEN)
    graphs.opened(cache)
    assert fake.captures == 2
    h = torch.randn(1, 2, middle.config.hidden_size)
    ref = middle.new_cache(MAX_LEN)
    assert torch.equal(graphs(h, 0, cache), middle.forward_at(h, at(0, 2), ref))


def test_unknown_mode_is_refused(model: StageModel) -> None:
    """Only off, lazy and warm exist."""
    with pytest.raises(ValueError, match="unknown graphs mode 'on'"):
        ChunkGraphs(model, mode="on", rows={1})


# --- on a GPU only: the real capture ------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_cuda_graph_is_bit_identical_to_eager(
    tiny_checkpoint: Callable[..., Path], dtype: torch.dtype, rows: int
) -> None:
    """On a GPU: for each chunk shape, graph replays equal eager ``forward_at`` bit for bit
    (logits and K/V) over several positions, and the graph was really captured."""
    model = load_stage(tiny_checkpoint(arch="qwen2"), 0, 4, dtype=dtype, device="cuda:0")
    graphs = ChunkGraphs(model, mode="lazy", rows={rows})
    assert graphs.mode == "lazy"
    a, b = model.new_cache(MAX_LEN), model.new_cache(MAX_LEN)
    prompt = torch.tensor([PROMPT], device="cuda:0")
    graphs(prompt, 0, a)
    model.forward_at(prompt, torch.arange(len(PROMPT), device="cuda:0"), b)
    start = len(PROMPT)
    gen = torch.Generator().manual_seed(rows)
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (1, rows), generator=gen).to("cuda:0")
        got = graphs(ids, start, a)
        want = model.forward_at(ids, torch.arange(start, start + rows, device="cuda:0"), b)
        assert torch.equal(got, want)
        start += rows
    torch.cuda.synchronize()
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    stats = graphs.statistics()
    assert stats.captures == 1 and stats.replays == 3


@needs_cuda
def test_cuda_warm_graphs_on_a_middle_stage(tiny_checkpoint: Callable[..., Path]) -> None:
    """On a GPU: warm capture at open for hidden-state rows, then replays equal eager."""
    middle = load_stage(tiny_checkpoint(arch="llama"), 1, 3, dtype=torch.bfloat16, device="cuda:0")
    graphs = ChunkGraphs(middle, mode="warm", rows={1, 3})
    a, b = middle.new_cache(MAX_LEN), middle.new_cache(MAX_LEN)
    graphs.opened(a)
    assert graphs.statistics().captures == 2
    h = torch.randn(1, 3, middle.config.hidden_size, device="cuda:0").to(torch.bfloat16)
    pos = torch.arange(0, 3, device="cuda:0")
    assert torch.equal(graphs(h, 0, a), middle.forward_at(h, pos, b))


async def test_executor_replays_per_chunk_and_forgets_at_session_end(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """A stage executor with graphs captures at ``OpenSession`` (warm), replays its decode and
    verify chunks, frees the session's graphs at ``EndSession``, and answers as eager does."""
    import trio

    from shard.messages import (
        ChunkSeq,
        EndSession,
        Epoch,
        Message,
        NodeName,
        OpenSession,
        Prefill,
        SessionId,
        Verdict,
        Verify,
    )
    from shard.stage.config import ExecutorConfig, StageAides
    from shard.stage.executor import StageExecutor

    model = load_stage(tiny_checkpoint(arch="llama", n_layers=2), 0, 2)  # a whole ring
    s = SessionId(3)
    msgs: list[Message] = [
        OpenSession(s, max_len=MAX_LEN),
        Prefill(s, Epoch(0), ChunkSeq(0), 0, True, ids=tuple(PROMPT)),
        Verify(s, Epoch(0), ChunkSeq(1), len(PROMPT), ids=(9, 4, 4), draft=(4, 4)),
        Verify(s, Epoch(0), ChunkSeq(2), len(PROMPT) + 3, ids=(11,)),
        EndSession(s),
    ]

    async def answers(graphs: ChunkGraphs | None) -> list[Verdict]:
        inbox_send, inbox_recv = trio.open_memory_channel[Message](100)
        outbox_send, outbox_recv = trio.open_memory_channel[Message](100)
        # Unbatched (max_batch_rows=1): the chunks are all queued at once, and this test is
        # about each chunk replaying its own graph (a batch of several runs packed, eagerly).
        executor = StageExecutor(
            model,
            ExecutorConfig(NodeName("s"), max_batch_rows=1),
            inbox_recv,
            outbox_send,
            aides=StageAides(graphs=graphs),
        )
        for msg in msgs:
            inbox_send.send_nowait(msg)
        inbox_send.close()
        with trio.fail_after(30):
            await executor.run()
        async with outbox_recv:
            return [m async for m in outbox_recv if isinstance(m, Verdict)]

    fake = FakeCapture()
    graphs = ChunkGraphs(model, mode="warm", rows={1, 3}, capture=fake)
    got = await answers(graphs)
    want = await answers(None)
    assert [(v.target_ids, v.accepted) for v in got] == [(v.target_ids, v.accepted) for v in want]
    stats = graphs.statistics()
    assert (fake.captures, stats.replays, stats.eager, stats.graphs) == (2, 2, 1, 0)
