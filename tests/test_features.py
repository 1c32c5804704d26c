"""Features on the return path, the tail's side: the final-norm output computed with its
logits (which stay bit for bit what they were), the rows a verdict carries, the stage's and
the wire's refusals. The coordinator's checks: ``test_features_coordinator.py``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from shard.compute.tensors import to_wire
from shard.messages import (
    MAX_FEATURES,
    ChunkSeq,
    Epoch,
    Fault,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    Verdict,
    Verify,
)
from shard.model.loader import load_stage
from shard.model.packed import Segment, forward_packed
from shard.stage.batch import Answer, Planned, forward_batch
from shard.stage.features import FeatureWindow, wire_dtype
from shard.stage.graphs import ChunkGraphs
from shard.testing import make_tiny_checkpoint
from shard.wire import WireError, WireLimits, decode, encode
from test_executor import run_stage

PROMPT = (5, 17, 99, 3, 8, 8, 41, 42, 43, 7, 9)  # 11 positions: prompt chunks of 4, 4, 3


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("feat"), seed=21, n_layers=2)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))  # [1, S]


def _normed(block: Path, tokens: Sequence[int]) -> torch.Tensor:
    """The final norm's output at every position (fp32 ``[S, D]``), read by a hook."""
    model = load_stage(block, 0, 2)
    assert model.norm is not None
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    with torch.inference_mode():
        model(torch.tensor([list(tokens)]), 0, model.new_cache(64))
    hook.remove()
    return seen[0][0]


# --- the model ------------------------------------------------------------------------------


def test_features_leave_the_logits_bit_identical(block: Path) -> None:
    """``feature_rows`` returns the final norm's output beside logits equal bit for bit to the
    ones without it (the head's rows alone, a verify chunk's, every row), eager and static."""
    model = load_stage(block, 0, 2)
    x = _ids(9, 1)
    want_norm = _normed(block, x[0].tolist())
    for head, feats in ((1, 6), (5, 5), (9, 3), (0, 9)):
        plain = model(x, 0, model.new_cache(32), head_rows=head)
        out = model(x, 0, model.new_cache(32), head_rows=head, feature_rows=feats)
        assert torch.equal(out.logits, plain)
        assert torch.equal(out.features[0], want_norm[9 - feats :])
    pos = torch.arange(9)
    plain = model.forward_at(x, pos, model.new_cache(32))
    out = model.forward_at(x, pos, model.new_cache(32), feature_rows=4)
    assert torch.equal(out.logits, plain) and out.features.shape == (1, 4, 64)
    with pytest.raises(ValueError, match="feature_rows 10"):
        model(x, 0, model.new_cache(32), head_rows=1, feature_rows=10)


@pytest.mark.parametrize("static", [False, True])
def test_packed_features_leave_every_segments_logits_bit_identical(
    block: Path, static: bool
) -> None:
    """Packed: a prompt chunk asking for more feature rows than head rows widens the norm;
    every segment's logits stay bit for bit those of the batch without features, and each
    segment's features are its own last rows."""
    model = load_stage(block, 0, 2)
    chunks = [(0, 7), (0, 1), (0, 5)]
    xs = torch.cat([_ids(n, 5 + i) for i, (_, n) in enumerate(chunks)], dim=1)
    heads, feats = [1, 1, 5], [6, 0, 5]
    segs = [Segment(s, n, model.new_cache(32)) for s, n in chunks]
    plain = forward_packed(model, xs, segs, static=static, head_rows=heads)
    segs = [Segment(s, n, model.new_cache(32)) for s, n in chunks]
    out = forward_packed(model, xs, segs, static=static, head_rows=heads, feature_rows=feats)
    assert torch.equal(out.logits, plain)
    assert out.features.shape == (1, 11, 64)
    first = _normed(block, xs[0, :7].tolist())
    torch.testing.assert_close(out.features[0, :6], first[1:], rtol=1e-5, atol=1e-5)


def test_a_batch_answers_features_only_to_the_session_that_asked(block: Path) -> None:
    """``forward_batch`` at the tail: the chunk whose session asked gets its rows (CPU, the
    wire's dtype); the other chunk's answer is exactly what it is in a batch without them."""
    model = load_stage(block, 0, 2)

    def planned(features: int) -> list[Planned]:
        msgs: list[Prefill | Verify] = [
            Prefill(SessionId(1), Epoch(0), ChunkSeq(0), 0, True, ids=(1, 2, 3, 4, 5, 6)),
            Verify(SessionId(2), Epoch(0), ChunkSeq(0), 0, ids=(7, 8, 9), draft=(8, 9)),
        ]
        x = [torch.tensor([m.ids]) for m in msgs]
        return [
            Planned(msgs[0], x[0], model.new_cache(16), Sampling(), 0.0, features=features),
            Planned(msgs[1], x[1], model.new_cache(16), Sampling(), 0.0),
        ]

    with_f = forward_batch(model, None, planned(4))
    without = forward_batch(model, None, planned(0))
    assert all(isinstance(a, Answer) for a in (*with_f, *without))
    assert with_f[1] == without[1] and without[0].features is None  # type: ignore[union-attr]
    assert with_f[0].choice == without[0].choice  # type: ignore[union-attr]
    rows = with_f[0].features  # type: ignore[union-attr]
    assert rows is not None and rows.dtype == torch.float16 and rows.shape == (4, 64)
    want = _normed(block, [1, 2, 3, 4, 5, 6])[2:]
    torch.testing.assert_close(rows.float(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["off", "lazy"])
def test_a_graphed_tail_runs_feature_chunks_eagerly_with_the_same_logits(
    block: Path, mode: str
) -> None:
    """``ChunkGraphs.with_features`` runs the chunk eagerly (counted), with exactly the
    logits its graph (or, ``off``, plain ``forward``) gives, and the last rows' features."""
    model = load_stage(block, 0, 2)
    graphs = ChunkGraphs(model, mode=mode, rows={3}, capture=lambda fn: fn)
    a, b = model.new_cache(32), model.new_cache(32)
    x = _ids(3, 9)
    want = graphs(x, 0, a)
    before = graphs.statistics()
    out = graphs.with_features(x, 0, b, 2)
    assert torch.equal(out.logits, want) and out.features.shape == (1, 2, 64)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    after = graphs.statistics()
    assert (after.eager - before.eager, after.captures) == (1, before.captures)


def test_wire_dtype_is_bf16_for_a_bf16_tail_else_fp16() -> None:
    """Features travel in bfloat16 from a bfloat16 tail, in float16 from any other."""
    assert wire_dtype(torch.bfloat16) == torch.bfloat16
    assert wire_dtype(torch.float32) == wire_dtype(torch.float16) == torch.float16


# --- which rows a verdict carries ------------------------------------------------------------


def _rows(first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].repeat(1, 2)  # [n, 2]


def test_window_rows_of_a_verify_chunk() -> None:
    """Rows 0..accepted of a verify chunk, the last ``size`` of them, from the right position."""
    w = FeatureWindow(3)
    first, rows = w.verify(10, 1, _rows(10, 5))  # 4 drafts, 1 held: inputs 10, 11
    assert (first, rows[:, 0].tolist()) == (10, [10.0, 11.0])
    first, rows = w.verify(10, 4, _rows(10, 5))  # all held: the last 3 of 5
    assert (first, rows[:, 0].tolist()) == (12, [12.0, 13.0, 14.0])


def test_window_keeps_the_prompts_last_rows_across_its_chunks() -> None:
    """Prompt chunks of 4, 4, 2 with a window of 6: the final verdict carries positions 4..9;
    a re-sent prompt (from 0) or a gap restarts the window."""
    w = FeatureWindow(6)
    w.prompt_chunk(0, 4, _rows(0, 4))
    w.prompt_chunk(4, 4, _rows(4, 4))
    w.prompt_chunk(8, 2, _rows(8, 2))
    first, rows = w.take_prompt()
    assert (first, rows[:, 0].tolist()) == (4, [4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    w.prompt_chunk(0, 4, _rows(0, 4))
    w.prompt_chunk(0, 4, _rows(0, 4))  # re-sent from 0: nothing before it is kept
    assert w.take_prompt()[1][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    w.prompt_chunk(0, 2, _rows(0, 2))
    w.prompt_chunk(5, 2, _rows(5, 2))  # positions 2..4 never came: no gap is bridged
    first, rows = w.take_prompt()
    assert (first, rows[:, 0].tolist()) == (5, [5.0, 6.0])
    assert w.prompt is None  # taken: forgotten


# --- the stage ---------------------------------------------------------------------------------


async def test_the_tail_returns_features_for_the_prompt_and_a_verify_chunk(block: Path) -> None:
    """A whole-model stage, a prompt in three chunks and a verify chunk: the prompt's verdict
    carries its last 6 positions (across chunks), the verify verdict rows 0..accepted; a
    session that did not ask gets none; all equal the reference within fp16."""
    sid, other = SessionId(1), SessionId(2)
    prefill = [
        Prefill(s, Epoch(0), ChunkSeq(i), start, start + 4 >= len(PROMPT), PROMPT[start:][:4])
        for s in (sid, other)
        for i, start in enumerate(range(0, len(PROMPT), 4))
    ]
    out, _, _ = await run_stage(
        block,
        [OpenSession(sid, max_len=64, features=6), OpenSession(other, max_len=64), *prefill],
    )
    first, second = (m for m in out if isinstance(m, Verdict))
    assert second.features is None and second.features_start == 0
    assert first.target_ids == second.target_ids
    assert first.features is not None and first.features.dtype == "float16"
    assert (first.features_start, first.features.shape) == (5, (6, 64))
    token = first.target_ids[0]
    got = torch.frombuffer(bytearray(first.features.data), dtype=torch.float16).view(6, 64)
    torch.testing.assert_close(got.float(), _normed(block, PROMPT)[5:], rtol=1e-3, atol=1e-3)
    # A verify chunk: its first draft right (the target's own next token), the second wrong.
    model = load_stage(block, 0, 2)
    with torch.inference_mode():
        logits = model(torch.tensor([[*PROMPT, token]]), 0, model.new_cache(64))  # [1, S, V]
    nxt = int(logits[0, -1].argmax())
    draft = (nxt, (nxt + 1) % 250)
    verify = Verify(sid, Epoch(0), ChunkSeq(3), len(PROMPT), ids=(token, *draft), draft=draft)
    out, _, _ = await run_stage(
        block, [OpenSession(sid, max_len=64, features=6), *prefill[:3], verify]
    )
    answer = [m for m in out if isinstance(m, Verdict)][-1]
    assert answer.accepted == 1 and answer.features is not None
    assert (answer.features_start, answer.features.shape) == (len(PROMPT), (2, 64))
    want = _normed(block, [*PROMPT, token, *draft])
    got = torch.frombuffer(bytearray(answer.features.data), dtype=torch.float16).view(2, 64)
    torch.testing.assert_close(got.float(), want[11:13], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("features", [MAX_FEATURES + 1, 10**9])
async def test_a_window_past_the_cap_is_a_request_fault(block: Path, features: int) -> None:
    """An OpenSession asking for more than MAX_FEATURES rows is refused with a ``request``
    fault naming the cap, allocating nothing; one at the cap opens."""
    sid = SessionId(1)
    out, executor, kv = await run_stage(block, [OpenSession(sid, max_len=64, features=features)])
    assert [(m.kind, m.session) for m in out if isinstance(m, Fault)] == [("request", sid)]
    assert str(MAX_FEATURES) in out[0].detail  # type: ignore[union-attr]
    assert kv == [0]
    out, executor, _ = await run_stage(block, [OpenSession(sid, max_len=64, features=MAX_FEATURES)])
    assert not out and executor.statistics().sessions == 1


# --- the wire ---------------------------------------------------------------------------------


def _verdict(**kw: Any) -> Verdict:
    base = Verdict(SessionId(1), Epoch(0), ChunkSeq(1), 11, target_ids=(4, 5), accepted=1)
    return attrs.evolve(base, **kw)


def test_features_cross_the_wire_and_cost_their_bytes_only() -> None:
    """A verdict's features round-trip; without them the frame is byte for byte the old one
    (fields at their default are omitted), and OpenSession likewise."""
    rows = to_wire(torch.randn(2, 576).half())
    plain, rich = _verdict(), _verdict(features=rows, features_start=11)
    assert decode(encode(rich)) == rich
    assert len(encode(rich)) - len(encode(plain)) < 2 * 576 * 2 + 64
    assert b"features" not in encode(plain) and b"features" not in encode(
        OpenSession(SessionId(1), 8)
    )


def test_the_wire_refuses_negative_windows_and_oversize_features() -> None:
    """A negative window or start is refused by ``encode``; features past ``max_tensor_bytes``
    are refused by ``decode`` before anything is allocated."""
    with pytest.raises(WireError, match="features"):
        encode(OpenSession(SessionId(1), 8, features=-1))
    with pytest.raises(WireError, match="features_start"):
        encode(_verdict(features_start=-1))
    big = _verdict(features=to_wire(torch.zeros(64, 576, dtype=torch.float16)), features_start=0)
    frame = encode(big)
    with pytest.raises(WireError, match="max_tensor_bytes"):
        decode(frame, limits=WireLimits(max_tensor_bytes=64 * 1024))
