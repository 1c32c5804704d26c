"""A decoder of any supported family in plain torch, cut into pipeline stages.

``StageModel`` holds one contiguous block of layers ``[first, last)``: the token embedding iff it
is the first stage, the final norm and LM head iff it is the last. Read it top-down::

    StageModel -> Block -> Attention (shard.model.attention) | MLAttention (shard.model.mla)
    / FeedForward | SparseMoE (shard.model.moe) / RMSNorm

Modules and parameters carry Hugging Face's names (``embed_tokens``, ``self_attn.q_proj``,
``mlp.gate_proj``, ...) so the loader maps checkpoint tensors by shifting a layer index, nothing
more (Mixtral's ``block_sparse_moe`` too). The math follows each family's transformers model op
for op (rotate-half rotary, fp32 RMSNorm, SwiGLU, and each family's declared differences:
``shard.model.families``), which is what makes greedy output token-identical to transformers.
Layers of one model may differ (Gemma 3 and gpt-oss alternate sliding-window and full
attention, with their own rope tables; GLM's first layers are dense): every layer reads the
rope and mask of its own kind (``Block.window``, ``Block.local_rope``).

Splitting is bit-identical: each layer runs the same ops on the same shapes whichever stage holds
it, and the rotary tables are computed the same way everywhere, so running ``[0, a)``, ``[a, b)``,
``[b, L)`` in turn gives exactly the logits of ``[0, L)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, overload

import torch
from torch import Tensor, nn

from shard.model.attention import (
    Attention,
    RMSNorm,
    Ropes,
    apply_rotary,
    make_norm,
    rope_inv_freq,
    rope_tables,
)
from shard.model.config import ModelConfig
from shard.model.deltanet import GatedDeltaNet
from shard.model.kvcache import KVCache
from shard.model.linear import Linear, embedding
from shard.model.masks import causal_mask, static_mask
from shard.model.mla import MLAttention
from shard.model.moe import FeedForward, make_ffn
from shard.model.recurrent import RecurrentCache

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "KVCache",
    "MLAttention",
    "RMSNorm",
    "StageModel",
    "TailOut",
    "apply_rotary",
    "rope_inv_freq",
    "rope_tables",
]


class Block(nn.Module):
    """One transformer layer: attention then feed-forward, each with a residual.

    Pre-norm (Llama): ``h = x + attn(norm(x))``, ``out = h + ffn(norm'(h))``. With
    ``sandwich_norms`` (Gemma) the attention and MLP outputs are normed too, and the MLP's
    input norm is ``pre_feedforward_layernorm``. ``index`` is the layer's global index: it
    fixes its window, its rope and whether its feed-forward is sparse.
    """

    mlp: nn.Module  # the feed-forward; Mixtral's sparse layers name it block_sparse_moe
    self_attn: Attention | MLAttention  # MLA where the family declares it (DeepSeek-V3)
    linear_attn: GatedDeltaNet  # instead of self_attn in a linear-attention layer (Qwen3-Next)

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        d = config.hidden_size
        self.window, self.local_rope = config.window_of(index), config.local_rope(index)
        self.sandwich = config.sandwich_norms
        self.input_layernorm = make_norm(config, d)
        self.linear = config.is_linear(index)
        if self.linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = MLAttention(config) if config.mla is not None else Attention(config)
        self.post_attention_layernorm = make_norm(config, d)
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(config, d)
            self.post_feedforward_layernorm = make_norm(config, d)
        self.ffn_name = "block_sparse_moe" if _mixtral_names(config, index) else "mlp"
        self.add_module(self.ffn_name, make_ffn(config, index))

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        a = self.mixer(self.input_layernorm(x), rope, mask, cache, layer, start)
        return self.feed_forward(self.attn_residual(x, a))

    @property
    def mixer(self) -> Attention | MLAttention | GatedDeltaNet:
        """The layer's token mixer: its attention, or its linear attention."""
        return self.linear_attn if self.linear else self.self_attn

    def attn_residual(self, x: Tensor, a: Tensor) -> Tensor:
        """``x`` plus the attention output ``a`` (normed first under ``sandwich_norms``)."""
        return x + (self.post_attention_layernorm(a) if self.sandwich else a)

    def feed_forward(self, h: Tensor) -> Tensor:
        """``h`` plus the feed-forward of its norm (row-wise)."""
        ffn = self.get_submodule(self.ffn_name)
        if self.sandwich:
            y: Tensor = self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(h)))
            return h + y
        out: Tensor = h + ffn(self.post_attention_layernorm(h))
        return out


def _mixtral_names(config: ModelConfig, index: int) -> bool:
    return config.moe is not None and config.moe.names == "mixtral" and config.is_sparse(index)


class TailOut(NamedTuple):
    """The last stage's output when features are asked for (``feature_rows``)."""

    logits: Tensor  # fp32 [B, R, V]: the head at the last R rows
    features: Tensor  # [B, F, D], compute dtype: the final norm's output at the last F rows


class StageModel(nn.Module):
    """Layers ``[first, last)`` of the model, plus the embedding and/or head at the ends.

    A tied tail that is not stage 0 still owns a copy of the embedding matrix as its head weight.
    """

    #: whether ``forward_at`` (static positions, CUDA graphs) is available
    static_positions = True

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
        self.embed_tokens = embedding(vocab, d) if self.is_first else None
        self.layers = nn.ModuleList(Block(config, i) for i in range(first, last))
        self.norm = make_norm(config, d) if self.is_last else None
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
        self.rope_local_cos: Tensor | None
        self.rope_local_sin: Tensor | None
        local = None
        if any(layer.local_rope for layer in self.blocks()):
            local = rope_tables(config, local=True)
        self.register_buffer("rope_local_cos", local and local[0], persistent=False)
        self.register_buffer("rope_local_sin", local and local[1], persistent=False)
        self._retired_ropes: list[tuple[Tensor | None, Tensor | None]] = []
        self._index_slots()
        #: the layers in C++ (``shard.model.native.attach``): their output, or None to run these
        self.native: Callable[[Tensor, int, KVCache, Ropes], Tensor | None] | None = None

    def _index_slots(self) -> None:
        """Each layer's index in the cache part it uses (``cache_slot``), and how many keep KV
        (the rest, linear-attention layers, keep a state)."""
        kinds = [bool(getattr(layer, "linear", False)) for layer in self.layers]
        self._slots = [kinds[:j].count(kind) for j, kind in enumerate(kinds)]
        self.n_attention = kinds.count(False)

    def cache_slot(self, j: int) -> int:
        """Layer ``j`` of this block's index in ``KVCache.k`` / ``v`` (an attention layer) or in
        ``KVCache.recurrent`` (a linear-attention layer)."""
        return self._slots[j]

    def cover_positions(self, n: int) -> None:
        """Grow the rope tables (``ROPE_START`` rows at first) to cover positions ``[0, n)``,
        at least doubling them. The first rows keep their bits, and the tables they replace
        stay referenced: a captured CUDA graph of an older session still reads those."""
        have = int(self.rope_cos.shape[0])
        if n <= have:
            return
        length = min(self.config.max_position_embeddings, max(n, 2 * have))
        device, dtype = self.rope_cos.device, self.rope_cos.dtype
        self._retired_ropes.append((self.rope_cos, self.rope_sin))
        cos, sin = rope_tables(self.config, length=length)
        self.rope_cos, self.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
        if self.rope_local_cos is not None:
            self._retired_ropes.append((self.rope_local_cos, self.rope_local_sin))
            cos, sin = rope_tables(self.config, local=True, length=length)
            self.rope_local_cos = cos.to(device, dtype)
            self.rope_local_sin = sin.to(device, dtype)

    def blocks(self) -> list[Block]:
        """The layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, Block)]

    def embed(self, x: Tensor) -> Tensor:
        """The first stage's embedding of ids ``[B, S]``: ``[B, S, D]`` (times ``sqrt(D)`` in
        the model dtype with ``embed_scale``, as Gemma's scaled embedding computes it)."""
        assert self.embed_tokens is not None
        h: Tensor = self.embed_tokens(x)
        if self.config.embed_scale:
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(h.dtype)
        return h

    def logits(self, normed: Tensor) -> Tensor:
        """The head on final-normed rows ``[B, R, D]``: fp32 logits ``[B, R, V]`` (soft-capped
        in the model dtype first when the family sets ``final_logit_softcapping``)."""
        assert self.lm_head is not None
        out: Tensor = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out.float()

    def ropes_at(self, select: slice | Tensor, dtype: torch.dtype) -> Ropes:
        """``{local_rope: (cos, sin)}`` at positions ``select`` (a slice, or a tensor ``[S]``)
        for each rope kind this block's layers use."""
        out: Ropes = {}
        for local in {layer.local_rope for layer in self.blocks()}:
            cos, sin = (
                (self.rope_local_cos, self.rope_local_sin)
                if local
                else (self.rope_cos, self.rope_sin)
            )
            assert cos is not None and sin is not None
            if isinstance(select, slice):
                out[local] = (cos[select].to(dtype), sin[select].to(dtype))
            else:
                out[local] = (
                    cos.index_select(0, select).to(dtype),
                    sin.index_select(0, select).to(dtype),
                )
        return out

    def windows(self) -> set[int | None]:
        """The distinct sliding windows of this block's layers (``None``: full attention)."""
        return {layer.window for layer in self.blocks()}

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
        self.cover_positions(max_len)
        heads, k_dim, v_dim = self.config.kv_widths
        dtype, device = dtype or self.dtype, device or self.device
        cache = KVCache.empty(
            self.n_attention, batch, heads, max_len, k_dim, dtype=dtype, device=device, v_dim=v_dim
        )
        n_linear = len(self.layers) - self.n_attention
        if n_linear:
            cache.recurrent = RecurrentCache.of(self.config, n_linear, batch, dtype, device)
        return cache

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
        h: Tensor = self.embed(x) if self.embed_tokens is not None else x  # [B, S, D]
        ropes = self.ropes_at(slice(start, start + s), h.dtype)  # [S, R/2] each
        out = None if self.native is None else self.native(h, start, cache, ropes)
        if out is not None:
            return self.outputs(out, head_rows, feature_rows)
        masks = {w: causal_mask(start, s, h.device, w) for w in self.windows()}
        for j, layer in enumerate(self.blocks()):
            h = layer(h, ropes[layer.local_rope], masks[layer.window], cache, self._slots[j], start)
        return self.outputs(h, head_rows, feature_rows)

    def outputs(self, h: Tensor, head_rows: int | None, feat: int | None) -> Tensor | TailOut:
        """What ``forward`` returns for the block's output ``h`` ``[B, S, D]`` (its docstring)."""
        s = int(h.shape[1])  # feat: feature_rows
        if feat is not None:
            return self.finish(h, s if head_rows is None else head_rows, feat)
        if self.norm is None or self.lm_head is None:
            return h
        if head_rows is not None and not 0 <= head_rows <= s:
            raise ValueError(f"head_rows {head_rows} not in [0, {s}]")
        return self.head(h if head_rows is None else h[:, s - head_rows :])

    def head(self, h: Tensor) -> Tensor:
        """The last stage's final norm and head: hidden ``[B, S, D]`` -> logits ``[B, S, V]``."""
        if self.norm is None or self.lm_head is None:
            raise ValueError("only the last stage has the head")
        return self.logits(self.norm(h))

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
        return TailOut(self.logits(rows), normed[:, m - feature_rows :])

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
        h: Tensor = self.embed(x) if self.embed_tokens is not None else x  # [B, S, D]
        ropes = self.ropes_at(pos, h.dtype)  # [S, R/2] each
        masks = {w: static_mask(pos, cache.max_len, w) for w in self.windows()}
        for j, layer in enumerate(self.blocks()):
            h = layer(h, ropes[layer.local_rope], masks[layer.window], cache, self._slots[j], pos)
        if feature_rows is not None:
            return self.finish(h, int(h.shape[1]), feature_rows)
        if self.norm is None or self.lm_head is None:
            return h
        return self.logits(self.norm(h))  # [B, S, V]

    def _check_input(self, x: Tensor, start: int, cache: KVCache) -> int:
        """Validate ``x``, ``start`` and ``cache`` against this stage; return ``S``."""
        c = self.config
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"stage [{self.first}, {self.last}) is first: wants int64 token ids [B, S], "
                    f"got {x.dtype} {tuple(x.shape)}"
                )
        elif x.dim() != 3 or x.shape[-1] != c.hidden_wire_width or not x.is_floating_point():
            raise ValueError(
                f"stage [{self.first}, {self.last}) wants hidden states [B, S, "
                f"{c.hidden_wire_width}], "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        b, s = int(x.shape[0]), int(x.shape[1])
        if s < 1 or start < 0 or start + s > cache.max_len:
            raise ValueError(
                f"positions [{start}, {start + s}) do not fit the KV cache (max_len "
                f"{cache.max_len}); need 0 <= start and start + S <= max_len with S >= 1"
            )
        heads, k_dim, v_dim = c.kv_widths
        want = (self.n_attention, b, heads, cache.max_len, k_dim)
        RecurrentCache.check(cache.recurrent, len(self.layers) - self.n_attention, b)
        if tuple(cache.k.shape) != want or cache.v_dim != v_dim or cache.dtype != self.dtype:
            raise ValueError(
                f"KV cache {tuple(cache.k.shape)} {cache.dtype} does not match this stage and "
                f"input: want {want} {self.dtype}; make it with StageModel.new_cache"
            )
        return s
