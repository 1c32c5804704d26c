"""One forward for many sessions' chunks: packed rows, each segment attending to its own cache.

A batch is the chunks' rows laid end to end, ``[1, T, D]`` with ``T`` the sum of their lengths
(packed, not padded: a 1-row decode step next to a 128-row prefill chunk wastes nothing).
Every op that treats rows independently — the embedding, RMSNorm, the q/k/v/o projections, the
MLP, the head — runs once over all ``T`` rows, so the block's weights are read once per batch
instead of once per chunk: that is the whole gain. Attention is the one op that mixes rows,
and it runs per segment: segment ``i`` writes its K/V into *its own session's* ``KVCache`` at
its own positions and attends to that cache under its own causal mask. That is a
block-diagonal causal mask over the packed rows, realised as a loop over segments instead of
one ``[T, sum of keys]`` mask, because each session keeps its own preallocated cache (batch 1):

- rollback stays overwrite-by-position, per session, with nothing shared to corrupt;
- a segment's attention is the very computation it runs alone (same shapes, same kernel), so
  batching changes only the row count the dense layers see;
- the executor's failover replay, receipts, KV accounting and CUDA-graph captures keep
  working per session unchanged (a paged cache with block tables would rewrite all of them
  for a saving — no fragmentation of a cache that is preallocated anyway — not needed here).

Segments are attended in order inside every layer, so two chunks of one session in the same
batch (pipelined verify chunks) see exactly the KV they would see one after the other: at
layer ``j`` the later one reads what the earlier one has just written at layer ``j``.

``static``: attend the way ``StageModel.forward_at`` does (the whole cache under a mask,
positions as a tensor), for stages whose lone chunks run through CUDA graphs — a session's
arithmetic then does not depend on whether its chunk was batched.

Batch invariance: per row, only the dense layers' matrix products see a different shape; a
CPU or GPU kernel may sum a row in a different order for a different row count, so a row's
last bits may differ from its lone run. ``tests/test_batch.py`` measures this and counts where
a greedy choice could flip (numerical ties only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import attrs
import torch
from torch import Tensor

from shard.model.kvcache import KVCache
from shard.model.llama import StageModel, TailOut
from shard.model.masks import causal_mask, static_mask

__all__ = ["Segment", "forward_packed", "segment_bounds"]


@attrs.frozen
class Segment:
    """One chunk of a packed batch: ``rows`` positions from ``start`` into ``cache``."""

    start: int
    rows: int
    cache: KVCache


def segment_bounds(segments: Sequence[Segment]) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each segment in the packed rows, in order."""
    bounds, lo = [], 0
    for seg in segments:
        bounds.append((lo, lo + seg.rows))
        lo += seg.rows
    return bounds


@overload
def forward_packed(
    model: StageModel,
    x: Tensor,
    segments: Sequence[Segment],
    *,
    static: bool = False,
    head_rows: Sequence[int] | None = None,
) -> Tensor: ...
@overload
def forward_packed(
    model: StageModel,
    x: Tensor,
    segments: Sequence[Segment],
    *,
    static: bool = False,
    head_rows: Sequence[int],
    feature_rows: Sequence[int],
) -> TailOut: ...


@torch.no_grad()
def forward_packed(
    model: StageModel,
    x: Tensor,
    segments: Sequence[Segment],
    *,
    static: bool = False,
    head_rows: Sequence[int] | None = None,
    feature_rows: Sequence[int] | None = None,
) -> Tensor | TailOut:
    """Run ``segments`` packed in ``x``: ids ``[1, T]`` (first stage) or hidden ``[1, T, D]``.

    Returns hidden ``[1, T, D]`` or fp32 logits ``[1, T, V]`` (tail), rows in segment order;
    with ``head_rows`` (one count per segment) the tail's logits are only of each segment's
    last ``head_rows[i]`` rows, ``[1, sum(head_rows), V]``, in segment order. With
    ``feature_rows`` too (the tail) it returns a ``TailOut``: those logits and the final
    norm's output at each segment's last ``feature_rows[i]`` rows, ``[1, sum(feature_rows),
    D]`` in segment order (``_finish``).
    Each segment must fit its cache (``StageModel._check_input`` rules; the executor checks
    before it packs). ``ValueError`` if the rows do not add up.
    """
    total = sum(seg.rows for seg in segments)
    if x.shape[0] != 1 or int(x.shape[1]) != total or not segments:
        raise ValueError(f"packed input {tuple(x.shape)} does not hold {total} rows in one batch")
    for seg in segments:
        model._check_input(x[:, : seg.rows], seg.start, seg.cache)
    own = getattr(model, "run_packed", None)  # a family with its own layers (DeepSeek-V4)
    h = own(x, segments, static) if own is not None else _layers(model, x, segments, static)
    bounds = segment_bounds(segments)
    if model.norm is None or model.lm_head is None:
        return h
    if head_rows is None:
        return model.head(h)  # [1, T, V]
    _check_rows("head_rows", head_rows, segments)
    if feature_rows is not None:
        _check_rows("feature_rows", feature_rows, segments)
        return _finish(model, h, bounds, head_rows, feature_rows)
    rows = [h[:, hi - n : hi] for n, (_lo, hi) in zip(head_rows, bounds, strict=True)]
    return model.head(torch.cat(rows, dim=1))  # [1, sum(head_rows), V]


def _layers(model: StageModel, x: Tensor, segments: Sequence[Segment], static: bool) -> Tensor:
    """The block's layers over packed ``x``: hidden ``[1, T, D]`` (module docstring)."""
    total, bounds = int(x.shape[1]), segment_bounds(segments)
    h: Tensor = model.embed(x) if model.embed_tokens is not None else x  # [1, T, D]
    dev = h.device
    pos = [torch.arange(s.start, s.start + s.rows, device=dev) for s in segments]  # [S_i] each
    if static:
        masks = [
            {w: static_mask(p, s.cache.max_len, w) for w in model.windows()}
            for p, s in zip(pos, segments, strict=True)
        ]
        parts = [model.ropes_at(p, h.dtype) for p in pos]
    else:  # [S_i, start+S_i] each
        masks = [
            {w: causal_mask(s.start, s.rows, dev, w) for w in model.windows()} for s in segments
        ]
        parts = [model.ropes_at(slice(s.start, s.start + s.rows), h.dtype) for s in segments]
    ropes = {  # kind -> [T, R/2] each, segments in order
        kind: (torch.cat([p[kind][0] for p in parts]), torch.cat([p[kind][1] for p in parts]))
        for kind in parts[0]
    }
    for j, layer in enumerate(model.blocks()):
        attn, slot = layer.mixer, model.cache_slot(j)
        # q, k, v [1, H|KV, T, Dh] (MLA: q, latent, k_pe, and a DSA indexer's rows after;
        # a linear-attention layer: its convolution's input, z, b, a [1, 1, T, *])
        projected = attn.project(layer.input_layernorm(h), ropes[layer.local_rope])
        ys = []
        for i, (lo, hi) in enumerate(bounds):
            seg = segments[i]
            start: int | Tensor = pos[i] if static else seg.start
            mine = [t[:, :, lo:hi] for t in projected]
            y = attn.attend(
                *mine, mask=masks[i][layer.window], cache=seg.cache, layer=slot, start=start
            )
            ys.append(y)  # [1, H, S_i, Dh]
        y = torch.cat(ys, dim=2).transpose(1, 2).reshape(1, total, -1)  # [1, T, H*Dh]
        h = layer.feed_forward(layer.attn_residual(h, attn.o_proj(y)))
    return h


def _check_rows(name: str, counts: Sequence[int], segments: Sequence[Segment]) -> None:
    if len(counts) != len(segments) or any(
        not 0 <= n <= seg.rows for n, seg in zip(counts, segments, strict=True)
    ):
        raise ValueError(f"{name} {list(counts)} do not fit the segments' rows")


def _finish(
    model: StageModel,
    h: Tensor,
    bounds: Sequence[tuple[int, int]],
    head_rows: Sequence[int],
    feature_rows: Sequence[int],
) -> TailOut:
    """The tail's logits and features of packed ``h`` ``[1, T, D]``, the norm run once over
    each segment's last ``max(head, feature)`` rows; the head reads a fresh concatenation of
    its rows, laid out as in the path without features."""
    assert model.norm is not None and model.lm_head is not None
    wide = [max(a, b) for a, b in zip(head_rows, feature_rows, strict=True)]
    normed = model.norm(
        torch.cat([h[:, hi - m : hi] for m, (_lo, hi) in zip(wide, bounds, strict=True)], 1)
    )
    heads, feats, end = [], [], 0  # normed [1, sum(wide), D]; ``end``: a segment's last row + 1
    for m, n_head, n_feat in zip(wide, head_rows, feature_rows, strict=True):
        end += m
        heads.append(normed[:, end - n_head : end])
        feats.append(normed[:, end - n_feat : end])
    logits = model.logits(torch.cat(heads, dim=1))  # [1, sum(head_rows), V]
    return TailOut(logits, torch.cat(feats, dim=1))  # [1, sum(feature_rows), D]
