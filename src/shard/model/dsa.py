"""DeepSeek sparse attention (GLM-5): the indexer that picks the keys each query attends.

transformers' ``GlmMoeDsaIndexer``, op for op. From the attention's normed input ``x`` and
its low-rank query ``q_resid`` (``q_a_layernorm(q_a_proj(x))``) it projects ``index_n_heads``
queries of ``index_head_dim`` (``wq_b``), one key per token (``wk``, then the LayerNorm
``k_norm`` with bias, epsilon 1e-6) and one weight per head (``weights_proj``, in float32 as
transformers keeps it). The first ``qk_rope_head_dim`` dimensions of each query and of the key
are turned by the model's own rope tables, interleaved. A query's score of key ``t`` is
``sum_h w_h relu(q_h . k_t / sqrt(D)) / sqrt(H)`` in float32, and MLA attends only the
``index_topk`` best-scored of the keys it may see (every one while there are no more).

Cache: the indexer's key is cached per layer and position right after MLA's rotary key
(``KVCache.v`` holds ``k_pe | index key``: ``ModelConfig.kv_widths``), written and read by
position with it, so rollback by overwrite, packed sessions and KV pricing carry it unchanged:
GLM-5 caches 512 + 64 + 128 numbers a token and layer.

Row invariance: the choice is discrete, so one ulp of a score may swap a key, and a row must
choose from exactly the bits its lone decode step computes. ``forward`` scores a row against
its own keys only, so under ``rowwise`` (quantized blocks: every product row-invariant;
``IndexWeights`` too) ``MLAttention`` runs a short chunk row by row through the ops and shapes
of its decode steps, and a verify chunk, a packed batch or an audit replay selects what the
lone steps select, bit for bit. Ties go to the earlier position, in a chunk and a step alike
(a stable sort; ``torch.topk`` leaves the order among equals unspecified). In float, without
``rowwise``, the products upstream already round a row among many differently than alone
(``shard.model.packed``, "Batch invariance"); a selection can then differ only where two keys'
scores lie within those last bits of each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.config import ModelConfig
from shard.model.linear import Linear

__all__ = ["INDEX_KEY_EPS", "SCORE_ROWS", "IndexWeights", "Indexer", "rotate_first"]

#: Rows a prefill chunk is scored by at once: their float32 head scores take
#: ``SCORE_ROWS x index_n_heads x T x 4`` bytes (GLM-5 over 128k keys: 268 MB), not a whole
#: chunk's; a decode step or verify chunk of up to ``SCORE_ROWS`` rows is one block.
SCORE_ROWS = 16

#: transformers builds the indexer's ``k_norm`` (a LayerNorm) with this epsilon, not the
#: config's ``rms_norm_eps``.
INDEX_KEY_EPS = 1e-6


def rotate_first(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """``x`` ``[B, H, S, D]`` with its first ``R`` dims turned interleaved by ``rope``
    ``[S, R/2]`` each, the rest passed through (the indexer's rope: rotated dims first)."""
    cos, sin = rope
    r = 2 * int(cos.shape[-1])
    x1, x2 = x[..., 0:r:2], x[..., 1:r:2]  # [B, H, S, R/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]), dim=-1)


class IndexWeights(nn.Module):
    """``weights_proj``: one weight per indexer head ``[H, D]``, multiplied in float32 (a
    plain matrix, not a ``Linear``: quantized weights leave it dense, as a router)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads, d))
        #: one row at a time, each its decode step's product (``Router.rowwise``)
        self.rowwise = False

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[B, S, D]`` -> ``[B, S, H]`` float32."""
        x, w = x.float(), self.weight.float()
        if self.rowwise and x.shape[1] > 1:
            return torch.cat([F.linear(x[:, i : i + 1], w) for i in range(x.shape[1])], dim=1)
        return F.linear(x, w)


class Indexer(nn.Module):
    """The DSA indexer of one layer (module docstring); ``forward`` is the selection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        a, d = config.mla, config.dsa
        if a is None or d is None or a.q_lora_rank is None:
            raise ValueError("Indexer needs a config with mla (a low-rank query) and dsa set")
        self.heads, self.dim, self.topk = d.index_n_heads, d.index_head_dim, d.index_topk
        self.wq_b = Linear(a.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEX_KEY_EPS)
        self.weights_proj = IndexWeights(config.hidden_size, self.heads)
        self.scale = self.dim**-0.5

    def project(
        self, x: Tensor, q_resid: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The rotated queries ``[B, Hi, S, Di]``, the rotated key ``[B, 1, S, Di]`` and the
        head weights ``[B, 1, S, Hi]`` (float32, times ``Hi ** -0.5``) of ``x`` ``[B, S, D]``
        and ``q_resid`` ``[B, S, q_lora_rank]`` (row-wise)."""
        b, s, _ = x.shape
        q = self.wq_b(q_resid).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # [B, 1, S, Di]
        w = self.weights_proj(x) * self.heads**-0.5  # [B, S, Hi]
        return rotate_first(q, rope), rotate_first(k, rope), w.unsqueeze(1)

    def scores(self, q: Tensor, w: Tensor, keys: Tensor) -> Tensor:
        """float32 ``[B, S, T]``: queries ``q`` ``[B, Hi, S, Di]`` weighted by ``w``
        ``[B, 1, S, Hi]`` against ``keys`` ``[B, 1, T, Di]`` (transformers' op order)."""
        q = q.transpose(1, 2).float().contiguous()  # [B, S, Hi, Di]: a row alone or in a chunk
        s = F.relu(torch.matmul(q, keys.float().transpose(-1, -2)) * self.scale)  # [B,S,Hi,T]
        return torch.matmul(w.transpose(1, 2), s).squeeze(-2)  # [B, S, 1, Hi] @ -> [B, S, T]

    def forward(self, q: Tensor, w: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """Which keys each query attends: boolean ``[B, 1, S, T]``, ``mask`` ``[S, T]`` (the
        keys a row may see) narrowed to each row's ``index_topk`` best-scored keys; rows are
        scored ``SCORE_ROWS`` at a time (a decode step or a verify chunk: at once)."""
        b, s, t = int(q.shape[0]), int(q.shape[2]), int(keys.shape[2])
        if t <= self.topk:  # every visible key is kept (transformers: topk of min(k, T))
            return mask.expand(b, s, t).unsqueeze(1)
        blocks = [
            self._keep(q[:, :, i : i + SCORE_ROWS], w[:, :, i : i + SCORE_ROWS], keys,
                       mask[..., i : i + SCORE_ROWS, :])
            for i in range(0, s, SCORE_ROWS)
        ]  # fmt: skip
        return torch.cat(blocks, dim=1).unsqueeze(1)

    def _keep(self, q: Tensor, w: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """``forward`` of a block of rows, ``[B, S, T]``."""
        scores = self.scores(q, w, keys).masked_fill(~mask, float("-inf"))  # [B, S, T]
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : self.topk]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
        return keep & mask  # a row seeing fewer than topk keys keeps them all
