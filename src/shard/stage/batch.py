"""Batching for the stage executor: gather the chunks waiting now, run them in one forward.

``gather`` takes the chunk the executor just dequeued and every further chunk already waiting
(``receive_nowait``; with ``window_s`` > 0 it also waits that long for more), up to
``max_rows`` rows. It stops at the first control message (``OpenSession``, ``EndSession``, a
relayed fault or receipt) and hands it back to be handled *after* the batch: control messages
keep their FIFO place relative to every chunk before and after them, so a session's KV exists
before its first chunk and is freed after its last. A chunk that would overflow ``max_rows``
is handed back the same way and starts the next batch (a chunk longer than ``max_rows`` runs
alone). The default window is 0: take what is waiting, never wait for more, so a lone
session is never delayed by batching.

``forward_batch`` is the worker-thread body: one chunk runs exactly as an unbatched stage
runs it (``StageModel.forward``, or the stage's CUDA graphs); several run packed
(``shard.model.packed``: packed rows, each session's own KV cache, a block-diagonal causal
mask realised per segment — that module says why). At the tail each chunk's own rows make its
own choice (``shard.decode.verify``), keyed by its session's sampling and its positions, so a
seeded request samples the same tokens alone or in a crowd. A chunk whose session asked for
features (``Planned.features``) also gets the final norm's output at its last rows
(``feature_rows``), computed once with its logits (``StageModel.finish``) and moved to the CPU
in the wire's dtype (``shard.stage.features``); the other chunks of its batch are computed as
before. A chunk whose session asked for layer states (``Planned.carry``) gets the states
entering this block's feature layers appended to those that arrived with it: ``Carried``
(not the tail) or its ``Answer.features`` (the tail). Such a batch runs eagerly (a graph's
replay runs no hook), with the arithmetic its graph would have.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from typing import TypeGuard

import attrs
import torch
import trio

from shard.decode.verify import choose_token, verify_chunk
from shard.messages import Message, Prefill, Sampling, SessionId, Verify
from shard.model.kvcache import KVCache
from shard.model.llama import StageModel
from shard.model.packed import Segment, forward_packed, segment_bounds
from shard.stage.features import capturing, carried_rows, wire_dtype
from shard.stage.graphs import ChunkGraphs

__all__ = [
    "DEFAULT_MAX_BATCH_ROWS",
    "Answer",
    "Carried",
    "Choice",
    "Planned",
    "Queued",
    "feature_rows",
    "forward_batch",
    "gather",
    "is_chunk",
    "pack",
    "rows_of",
]

#: Rows per forward at most, by default: a few prefill chunks' worth (``limits.prefill_chunk``
#: is 128), far more than any number of decode or verify chunks a ring has in flight.
DEFAULT_MAX_BATCH_ROWS = 512

#: The tail's choice for one chunk: (target ids, accepted), or None (no answer is due).
Choice = tuple[tuple[int, ...], int] | None


@attrs.frozen
class Answer:
    """The tail's result for one chunk: its choice and, when its session asked for features,
    the final norm's output at its last ``feature_rows`` rows (``[F, D]``, CPU, wire dtype)."""

    choice: Choice
    features: torch.Tensor | None = None


@attrs.frozen
class Carried:
    """A chunk's output before the tail when its session asked for layer states: its hidden
    states and the session's layer states so far (``[F, c x D]``, CPU, wire dtype; None
    while no feature layer lies at or before this block)."""

    hidden: torch.Tensor
    states: torch.Tensor | None


@attrs.frozen
class Queued:
    """A message in the executor's local queue and the wall time it arrived at this stage."""

    msg: Message
    arrived: float


@attrs.frozen
class Planned:
    """A chunk that passed every check and will run: its input rows and its session's KV."""

    msg: Prefill | Verify
    x: torch.Tensor  # ids [1, S] (first stage) or hidden [1, S, D]
    cache: KVCache
    sampling: Sampling
    arrived: float
    features: int = 0  # the session's final-norm feature window at the tail (0: none asked)
    layers: tuple[int, ...] = ()  # this block's feature layers (local) the session captures
    carry: int = 0  # rows of layer states this chunk carries (0: none asked)
    states: torch.Tensor | None = None  # [carry, c x D]: captured upstream (CPU, wire dtype)

    @property
    def rows(self) -> int:
        return int(self.x.shape[1])


def is_chunk(msg: Message) -> TypeGuard[Prefill | Verify]:
    return isinstance(msg, Prefill | Verify)


def rows_of(msg: Prefill | Verify) -> int:
    """Positions a chunk feeds: its ids on the first edge, else the hidden states' ``[1, S, D]``."""
    return len(msg.ids) if msg.hidden is None else msg.hidden.shape[1]


async def gather(
    first: Queued,
    queue: trio.MemoryReceiveChannel[Queued],
    *,
    max_rows: int,
    window_s: float = 0.0,
    expected: Collection[SessionId] = (),
) -> tuple[list[Queued], Queued | None]:
    """``first`` (a chunk) and the chunks queued behind it, up to ``max_rows`` rows in all;
    returns them and the message that ended the gather (handle it next), if any.

    It waits — at most ``window_s`` — only while a session of ``expected`` (the sessions the
    stage has seen lately) has no chunk in the batch yet: chunks of one wave of sessions
    reach a stage spread out (each verdict is handled in turn at the coordinator), and a
    forward of the first alone would split the wave for good. A lone session, or a batch
    holding every expected session, never waits.

    Cancellation: only the wait is a checkpoint; with ``window_s`` 0 this never blocks.
    A closed queue just ends the gather.
    """
    assert is_chunk(first.msg)
    batch, rows = [first], rows_of(first.msg)
    missing = set(expected) - {first.msg.session}
    deadline = trio.current_time() + window_s
    while rows < max_rows:
        item = await _next(queue, deadline if missing else -math.inf)
        if item is None:
            break
        if not is_chunk(item.msg) or rows + rows_of(item.msg) > max_rows:
            return batch, item
        batch.append(item)
        rows += rows_of(item.msg)
        missing.discard(item.msg.session)
    return batch, None


async def _next(queue: trio.MemoryReceiveChannel[Queued], deadline: float) -> Queued | None:
    """The next queued message if one is waiting, or arrives before ``deadline``; else None."""
    try:
        return queue.receive_nowait()
    except trio.WouldBlock:
        pass
    except trio.EndOfChannel:
        return None
    if trio.current_time() >= deadline:
        return None
    with trio.move_on_at(deadline):
        try:
            return await queue.receive()
        except trio.EndOfChannel:
            return None
    return None


def pack(planned: Sequence[Planned]) -> tuple[torch.Tensor, list[Segment]]:
    """The chunks' rows end to end (``[1, T]`` ids or ``[1, T, D]`` hidden) and their segments."""
    x = torch.cat([p.x for p in planned], dim=1)
    return x, [Segment(p.msg.start, p.rows, p.cache) for p in planned]


def forward_batch(
    model: StageModel, graphs: ChunkGraphs | None, planned: Sequence[Planned]
) -> list[torch.Tensor | Carried | Answer]:
    """Worker-thread body: the block's forward for every planned chunk, in order; per chunk its
    hidden states ``[1, S, D]`` (not the tail; ``Carried`` when it carries layer states) or
    its ``Answer`` (the tail). A batch with no layer states runs exactly as before they
    existed."""
    if not any(p.carry for p in planned):
        return list(_forward(model, graphs, planned))
    local = sorted({j for p in planned for j in p.layers})
    blocks = model.blocks()
    # the input norm of each layer reads the residual stream entering it, in every path (one
    # chunk, packed rows, positions as a tensor): the packed path calls no layer as a whole
    with capturing([blocks[j].input_layernorm for j in local]) as taken:
        outs = _forward(model, graphs, planned, eager=True)
    dtype = wire_dtype(model.dtype)
    result: list[torch.Tensor | Carried | Answer] = []
    end = 0  # where the chunk's rows end in the forward's (packed) rows
    for p, out in zip(planned, outs, strict=True):
        end += p.rows
        if not p.carry:
            result.append(out)
            continue
        parts = [] if p.states is None else [p.states]
        for j in p.layers:
            t = taken[local.index(j)]
            assert t is not None, "a captured layer did not run"
            parts.append(t[0, end - p.carry : end].to("cpu", dtype))  # [F, D]
        states = torch.cat(parts, dim=-1) if parts else None
        result.append(
            attrs.evolve(out, features=states) if isinstance(out, Answer) else Carried(out, states)
        )
    return result


def _forward(
    model: StageModel, graphs: ChunkGraphs | None, planned: Sequence[Planned], eager: bool = False
) -> Sequence[torch.Tensor | Answer]:
    """The block's forward for every planned chunk (``forward_batch``); ``eager``: never a
    graph's replay, with the graph's arithmetic.

    The tail runs its head only on the rows a choice reads (``head_rows``): none for a
    prefill chunk that is not the last, one for the last, ``K+1`` for a verify chunk — a
    chunk's choice is the same either way (the head treats rows independently), and a
    128-row prefill chunk no longer pays for 127 rows of the largest matrix it holds. Captured
    CUDA graphs keep their whole-chunk logits; a chunk that wants features runs eagerly
    (``ChunkGraphs.with_features``)."""
    with torch.inference_mode():
        if not model.is_last:
            if len(planned) == 1:  # exactly the unbatched path
                p = planned[0]
                if graphs is None:
                    return [model(p.x, p.msg.start, p.cache)]
                run = graphs.eager if eager else graphs
                return [run(p.x, p.msg.start, p.cache)]
            x, segments = pack(planned)
            static = graphs is not None and graphs.mode != "off"
            out = forward_packed(model, x, segments, static=static)
            return [out[:, lo:hi] for lo, hi in segment_bounds(segments)]
        dtype = wire_dtype(model.dtype)
        return [
            Answer(_choose(logits, p), None if f is None else f[0].to("cpu", dtype))
            for (logits, f), p in zip(_tail(model, graphs, planned, eager), planned, strict=True)
        ]


def _tail(
    model: StageModel, graphs: ChunkGraphs | None, planned: Sequence[Planned], eager: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per planned chunk, the tail's logits ``[1, R >= head_rows, V]`` and its features
    ``[1, feature_rows, D]`` (None when not asked); a batch that asks for no features runs
    exactly as before features existed."""
    feats = [feature_rows(p) for p in planned]
    if len(planned) == 1:  # exactly the unbatched path
        p, f = planned[0], feats[0]
        if f:
            out = (
                graphs.with_features(p.x, p.msg.start, p.cache, f)
                if graphs is not None
                else model(p.x, p.msg.start, p.cache, head_rows=head_rows(p), feature_rows=f)
            )
            return [(out.logits, out.features)]
        if graphs is not None:
            run = graphs.eager if eager else graphs
            return [(run(p.x, p.msg.start, p.cache), None)]
        return [(model(p.x, p.msg.start, p.cache, head_rows=head_rows(p)), None)]
    x, segments = pack(planned)
    static = graphs is not None and graphs.mode != "off"
    needed = [head_rows(p) for p in planned]
    ends = list(itertools.accumulate(needed))
    if not any(feats):
        logits = forward_packed(model, x, segments, static=static, head_rows=needed)
        return [(logits[:, hi - n : hi], None) for n, hi in zip(needed, ends, strict=True)]
    out = forward_packed(model, x, segments, static=static, head_rows=needed, feature_rows=feats)
    f_ends = list(itertools.accumulate(feats))
    return [
        (out.logits[:, hi - n : hi], out.features[:, fhi - f : fhi] if f else None)
        for n, hi, f, fhi in zip(needed, ends, feats, f_ends, strict=True)
    ]


def head_rows(p: Planned) -> int:
    """Rows of a chunk whose logits the tail's choice reads (its last ones)."""
    msg = p.msg
    if isinstance(msg, Prefill):
        return 1 if msg.final and not msg.replay else 0
    return len(msg.draft) + 1


def feature_rows(p: Planned) -> int:
    """Rows of a chunk whose features the tail keeps (its last ones; 0 unless its session
    asked): every row of a verify chunk (which of them a verdict carries depends on how many
    drafts hold), up to the window of a prompt chunk, none of a replayed one."""
    return carried_rows(p.msg, p.features, p.rows)


def _choose(out: torch.Tensor, p: Planned) -> Choice:
    """The target's choice from one chunk's logits ``[1, R, V]``, its last ``R >=
    head_rows(p)`` rows (the tail)."""
    msg = p.msg
    rows = head_rows(p)
    if not rows:
        return None
    # The choice is made in fp32 on the CPU whatever the block's dtype and device: only the
    # rows it reads (1, or K+1) cross, and the sampler's generator is a CPU one.
    logits = out[0, -rows:].to("cpu", torch.float32)  # [rows, V]
    if isinstance(msg, Prefill):
        return (choose_token(logits[-1], p.sampling, msg.start + p.rows),), 0
    verdict = verify_chunk(logits, msg.draft, p.sampling, msg.start + 1, msg.q)
    return verdict.target_ids, verdict.accepted
