"""A Llama-family decoder in plain torch, cut into pipeline stages.

``StageModel`` holds one contiguous block of layers ``[first, last)``: the token embedding iff it
is the first stage, the final norm and LM head iff it is the last. Read it top-down::

    StageModel -> Block -> Attention / FeedForward / RMSNorm

Modules and parameters carry Hugging Face's names (``embed_tokens``, ``self_attn.q_proj``,
``mlp.gate_proj``, ...) so the loader maps checkpoint tensors by shifting a layer index, nothing
more. The math follows HF's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` op for op (rotate-half
rotary, fp32 RMSNorm, SwiGLU), which is what makes greedy output token-identical to transformers.

Splitting is bit-identical: each layer runs the same ops on the same shapes whichever stage holds
it, and the rotary tables are computed the same way everywhere, so running ``[0, a)``, ``[a, b)``,
``[b, L)`` in turn gives exactly the logits of ``[0, L)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.config import ModelConfig
from shard.model.kvcache import KVCache
from shard.model.linear import Linear

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "KVCache",
    "RMSNorm",
    "StageModel",
    "TailOut",
    "rope_tables",
]


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]``, fp32, exactly as transformers computes them.

    With ``rope_scaling`` this is HF's ``_compute_llama3_parameters``: long wavelengths are divided
    by ``factor``, short ones kept, the band between interpolated smoothly.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
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


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """``cos, sin`` of shape ``[max_position_embeddings, head_dim // 2]``, fp32 on CPU.

    HF stores ``cat(freqs, freqs)``; both halves are equal, so half the table suffices and
    ``apply_rotary`` pairs dimension ``i`` with ``i + head_dim/2`` (the rotate-half layout).
    """
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]  # [P, Dh/2]
    return freqs.cos(), freqs.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, S, Dh]`` by ``cos, sin`` ``[S, Dh/2]`` (HF's rotate-half layout).

    Equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` bit for bit.
    """
    x1, x2 = x.chunk(2, dim=-1)  # [B, H, S, Dh/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [B, H, S, Dh]


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


class Attention(nn.Module):
    """Grouped-query self-attention over a static KV cache; optional q/k/v biases (Qwen2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, dh, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, dh
        self.q_proj = Linear(d, config.n_heads * dh, bias=bias)
        self.k_proj = Linear(d, config.n_kv_heads * dh, bias=bias)
        self.v_proj = Linear(d, config.n_kv_heads * dh, bias=bias)
        self.o_proj = Linear(config.n_heads * dh, d, bias=False)

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
        q, k, v = self.project(x, rope)
        y = self.attend(q, k, v, mask, cache, layer, start)  # [B, H, S, Dh]
        b, s, _ = x.shape
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)  # [B, S, H*Dh]
        out: Tensor = self.o_proj(y)
        return out

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated ``q`` ``[B, H, S, Dh]`` and ``k``, ``v`` ``[B, KV, S, Dh]`` of ``x``
        ``[B, S, D]`` (row-wise: ``shard.model.packed`` runs it over many sessions' rows)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, Dh]
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B,KV,S,Dh]
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B,KV,S,Dh]
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        """Write ``k, v`` into ``cache`` at ``start``; attend ``q`` over it: ``[B, H, S, Dh]``."""
        if isinstance(start, Tensor):
            keys, values = cache.update_at(layer, start, k, v)  # [B, KV, max_len, Dh]
        else:
            keys, values = cache.update(layer, start, k, v)  # [B, KV, start+S, Dh]
        low = q.device.type == "cpu" and q.dtype != torch.float32
        if low:
            # CPU SDPA in bf16/fp16 is several times slower than in fp32 (a one-row query over
            # 1,000 keys: 0.9 against 0.1 ms here); a copy up costs far less than it saves.
            q, keys, values = q.float(), keys.float(), values.float()
        y: Tensor = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            scale=self.head_dim**-0.5,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )  # [B, H, S, Dh]
        return y.to(k.dtype) if low else y


class FeedForward(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, bias=False)
        self.up_proj = Linear(d, f, bias=False)
        self.down_proj = Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    """One pre-norm transformer layer: attention then MLP, each with a residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, layer, start)
        out: Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class TailOut(NamedTuple):
    """The last stage's output when features are asked for (``feature_rows``)."""

    logits: Tensor  # fp32 [B, R, V]: the head at the last R rows
    features: Tensor  # [B, F, D], compute dtype: the final norm's output at the last F rows


class StageModel(nn.Module):
    """Layers ``[first, last)`` of the model, plus the embedding and/or head at the ends.

    A tied tail that is not stage 0 still owns a copy of the embedding matrix as its head weight.
    """

    def __init__(self, config: ModelConfig, first: int, last: int) -> None:
        super().__init__()
        if not 0 <= first < last <= config.n_layers:
            raise ValueError(
                f"bad layer range [{first}, {last}) for a {config.n_layers}-layer model: "
                "need 0 <= first < last <= n_layers"
            )
        self.config, self.first, self.last = config, first, last
        self.is_first, self.is_last = first == 0, last == config.n_layers
        d, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, d) if self.is_first else None
        self.layers = nn.ModuleList(Block(config) for _ in range(first, last))
        self.norm = RMSNorm(d, config.rms_norm_eps) if self.is_last else None
        self.lm_head = Linear(d, vocab, bias=False) if self.is_last else None
        if (
            self.lm_head is not None
            and self.embed_tokens is not None
            and config.tie_word_embeddings
        ):
            self.lm_head.weight = self.embed_tokens.weight
        # Built on CPU in fp32 even under ``torch.device("meta")`` (the loader builds there), so
        # every stage computes identical tables; ``.to(device)`` moves them with the weights.
        cos, sin = rope_tables(config)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the weights)."""
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def new_cache(
        self,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed KV cache for this block and one session of up to ``max_len`` positions."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"{self.config.max_position_embeddings}; open a shorter session"
            )
        c = self.config
        return KVCache.empty(
            len(self.layers),
            batch,
            c.n_kv_heads,
            max_len,
            c.head_dim,
            dtype=dtype or self.dtype,
            device=device or self.device,
        )

    if TYPE_CHECKING:
        # nn.Module.__call__ is typed ``Any``; callers get ``forward``'s signature instead.
        @overload
        def __call__(
            self, x: Tensor, start: int, cache: KVCache, *, head_rows: int | None = None
        ) -> Tensor: ...
        @overload
        def __call__(
            self,
            x: Tensor,
            start: int,
            cache: KVCache,
            *,
            head_rows: int | None = None,
            feature_rows: int,
        ) -> TailOut: ...
        def __call__(
            self,
            x: Tensor,
            start: int,
            cache: KVCache,
            *,
            head_rows: int | None = None,
            feature_rows: int | None = None,
        ) -> Tensor | TailOut: ...

    @torch.no_grad()
    def forward(
        self,
        x: Tensor,
        start: int,
        cache: KVCache,
        *,
        head_rows: int | None = None,
        feature_rows: int | None = None,
    ) -> Tensor | TailOut:
        """Run positions ``[start, start+S)``: ids ``[B, S]`` (first stage) or hidden ``[B, S, D]``.

        Writes K/V at ``[start, start+S)`` and attends causally to ``[0, start+S)`` only. Returns
        hidden ``[B, S, D]``, or fp32 logits ``[B, S, V]`` on the last stage — only of the last
        ``head_rows`` positions when given (``[B, head_rows, V]``; the head is the largest
        matrix of a small model, and a prefill chunk reads one row of it, or none). With
        ``feature_rows`` (the last stage only) it returns a ``TailOut``: those logits and the
        final norm's output at the last ``feature_rows`` positions (``finish``). Runs
        without autograd: an inference engine never wants a graph hanging off its KV cache.
        """
        s = self._check_input(x, start, cache)
        h: Tensor = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B, S, D]
        rope = (
            self.rope_cos[start : start + s].to(h.dtype),  # [S, Dh/2]
            self.rope_sin[start : start + s].to(h.dtype),  # [S, Dh/2]
        )
        mask = self.causal_mask(start, s, h.device)  # [S, start+S]
        for j, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache, j, start)
        if feature_rows is not None:
            return self.finish(h, s if head_rows is None else head_rows, feature_rows)
        if self.norm is None or self.lm_head is None:
            return h
        if head_rows is None:
            return self.head(h)
        if not 0 <= head_rows <= s:
            raise ValueError(f"head_rows {head_rows} not in [0, {s}]")
        return self.head(h[:, s - head_rows :])

    def head(self, h: Tensor) -> Tensor:
        """The last stage's final norm and head: hidden ``[B, S, D]`` -> logits ``[B, S, V]``."""
        if self.norm is None or self.lm_head is None:
            raise ValueError("only the last stage has the head")
        logits: Tensor = self.lm_head(self.norm(h))
        return logits.float()

    def finish(self, h: Tensor, head_rows: int, feature_rows: int) -> TailOut:
        """``head`` of the last ``head_rows`` rows of ``h`` ``[B, S, D]`` and the final norm's
        output at the last ``feature_rows``, the norm run once over the rows either needs.

        When ``feature_rows <= head_rows`` (a verify chunk) the head reads exactly what
        ``head`` reads; otherwise its rows are copied out, so its operands are laid out as
        ``head``'s are (CPU matmul kernels may sum differently at another alignment).
        """
        if self.norm is None or self.lm_head is None:
            raise ValueError("only the last stage has the head and its features")
        s = int(h.shape[1])
        if not (0 <= head_rows <= s and 0 <= feature_rows <= s):
            raise ValueError(
                f"head_rows {head_rows} and feature_rows {feature_rows} not in [0, {s}]"
            )
        m = max(head_rows, feature_rows)
        normed: Tensor = self.norm(h[:, s - m :])  # [B, m, D]
        rows = normed if m == head_rows else normed[:, m - head_rows :].clone()  # [B, R, D]
        logits: Tensor = self.lm_head(rows)
        return TailOut(logits.float(), normed[:, m - feature_rows :])

    @overload
    def forward_at(self, x: Tensor, pos: Tensor, cache: KVCache) -> Tensor: ...
    @overload
    def forward_at(
        self, x: Tensor, pos: Tensor, cache: KVCache, *, feature_rows: int
    ) -> TailOut: ...

    @torch.no_grad()
    def forward_at(
        self, x: Tensor, pos: Tensor, cache: KVCache, *, feature_rows: int | None = None
    ) -> Tensor | TailOut:
        """``forward`` at the positions ``pos`` ``[S]`` (int64, on this stage's device).

        Static shapes: every tensor's shape depends on ``S`` and the cache's ``max_len`` only,
        never on where the chunk sits, and nothing reads a value back to the host — so one
        CUDA-graph capture per ``S`` replays at any position (``shard.stage.graphs``). Attends
        over the whole cache under a mask, so its rounding may differ from ``forward``'s in the
        last bit; graphed and eager ``forward_at`` are what must agree bit for bit. With
        ``feature_rows``: a ``TailOut`` of the logits of every row and the last rows' features.
        """
        self._check_input(x, 0, cache)
        h: Tensor = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B, S, D]
        rope = (
            self.rope_cos.index_select(0, pos).to(h.dtype),  # [S, Dh/2]
            self.rope_sin.index_select(0, pos).to(h.dtype),  # [S, Dh/2]
        )
        mask = self.static_mask(pos, cache.max_len)  # [S, max_len]
        for j, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache, j, pos)
        if feature_rows is not None:
            return self.finish(h, int(h.shape[1]), feature_rows)
        if self.norm is None or self.lm_head is None:
            return h
        logits: Tensor = self.lm_head(self.norm(h))  # [B, S, V]
        return logits.float()

    def static_mask(self, pos: Tensor, max_len: int) -> Tensor:
        """Boolean ``[S, max_len]``: queries at ``pos`` ``[S]`` over a whole cache (forward_at)."""
        k_pos = torch.arange(max_len, device=pos.device)[None, :]  # [1, max_len]
        q_pos = pos[:, None]  # [S, 1]
        mask = k_pos <= q_pos
        window = self.config.sliding_window
        return mask & (k_pos > q_pos - window) if window is not None else mask

    def causal_mask(self, start: int, s: int, device: torch.device) -> Tensor:
        """Boolean ``[S, start+S]``: query ``start+i`` sees key ``j`` iff ``j <= start+i``
        (and ``j > start+i - sliding_window`` when the model has one)."""
        q_pos = torch.arange(start, start + s, device=device)[:, None]  # [S, 1]
        k_pos = torch.arange(start + s, device=device)[None, :]  # [1, start+S]
        mask = k_pos <= q_pos
        window = self.config.sliding_window
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def _check_input(self, x: Tensor, start: int, cache: KVCache) -> int:
        """Validate ``x``, ``start`` and ``cache`` against this stage; return ``S``."""
        c = self.config
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"stage [{self.first}, {self.last}) is first: wants int64 token ids [B, S], "
                    f"got {x.dtype} {tuple(x.shape)}"
                )
        elif x.dim() != 3 or x.shape[-1] != c.hidden_size or not x.is_floating_point():
            raise ValueError(
                f"stage [{self.first}, {self.last}) wants hidden states [B, S, {c.hidden_size}], "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        b, s = int(x.shape[0]), int(x.shape[1])
        if s < 1 or start < 0 or start + s > cache.max_len:
            raise ValueError(
                f"positions [{start}, {start + s}) do not fit the KV cache (max_len "
                f"{cache.max_len}); need 0 <= start and start + S <= max_len with S >= 1"
            )
        want = (len(self.layers), b, c.n_kv_heads, cache.max_len, c.head_dim)
        if tuple(cache.k.shape) != want or cache.dtype != self.dtype:
            raise ValueError(
                f"KV cache {tuple(cache.k.shape)} {cache.dtype} does not match this stage and "
                f"input: want {want} {self.dtype}; make it with StageModel.new_cache"
            )
        return s
