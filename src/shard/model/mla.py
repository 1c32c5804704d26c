"""Multi-head latent attention (DeepSeek-V3), attending over a cache of latents.

transformers' ``DeepseekV3Attention``, op for op up to the cache: a query (through the low-rank
``q_a_proj -> q_a_layernorm -> q_b_proj``, or a plain ``q_proj``) split per head into
``qk_nope_head_dim`` unrotated and ``qk_rope_head_dim`` rotated dimensions; one
``kv_a_proj_with_mqa`` row per token split into the latent ``c`` (``kv_lora_rank``, normed by
``kv_a_layernorm``) and one rotary key ``k_pe`` shared by every head. Rotary embeddings turn
the rope dimensions only, in DeepSeek's interleaved layout (pairs of adjacent dimensions,
``apply_rotary_pos_emb_interleave``) unless ``rope_interleave`` is false.

The KV cache holds what transformers' cache holds, and no more: per layer and position the
normed latent (``KVCache.k``, width ``kv_lora_rank``) and the rotated ``k_pe``
(``KVCache.v``, width ``qk_rope_head_dim``), one "head" each — 576 numbers a token for
DeepSeek-V3 against 32,768 for its expanded keys and values.

Decode approach: the up-projection is **absorbed** (the MLA decode trick), never expanded
over the cache. ``kv_b_proj`` ``[H (nope + v), r]`` is read as per-head ``W_k`` ``[nope, r]``
and ``W_v`` ``[v, r]``; head ``h``'s score against position ``t`` is
``(q_nope W_k) . c_t + q_rope . k_pe_t`` (equal to transformers' ``q_nope . (W_k c_t) + ...``
up to float rounding), and its output is ``(sum_t p_t c_t) W_v^T``. Why:

- a key at position ``t`` is the cached bits themselves, not a product recomputed over a
  cache whose length changes every step, so a verify chunk's row and that row's decode step
  read identical keys; with ``rowwise`` (quantized blocks) a short chunk runs row by row
  through exactly its decode step's ops, bit for bit (as ``Attention.rowwise``);
- a step costs ``O(H (r + rope))`` per cached position instead of re-expanding
  ``H (nope + v)`` numbers per position per layer.

GLM-5 adds DeepSeek sparse attention (``shard.model.dsa``): an ``Indexer`` projects from the
same input and low-rank query, caches its key after ``k_pe`` in ``KVCache.v``, and narrows each
row's mask to its ``index_topk`` best-scored keys before the absorbed attention; ``project``
then returns the indexer's queries and head weights too (rows on dimension 2, like the rest,
so ``shard.model.packed`` slices them per session), and ``attend`` takes them after ``k_pe``.

Measured against transformers' expansion in float32 (``tests/test_deepseek_v3.py``): logits
within 1.5e-5 (low-rank query) and 6.2e-5 (plain ``q_proj``) of transformers' (std ~3.3);
the cache equals transformers' latent cache within 1e-5. ``kv_b_proj`` stays a dense matrix
in the model dtype under ``weights = int8 / int4`` (a ``KvUp``, not a ``Linear``: the
absorbed products read its halves per head); everything else quantizes as a linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.attention import ROWWISE_MAX_ROWS, RMSNorm, apply_rotary
from shard.model.config import ModelConfig
from shard.model.dsa import Indexer
from shard.model.kvcache import KVCache
from shard.model.linear import Linear

__all__ = ["LATENT_EPS", "KvUp", "MLAttention", "apply_rotary_interleaved"]

#: transformers builds ``q_a_layernorm`` and ``kv_a_layernorm`` with its RMSNorm's default
#: epsilon, not the config's ``rms_norm_eps``.
LATENT_EPS = 1e-6


def apply_rotary_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, S, R]`` whose pairs are adjacent dimensions ``(2i, 2i + 1)`` by
    ``cos, sin`` ``[S, R/2]``; the output holds the pairs' first halves, then their second
    halves (transformers' ``apply_rotary_pos_emb_interleave``, op for op)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [B, H, S, R/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KvUp(nn.Module):
    """``kv_b_proj``: the latent's up-projection ``[H (nope + v), r]``, held as a plain matrix
    (the absorbed attention reads it per head; the loader quantizes ``Linear`` s only)."""

    def __init__(self, rank: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out, rank))


class MLAttention(nn.Module):
    """DeepSeek-V3's attention over a latent KV cache (module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        a = config.mla
        if a is None:
            raise ValueError("MLAttention needs a config with mla set")
        d, h, bias = config.hidden_size, config.n_heads, config.attention_bias
        self.n_heads, self.nope, self.rope = h, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.rank, self.v_dim, self.interleave = a.kv_lora_rank, a.v_head_dim, a.rope_interleave
        self.scale = config.attn_scale if config.attn_scale is not None else a.qk_head_dim**-0.5
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if a.q_lora_rank is None:
            self.q_proj = Linear(d, h * a.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(d, a.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_EPS)
            self.q_b_proj = Linear(a.q_lora_rank, h * a.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_EPS)
        self.kv_b_proj = KvUp(self.rank, h * (self.nope + self.v_dim))
        self.o_proj = Linear(h * self.v_dim, d, bias=bias)
        self.indexer = Indexer(config) if config.dsa is not None else None
        #: attend a short chunk row by row, each row through its own decode step's ops
        #: (``Attention.rowwise``; set by the loader on quantized blocks)
        self.rowwise = False

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        """``x`` ``[B, S, D]`` at positions ``[start, start+S)`` (``Attention.forward``)."""
        parts = self.project(x, rope)
        y = self.attend(*parts, mask=mask, cache=cache, layer=layer, start=start)  # [B,H,S,v]
        b, s, _ = x.shape
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.v_dim))
        return out

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        """The query ``[B, H, S, nope + rope]`` (rope part rotated), the normed latent
        ``[B, 1, S, r]`` and the rotated shared key ``[B, 1, S, rope]`` of ``x`` ``[B, S, D]``
        (row-wise, as ``Attention.project``). With an indexer the key is followed by the
        indexer's key ``[B, 1, S, rope + Di]`` (what ``KVCache.v`` holds), and its queries
        ``[B, Hi, S, Di]`` and head weights ``[B, 1, S, Hi]`` follow (``Indexer.project``)."""
        b, s, _ = x.shape
        q_resid: Tensor | None = None
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)  # [B, H, S, qk]
        q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)  # [B, S, r + rope]
        latent, k_pe = torch.split(kv, [self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, S, r]
        k_pe = k_pe.unsqueeze(1)  # [B, 1, S, rope]
        rotate = apply_rotary_interleaved if self.interleave else apply_rotary
        q, k_pe = torch.cat((q_nope, rotate(q_rot, *rope)), dim=-1), rotate(k_pe, *rope)
        if self.indexer is None:
            return q, latent, k_pe
        assert q_resid is not None  # ModelConfig: the indexer reads the low-rank query
        index_q, index_k, index_w = self.indexer.project(x, q_resid, rope)
        return q, latent, torch.cat((k_pe, index_k), dim=-1), index_q, index_w

    def attend(
        self,
        q: Tensor,
        latent: Tensor,
        k_pe: Tensor,
        *index: Tensor,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        """Write ``latent, k_pe`` into ``cache`` at ``start``; attend ``q`` over it:
        ``[B, H, S, v_head_dim]`` (``Attention.attend``'s contract). ``index``: the indexer's
        queries and weights (``project``); each row then attends its selection only."""
        if isinstance(start, Tensor):
            latents, tails = cache.update_at(layer, start, latent, k_pe)  # [B, 1, max_len, *]
        else:
            latents, tails = cache.update(layer, start, latent, k_pe)  # [B, 1, start+S, *]
        k_pes, index_keys = tails[..., : self.rope], tails[..., self.rope :]
        rows = q.shape[2]
        if self.rowwise and 1 < rows <= ROWWISE_MAX_ROWS and not isinstance(start, Tensor):
            # row i as its decode step at start + i runs it: keys [0, start + i], its mask
            outs = []
            for i in range(rows):
                end = start + i + 1
                keep = mask[..., i : i + 1, :end]
                if index:
                    row = [t[:, :, i : i + 1] for t in index]
                    keep = self._select(row, index_keys[:, :, :end], keep)
                outs.append(
                    self._attend(q[:, :, i : i + 1], latents[:, :, :end], k_pes[:, :, :end], keep)
                )
            return torch.cat(outs, dim=2)
        keep = self._select(index, index_keys, mask) if index else mask
        return self._attend(q, latents, k_pes, keep)

    def _select(self, index: Sequence[Tensor], keys: Tensor, mask: Tensor) -> Tensor:
        """The indexer's selection ``[B, 1, S, T]`` within ``mask`` (``Indexer.forward``)."""
        assert self.indexer is not None and len(index) == 2
        keep: Tensor = self.indexer(index[0], index[1], keys, mask)
        return keep

    def _attend(self, q: Tensor, latents: Tensor, k_pes: Tensor, mask: Tensor) -> Tensor:
        """Absorbed attention of ``q`` ``[B, H, S, qk]`` over ``latents`` ``[B, 1, T, r]`` and
        ``k_pes`` ``[B, 1, T, rope]`` under ``mask`` ``[S, T]`` (or ``[B, 1, S, T]``, a DSA
        selection): ``[B, H, S, v]``."""
        dtype, w = q.dtype, self.kv_b_proj.weight.data
        if q.device.type == "cpu" and dtype != torch.float32:  # as Attention._attend: fp32 is
            q, latents, k_pes, w = q.float(), latents.float(), k_pes.float(), w.float()  # faster
        b, h, s, _ = q.shape
        w = w.view(h, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]  # [H, nope, r], [H, v, r]
        q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        q_lat = torch.matmul(q_nope, w_k)  # [B, H, S, r]
        c, kr = latents[:, 0], k_pes[:, 0]  # [B, T, r], [B, T, rope]: heads folded into rows
        scores = torch.bmm(q_lat.reshape(b, h * s, self.rank), c.transpose(1, 2)) + torch.bmm(
            q_rot.reshape(b, h * s, self.rope), kr.transpose(1, 2)
        )  # [B, H*S, T]
        scores = (scores * self.scale).view(b, h, s, -1).masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, H, S, T]
        o_lat = torch.bmm(probs.view(b, h * s, -1), c).view(b, h, s, self.rank)  # [B, H, S, r]
        y = torch.matmul(o_lat, w_v.transpose(1, 2))  # [B, H, S, v]
        return y.to(dtype)
