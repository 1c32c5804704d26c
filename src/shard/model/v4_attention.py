"""DeepSeek-V4's attention: one shared K=V head over a sliding window, plus compressed entries.

transformers' ``DeepseekV4Attention`` with its ``DeepseekV4HCACompressor``,
``DeepseekV4CSACompressor`` and ``DeepseekV4Indexer``, op for op up to the cache. Queries go
through a low-rank ``wq_a -> q_norm -> wq_b`` and a weightless per-head RMSNorm; one key per
token (``wkv -> norm``) is also the value. Rope is interleaved on each head's trailing
``rotary_dim`` (the "main" tables on sliding layers, the "compress" ones elsewhere), and the
output is turned back by ``-sin`` before the grouped projection ``wo_a`` (``o_groups`` blocks)
and ``wo_b``. A learned sink per head joins the softmax.

A compressed layer adds one entry per window of ``m`` tokens (``compress_rates``): HCA pools a
window's ``wkv`` rows by softmax over ``wgate + ape``; CSA pools ``2m`` rows (the previous
window's first half-width "Ca" series with this window's second-half "Cb"), and its lightning
indexer (its own compressor at ``index_head_dim``, ``wq_b`` queries and ``weights_proj`` head
weights) keeps each query's ``index_topk`` best entries. Entries are normed, then turned by
the compress rope at the window's first position. A query at ``t`` sees entry ``w`` iff the
window has closed, ``(w + 1) m - 1 <= t``.

Cache, position-addressed (the rollback rule of ``shard.model.kvcache``): ``KVCache.k`` holds
each position's rotated K=V; ``KVCache.v`` holds each position's raw compressor rows
(``wkv``, ``wgate``) and, at the last position of each window, the window's finished entry —
then the indexer's raw rows and entry (``ModelConfig.kv_widths``). A forward at
``[start, start+S)`` writes its rows, then finishes exactly the windows whose last position
lies in the chunk, reading raw rows of earlier positions only from ``[0, start)``. Nothing is
carried in a buffer across calls (transformers' ``buffer_kv`` / ``overlap_kv``), so a
rejected draft chunk followed by a chunk at an earlier start recomputes what it overwrites,
and a verify chunk finishes the same windows from the same rows as its decode steps.

Cost: the raw rows make V4-Flash's CSA layers cache ``512 + 3200`` numbers a position against
transformers' window of 128 keys plus an entry per 4 tokens; a ring of the last ``2m`` raw
rows and of the window's keys would bring it down (not done here: it complicates rollback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.attention import RMSNorm
from shard.model.config import ModelConfig
from shard.model.hyper import unit_rms
from shard.model.kvcache import KVCache
from shard.model.linear import Linear

__all__ = ["Compressor", "Rows", "V4Attention", "rope_tail"]

#: One session's rows of a forward: ``(lo, hi, start, cache)``, rows ``[lo, hi)`` of the
#: packed input at positions ``[start, start + hi - lo)`` of ``cache``.
Rows = tuple[int, int, int, KVCache]


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``[..., S, D]`` with its trailing ``R`` dims turned in interleaved pairs by
    ``cos, sin`` ``[S, R/2]`` (transformers' V4 ``apply_rotary_pos_emb``, in float32)."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    r = int(cos.shape[-1])
    nope, rope = x[..., :-r], x[..., -r:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class Compressor(nn.Module):
    """A compressor of windows of ``ratio`` rows into entries of ``dim`` (``overlap``: CSA's
    two series, so its projections are ``2 dim`` wide)."""

    def __init__(self, d: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.wkv, self.wgate = Linear(d, width, bias=False), Linear(d, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(dim, eps)

    @property
    def width(self) -> int:
        """Numbers a position takes in the cache: raw kv, raw gate, the entry."""
        return 2 * int(self.ape.shape[1]) + self.dim

    def finish(self, state: Tensor, w0: int, w1: int, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Entries ``[B, w1 - w0, dim]`` of windows ``[w0, w1)`` from ``state`` ``[B, P, width]``
        (positions ``[0, P)``, ``P >= w1 ratio``), turned by ``rope`` (the full tables)."""
        m, c = self.ratio, int(self.ape.shape[1])
        b, n = int(state.shape[0]), w1 - w0
        kv = state[:, w0 * m : w1 * m, :c].reshape(b, n, m, c)
        gate = state[:, w0 * m : w1 * m, c : 2 * c].reshape(b, n, m, c) + self.ape
        if self.overlap:
            d = self.dim
            lo = max(w0 - 1, 0)
            prev_kv = state[:, lo * m : (w1 - 1) * m, :d].reshape(b, -1, m, d)
            prev_gate = state[:, lo * m : (w1 - 1) * m, c : c + d].reshape(b, -1, m, d)
            prev_gate = prev_gate + self.ape[:, :d]
            if w0 == 0:  # no window before the first: zero rows of weight zero
                prev_kv = torch.cat([kv.new_zeros(b, 1, m, d), prev_kv], dim=1)
                prev_gate = torch.cat([gate.new_full((b, 1, m, d), float("-inf")), prev_gate], 1)
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, n, 2m, d]
            gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        pooled = self.norm(pooled)  # [B, n, dim]
        pos = torch.arange(w0, w1, device=state.device) * m
        cos, sin = rope[0].index_select(0, pos), rope[1].index_select(0, pos)
        return rope_tail(pooled.to(kv.dtype), cos.to(kv.dtype), sin.to(kv.dtype))


class Indexer(nn.Module):
    """CSA's lightning indexer: its compressor, ``wq_b`` queries, ``weights_proj``."""

    def __init__(self, config: ModelConfig, ratio: int) -> None:
        super().__init__()
        v = config.v4
        assert v is not None
        self.heads, self.dim, self.topk = v.index_n_heads, v.index_head_dim, v.index_topk
        self.compressor = Compressor(config.hidden_size, self.dim, ratio, True, config.rms_norm_eps)
        self.wq_b = Linear(v.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = Linear(config.hidden_size, self.heads, bias=False)

    def select(self, q: Tensor, w: Tensor, entries: Tensor, visible: Tensor) -> Tensor:
        """Boolean ``[B, S, T]``: of the ``visible`` ``[S, T]`` entries ``[B, T, Di]``, each
        query's (``q`` ``[B, S, Hi, Di]``, weights ``w`` ``[B, S, Hi]``) ``index_topk`` best."""
        t = int(entries.shape[1])
        if t <= self.topk:
            return visible.expand(int(q.shape[0]), -1, -1)
        scores = torch.matmul(q.float(), entries.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * self.dim**-0.5  # [B, S, Hi, T]
        scores = (scores * w.unsqueeze(-1)).sum(dim=2).masked_fill(~visible, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : self.topk]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
        return keep & visible


class V4Attention(nn.Module):
    """One V4 layer's attention (module docstring)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        v = config.v4
        assert v is not None
        d, h, hd = config.hidden_size, config.n_heads, config.head_dim
        self.heads, self.head_dim, self.groups = h, hd, v.o_groups
        self.eps = config.rms_norm_eps
        self.window = config.sliding_window or config.max_position_embeddings
        self.ratio = v.ratio(layer)
        self.wq_a = Linear(d, v.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(v.q_lora_rank, config.rms_norm_eps)
        self.wq_b = Linear(v.q_lora_rank, h * hd, bias=False)
        self.wkv = Linear(d, hd, bias=False)
        self.norm = RMSNorm(hd, config.rms_norm_eps)
        self.wo_a = Linear(h * hd // v.o_groups, v.o_groups * v.o_lora_rank, bias=False)
        self.wo_b = Linear(v.o_groups * v.o_lora_rank, d, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        csa = v.kinds[layer] == "compressed_sparse_attention"
        self.compressor = (
            Compressor(d, hd, self.ratio, csa, config.rms_norm_eps) if self.ratio else None
        )
        self.indexer = Indexer(config, self.ratio) if csa else None

    def forward(
        self,
        x: Tensor,
        rows: list[Rows],
        layer: int,
        rope: tuple[Tensor, Tensor],
        tables: tuple[Tensor, Tensor],
    ) -> Tensor:
        """``x`` ``[B, T, D]`` (normed), each ``rows`` segment attending its own cache:
        ``[B, T, D]``. ``rope``: ``[T, R/2]`` at the rows' positions (this layer's kind);
        ``tables``: the whole compress tables (entries' and indexer queries' rope)."""
        b, t, _ = x.shape
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        q = rope_tail(unit_rms(q, self.eps), *rope)  # [B, H, T, hd]
        kv = rope_tail(self.norm(self.wkv(x)).unsqueeze(1), *rope)  # [B, 1, T, hd]
        raw = self._raw(x)  # [B, T, state] compressors' rows
        iq = iw = None
        if self.indexer is not None:  # queries at the rows' positions, compress rope
            ix = self.indexer
            iq = ix.wq_b(q_res).view(b, t, ix.heads, ix.dim).transpose(1, 2)
            iq = rope_tail(iq, *self._rows_rope(rows, tables, iq.dtype)).transpose(1, 2)
            iw = ix.weights_proj(x).float() * ix.heads**-0.5  # [B, T, Hi]
        outs = []
        for lo, hi, start, cache in rows:
            keys = self._write(cache, layer, start, kv[:, :, lo:hi], raw[:, lo:hi], tables)
            sel = None
            if iq is not None and iw is not None:
                sel = (iq[:, lo:hi], iw[:, lo:hi])
            outs.append(self._attend(q[:, :, lo:hi], keys, start, cache, layer, sel))
        y = torch.cat(outs, dim=2)  # [B, H, T, hd]
        y = rope_tail(y, rope[0], -rope[1]).transpose(1, 2)  # [B, T, H, hd]
        g = y.reshape(b * t, self.groups, -1).transpose(0, 1)  # [G, N, H hd / G]
        wa = self.wo_a.weight.view(self.groups, -1, int(g.shape[-1])).transpose(1, 2)
        grouped = torch.bmm(g, wa).transpose(0, 1).reshape(b, t, -1)
        out: Tensor = self.wo_b(grouped)
        return out

    def _rows_rope(
        self, rows: list[Rows], tables: tuple[Tensor, Tensor], dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        pos = torch.cat([torch.arange(s, s + hi - lo) for lo, hi, s, _ in rows])
        pos = pos.to(tables[0].device)
        return tables[0].index_select(0, pos).to(dtype), tables[1].index_select(0, pos).to(dtype)

    def _raw(self, x: Tensor) -> Tensor:
        """The compressors' raw rows ``[B, T, state]`` (kv, gate; an entry slot; the indexer's)."""
        parts: list[Tensor] = []
        for c in (self.compressor, self.indexer.compressor if self.indexer else None):
            if c is not None:
                kv, gate = c.wkv(x), c.wgate(x)
                parts += [kv, gate, kv.new_zeros(*kv.shape[:-1], c.dim)]
        return torch.cat(parts, dim=-1) if parts else x[..., :0]

    def _write(
        self, cache: KVCache, layer: int, start: int, kv: Tensor, raw: Tensor,
        tables: tuple[Tensor, Tensor],
    ) -> Tensor:  # fmt: skip
        """Write a segment's K=V and raw rows at ``[start, end)``, finish the windows that
        close in it; return K=V ``[B, 1, end, hd]``."""
        end = start + int(kv.shape[2])
        cache.k[layer, :, :, start:end] = kv
        if raw.shape[-1]:
            cache.v[layer, :, 0, start:end, : raw.shape[-1]] = raw
        m = self.ratio
        w0, w1 = start // m if m else 0, end // m if m else 0
        base = 0
        for c in (self.compressor, self.indexer.compressor if self.indexer else None):
            if c is None:
                continue
            if w1 > w0:
                state = cache.v[layer, :, 0, :end, base : base + c.width]
                entries = c.finish(state, w0, w1, tables)  # [B, n, dim]
                last = torch.arange(w0 + 1, w1 + 1, device=kv.device) * m - 1
                cache.v[layer, :, 0, last, base + c.width - c.dim : base + c.width] = entries
            base += c.width
        return cache.k[layer, :, :, :end]

    def _entries(self, cache: KVCache, layer: int, end: int, base: int, c: Compressor) -> Tensor:
        """The finished entries ``[B, T, dim]`` of windows closed before ``end``."""
        last = torch.arange(1, end // c.ratio + 1, device=cache.v.device) * c.ratio - 1
        return cache.v[layer, :, 0, last, base + c.width - c.dim : base + c.width]

    def _attend(
        self, q: Tensor, keys: Tensor, start: int, cache: KVCache, layer: int,
        sel: tuple[Tensor, Tensor] | None,
    ) -> Tensor:  # fmt: skip
        """Attention of ``q`` ``[B, H, S, hd]`` at ``[start, start+S)`` over the window's keys
        ``[B, 1, end, hd]`` and the closed entries, with the sinks: ``[B, H, S, hd]``."""
        b, _, s, _ = q.shape
        end = start + s
        q_pos = torch.arange(start, end, device=q.device)[:, None]  # [S, 1]
        k_pos = torch.arange(end, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)  # [S, end]
        mask = mask.expand(b, 1, s, end)
        if self.compressor is not None and end >= self.ratio:
            entries = self._entries(cache, layer, end, 0, self.compressor)  # [B, T, hd]
            ends = torch.arange(1, int(entries.shape[1]) + 1, device=q.device) * self.ratio - 1
            visible = ends[None, :] <= q_pos  # [S, T]
            if sel is not None and self.indexer is not None:
                ic = self.indexer.compressor
                idx = self._entries(cache, layer, end, self.compressor.width, ic)
                visible = self.indexer.select(sel[0], sel[1], idx, visible)  # [B, S, T]
            keys = torch.cat([keys, entries.unsqueeze(1)], dim=2)
            mask = torch.cat([mask, visible.expand(b, s, -1).unsqueeze(1)], dim=-1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.head_dim**-0.5  # [B, H, S, K]
        scores = scores.masked_fill(~mask, float("-inf"))
        sinks = self.attn_sink.reshape(1, -1, 1, 1).expand(b, -1, s, 1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys)  # [B, H, S, hd]
