"""Rotary tables, norms and grouped-query attention, as transformers defines them per family.

Everything here is row-wise except ``Attention.attend``: ``shard.model.packed`` runs the
projections over many sessions' rows at once and attends per session. The variants a family
declares (``ModelConfig`` fields) are: q/k RMSNorm per head, Gemma's ``(1 + weight)`` norm,
a query scale (``attn_scale``), partial rotary (``partial_rotary``), attention sinks
(gpt-oss: one learned logit per head joins the softmax, then is dropped), and rope scaling
``llama3`` / ``yarn`` / ``linear`` (HF's ``_compute_*_parameters``, op for op).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model import rowattn
from shard.model.config import ModelConfig, RopeScaling
from shard.model.fused import joined_of
from shard.model.kvcache import KVCache
from shard.model.linear import Linear

__all__ = [
    "ROPE_START",
    "Attention",
    "GemmaRMSNorm",
    "RMSNorm",
    "Ropes",
    "apply_rotary",
    "make_norm",
    "rope_inv_freq",
    "rope_tables",
]


def _llama3(inv_freq: Tensor, rs: RopeScaling) -> Tensor:
    """HF's ``_compute_llama3_parameters``: long wavelengths divided by ``factor``, short ones
    kept, the band between interpolated smoothly."""
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, rs: RopeScaling) -> Tensor:
    """HF's ``_compute_yarn_parameters`` (without ``mscale``): inverse frequencies."""

    def correction_dim(rotations: float) -> float:
        orig = rs.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: prevent a division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rs.factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> Tensor:
    """Rotary inverse frequencies ``[rotary_dim // 2]``, fp32, exactly as transformers computes
    them; ``local``: the sliding layers' own base (``rope_local_theta``), never scaled."""
    dim = config.rotary_dim
    base = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    rs = None if local else config.rope_scaling
    if rs is not None and rs.kind == "yarn":
        return _yarn(dim, base, rs)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    if rs is None:
        return inv_freq
    if rs.kind == "linear":
        return inv_freq / rs.factor
    return _llama3(inv_freq, rs)


def _attention_factor(config: ModelConfig, local: bool) -> float:
    """YaRN's cos/sin scale (``0.1 ln(factor) + 1`` unless given); 1 for every other rope."""
    rs = None if local else config.rope_scaling
    if rs is None or rs.kind != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    return 1.0 if rs.factor <= 1 else 0.1 * math.log(rs.factor) + 1.0


#: Positions a model's rope tables start with; ``StageModel.new_cache`` grows them for a longer
#: session. A table row depends on its position only (elementwise products and cos/sin), so its
#: first rows are the same bits whatever its length (``tests/test_rope_tables.py``), and a
#: config declaring 2^24 positions costs nothing until a session that long is opened.
ROPE_START = 4096


def rope_tables(
    config: ModelConfig, *, local: bool = False, length: int | None = None
) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``[length, rotary_dim // 2]``, fp32 on CPU (``length``: at most
    ``max_position_embeddings``, by default ``ROPE_START`` of them).

    HF stores ``cat(freqs, freqs)``; both halves are equal, so half the table suffices and
    ``apply_rotary`` pairs dimension ``i`` with ``i + rotary_dim/2`` (the rotate-half layout).
    """
    n = min(config.max_position_embeddings, ROPE_START if length is None else length)
    positions = torch.arange(n, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * rope_inv_freq(config, local=local)[None, :]  # [P, R/2]
    scale = _attention_factor(config, local)
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale


#: Each rope kind's ``(cos, sin)`` rows of a chunk (``StageModel.ropes_at``): False for the
#: full-attention layers' tables, True for the sliding layers' own.
Ropes = dict[bool, tuple[Tensor, Tensor]]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, S, Dh]`` by ``cos, sin`` ``[S, R/2]`` (HF's rotate-half layout);
    dimensions past ``R`` pass through (partial rotary).

    Equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` bit for bit.
    """
    r = 2 * int(cos.shape[-1])
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)  # [B, H, S, R/2] each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [B, H, S, R]
    return out if rest is None else torch.cat((out, rest), dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scaled by ``1 + weight`` in fp32, then cast back (HF's Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: ModelConfig, dim: int) -> RMSNorm | GemmaRMSNorm:
    """The family's norm over ``dim`` features."""
    if config.norm_unit_offset:
        return GemmaRMSNorm(dim, config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps)


#: The longest chunk ``Attention.rowwise`` attends as its rows' decode steps: a verify chunk
#: (K + 1 rows, K at most 8 by default) or a short prefill; a long prefill chunk keeps one call.
ROWWISE_MAX_ROWS = 16


class Attention(nn.Module):
    """Grouped-query self-attention over a static KV cache, with the family's variants."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, dh, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, dh
        self.scale = config.attn_scale if config.attn_scale is not None else dh**-0.5
        #: Qwen3-Next: each head's query is followed by as many gate values (``attend``)
        self.gated = config.attn_output_gate
        self.q_proj = Linear(d, config.n_heads * dh * (2 if self.gated else 1), bias=bias)
        self.k_proj = Linear(d, config.n_kv_heads * dh, bias=bias)
        self.v_proj = Linear(d, config.n_kv_heads * dh, bias=bias)
        self.o_proj = Linear(config.n_heads * dh, d, bias=config.o_proj_bias)
        #: q/k norms: per head (Qwen3, Gemma 3), over all heads at once (MiniMax-M2), or none
        self.qk_whole = whole = config.qk_norm_whole
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm or whole:
            self.q_norm = make_norm(config, config.n_heads * dh if whole else dh)
            self.k_norm = make_norm(config, config.n_kv_heads * dh if whole else dh)
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.attention_sinks else None
        #: attend each row of a short chunk over exactly the keys and mask its own one-row
        #: decode would use (``attend``): on the CPU in float32 by row attention
        #: (``shard.model.rowattn``: one call, each row in one stated order, decode steps too),
        #: elsewhere one torch call a row; set by the loader on quantized blocks, whose kernels
        #: give a row the same bits alone as among many, so that a speculative verify chunk
        #: equals plain decoding bit for bit
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
        """``x`` ``[B, S, D]`` at positions ``[start, start+S)``; keys are ``[0, start+S)``.

        ``start`` a tensor: the positions ``[S]`` themselves, and keys are the whole cache
        (``StageModel.forward_at``)."""
        y = self.attend(*self.project(x, rope), mask=mask, cache=cache, layer=layer, start=start)
        b, s, _ = x.shape
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)  # [B, S, H*Dh]
        out: Tensor = self.o_proj(y)
        return out

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        """Rotated ``q`` ``[B, H, S, Dh]`` and ``k``, ``v`` ``[B, KV, S, Dh]`` of ``x``
        ``[B, S, D]`` (row-wise: ``shard.model.packed`` runs it over many sessions' rows),
        then the output gate ``[B, H, S, Dh]`` when the family has one."""
        b, s, _ = x.shape
        qkv = joined_of(self, "qkv")  # one product where q/k/v are joined (shard.model.fused)
        if qkv is not None:
            q, k, v = qkv(x)  # [B, S, H*Dh], [B, S, KV*Dh], [B, S, KV*Dh]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.gated:  # per head: Dh of query then Dh of gate
            q, gate = q.view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, s, -1), gate.transpose(1, 2)  # gate [B, H, S, Dh]
        if self.qk_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_dim)  # [B, S, H, Dh]
        k = k.view(b, s, self.n_kv_heads, self.head_dim)  # [B, S, KV, Dh]
        v = v.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if not self.qk_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H|KV, S, Dh]
        rotated = apply_rotary(q, *rope), apply_rotary(k, *rope), v
        return rotated if gate is None else (*rotated, gate)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        gate: Tensor | None = None,
        *,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        """Write ``k, v`` into ``cache`` at ``start``; attend ``q`` over it: ``[B, H, S, Dh]``
        (times ``sigmoid(gate)`` when ``project`` gave one)."""
        y = self._attend_cached(q, k, v, mask=mask, cache=cache, layer=layer, start=start)
        return y if gate is None else y * torch.sigmoid(gate)

    def _attend_cached(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        if isinstance(start, Tensor):
            keys, values = cache.update_at(layer, start, k, v)  # [B, KV, max_len, Dh]
        else:
            keys, values = cache.update(layer, start, k, v)  # [B, KV, start+S, Dh]
        rows = q.shape[2]
        if (
            self.rowwise
            and rows <= ROWWISE_MAX_ROWS
            and not isinstance(start, Tensor)
            and self.sinks is None
            and rowattn.fits(q, keys, mask)
        ):  # each row in one stated order: a chunk's rows in one call, as their decode steps
            return rowattn.attend_rows(q, keys, values, mask, self.scale)
        if self.rowwise and 1 < rows <= ROWWISE_MAX_ROWS and not isinstance(start, Tensor):
            # row i as its decode at start + i sees it: keys [0, start + i] and that row's mask
            return torch.cat(
                [
                    self._attend(
                        q[:, :, i : i + 1],
                        keys[:, :, : start + i + 1],
                        values[:, :, : start + i + 1],
                        mask[..., i : i + 1, : start + i + 1],
                    )
                    for i in range(rows)
                ],
                dim=2,
            )
        return self._attend(q, keys, values, mask)

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """``q`` over ``keys``/``values`` under ``mask``, in the block's dtype."""
        low = q.device.type == "cpu" and q.dtype != torch.float32
        k_dtype = keys.dtype
        if low:
            # CPU SDPA in bf16/fp16 is several times slower than in fp32 (a one-row query over
            # 1,000 keys: 0.9 against 0.1 ms here); a copy up costs far less than it saves.
            q, keys, values = q.float(), keys.float(), values.float()
        if self.sinks is not None:
            y = self._attend_with_sinks(q, keys, values, mask, self.sinks)
        else:
            y = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )  # [B, H, S, Dh]
        return y.to(k_dtype) if low else y

    def _attend_with_sinks(
        self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sinks: Tensor
    ) -> Tensor:
        """gpt-oss's eager attention: each head's sink logit joins the softmax, then is dropped."""
        rep = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(rep, dim=1)  # [B, H, K, Dh]
        values = values.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale  # [B, H, S, K]
        scores = scores.masked_fill(~mask, float("-inf"))
        b, h, s, _ = scores.shape
        sink = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, s, 1)
        logits = torch.cat([scores, sink], dim=-1)  # [B, H, S, K+1]
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)  # [B, H, S, Dh]
