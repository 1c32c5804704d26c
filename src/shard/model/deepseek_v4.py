"""DeepSeek-V4 (``deepseek_v4``) as a pipeline stage: hyper-connected streams between stages.

transformers' ``DeepseekV4ForCausalLM``, op for op, cut into ``[first, last)`` like every
family (``shard.model.llama.StageModel``, whose head, norm, cache and checks it shares). A
layer collapses its ``hc_mult`` residual streams for attention (``shard.model.v4_attention``)
and again for its experts (``shard.model.v4_moe``), spreading each output back over the
streams (``shard.model.hyper``); the last stage collapses them once more (``hc_head``).

Design decisions:

1. **The streams cross every hop.** A stage hands the next all ``hc_mult`` streams, so the
   hidden state between stages is ``[B, S, ModelConfig.hidden_wire_width]``: the streams
   flattened (``hc_mult x hidden_size``), then the row's token id. Every width check (the
   stage's input, the executor's chunk check, CUDA graphs' buffers, placement's activation
   bytes) reads ``hidden_wire_width``; for every other family it is ``hidden_size``. Wire cost
   per token: ``(hc_mult x hidden_size + id_digits) x dtype bytes`` — V4-Flash in bfloat16,
   ``(4 x 4096 + 3) x 2 = 32,774`` bytes, 4x a single-stream model of its width.
2. **Token ids travel inside the activation.** The hash-routed layers choose experts by
   ``tid2eid[token id]`` on whichever stage holds them, so each row carries its id as
   ``id_digits`` base-256 digits (``ModelConfig.id_digits``: 3 for a 129,280-token vocabulary;
   0 when only layer 0 hashes, which always sits on the stage that has the ids). Digits below
   256 are exact in float16, bfloat16 and float32, so the id survives any compute dtype. Being
   part of the hidden state, the ids ride every path a hidden state rides — packed batches,
   failover replay, audit evidence, receipts — with no change to the ring's messages, which
   still carry exactly one of ids (first edge) and hidden (later edges). The alternative, a
   ``route_ids`` field on ``Prefill`` / ``Verify``, would have touched the wire codec, its
   checks, the executor and the audit path for one family.
3. **Compressor state is position-addressed** (``shard.model.v4_attention``): raw rows and
   finished entries sit in ``KVCache`` at their positions, so rollback stays
   overwrite-by-position and a verify chunk equals its decode steps.

Not supported: CUDA-graph capture (``forward_at``; a V4 stage runs eager), quantized experts
kept fused (experts are separate ``Linear`` s, so ``int8`` / ``int4`` quantize them as any).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from shard.model.attention import RMSNorm, rope_tables
from shard.model.config import ModelConfig
from shard.model.hyper import hc_collapse, hc_head, hc_merge
from shard.model.kvcache import KVCache
from shard.model.linear import Linear, embedding
from shard.model.llama import StageModel, TailOut
from shard.model.v4_attention import Rows, V4Attention
from shard.model.v4_moe import V4MoE

__all__ = ["V4Block", "V4Stage", "decode_ids", "encode_ids"]


def encode_ids(ids: Tensor, digits: int, dtype: torch.dtype) -> Tensor:
    """Ids ``[B, S]`` as ``digits`` base-256 digits ``[B, S, digits]``, least significant first."""
    scale = 256 ** torch.arange(digits, device=ids.device)
    return ((ids.unsqueeze(-1) // scale) % 256).to(dtype)


def decode_ids(x: Tensor, vocab: int) -> Tensor:
    """Ids ``[B, S]`` from digits ``[B, S, digits]``; ``ValueError`` if not a valid id."""
    d = x.float()
    digits = d.round()
    scale = 256 ** torch.arange(int(x.shape[-1]), device=x.device)
    ids = (digits.long() * scale).sum(-1)
    if not (bool((digits == d).all()) and bool((digits >= 0).all()) and bool((digits < 256).all())
            and bool((ids < vocab).all())):  # fmt: skip
        raise ValueError(f"the hidden state's token-id digits are not ids in [0, {vocab})")
    return ids


class V4Block(nn.Module):
    """One V4 layer: streams -> collapse -> attention -> spread, then the same for experts."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        v = config.v4
        assert v is not None
        n, d = v.hc_mult, config.hidden_size
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            v.hc_sinkhorn_iters,
            v.hc_eps,
            config.rms_norm_eps,
        )
        self.compressed = v.ratio(index) > 0
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.attn = V4Attention(config, index)
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ffn = V4MoE(config, index)
        mix = (2 + n) * n
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, n * d)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.zeros(3)))

    def _mix(self, part: str, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = [getattr(self, f"hc_{part}_{k}") for k in ("fn", "base", "scale")]
        return hc_collapse(h, *p, iters=self.iters, eps=self.eps, norm_eps=self.norm_eps)

    def forward(
        self, h: Tensor, ids: Tensor | None, rows: list[Rows], layer: int, ropes: Any
    ) -> Tensor:
        """Streams ``h`` ``[B, T, n, D]`` -> ``[B, T, n, D]``; ``ropes``: (main, compress) at
        the rows' positions and the whole compress tables."""
        post, comb, x = self._mix("attn", h)
        rope = ropes[1] if self.compressed else ropes[0]
        a = self.attn(self.attn_norm(x), rows, layer, rope, ropes[2])
        h = hc_merge(h, a, post, comb)
        post, comb, x = self._mix("ffn", h)
        return hc_merge(h, self.ffn(self.ffn_norm(x), ids), post, comb)


class HcHead(nn.Module):
    """The final collapse's parameters (``hc_head.hc_fn`` / ``hc_base`` / ``hc_scale``)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.zeros(n, n * d))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.zeros(1))


class V4Stage(StageModel):
    """Layers ``[first, last)`` of a DeepSeek-V4 (module docstring)."""

    static_positions = False  # no forward_at: its stages run eager (CUDA graphs off)

    def __init__(self, config: ModelConfig, first: int, last: int) -> None:
        nn.Module.__init__(self)
        v = config.v4
        if v is None or not 0 <= first < last <= config.n_layers:
            raise ValueError(f"V4Stage needs a deepseek_v4 config and 0 <= {first} < {last}")
        self.config, self.first, self.last = config, first, last
        self.is_first, self.is_last = first == 0, last == config.n_layers
        d, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = embedding(vocab, d) if self.is_first else None
        self.layers = nn.ModuleList(V4Block(config, i) for i in range(first, last))
        self._index_slots()
        self.norm = RMSNorm(d, config.rms_norm_eps) if self.is_last else None
        self.lm_head = Linear(d, vocab, bias=False) if self.is_last else None
        self.hc_head = HcHead(v.hc_mult, d) if self.is_last else None
        self._retired_ropes: list[tuple[Tensor | None, Tensor | None]] = []
        self.rope_local_cos: Tensor | None = None
        self.rope_local_sin: Tensor | None = None
        self._set_ropes(None)

    def _configs(self) -> tuple[ModelConfig, ModelConfig]:
        v = self.config.v4
        assert v is not None
        main = attrs.evolve(self.config, rope_scaling=None)
        return main, attrs.evolve(
            self.config, rope_theta=v.compress_theta, rope_scaling=v.compress_scaling
        )

    def _set_ropes(self, length: int | None) -> None:
        """Main and compress tables (fp32, CPU at build; ``cover_positions`` keeps devices)."""
        main, comp = self._configs()
        (mc, ms), (cc, cs) = rope_tables(main, length=length), rope_tables(comp, length=length)
        if length is None:
            for name, t in (("rope_cos", mc), ("rope_sin", ms), ("comp_cos", cc), ("comp_sin", cs)):
                self.register_buffer(name, t, persistent=False)
            return
        dev, dt = self.rope_cos.device, self.rope_cos.dtype
        self._retired_ropes.append((self.rope_cos, self.rope_sin))
        self.rope_cos, self.rope_sin = mc.to(dev, dt), ms.to(dev, dt)
        self.comp_cos, self.comp_sin = cc.to(dev, dt), cs.to(dev, dt)

    def cover_positions(self, n: int) -> None:
        have = int(self.rope_cos.shape[0])
        if n > have:
            self._set_ropes(min(self.config.max_position_embeddings, max(n, 2 * have)))

    def windows(self) -> set[int | None]:
        return {self.config.sliding_window}

    def _run(self, x: Tensor, rows: list[Rows]) -> Tensor:
        """The layers over ``x`` (ids ``[B, T]`` or wire hidden ``[B, T, W]``): the wire hidden
        for the next stage, or (last stage) the collapsed ``[B, T, D]``."""
        v, c = self.config.v4, self.config
        assert v is not None
        for _, _, _start, cache in rows:
            self.cover_positions(cache.max_len)
        ids: Tensor | None = x
        if self.embed_tokens is not None:
            h = self.embed_tokens(x).unsqueeze(2).expand(-1, -1, v.hc_mult, -1).contiguous()
        else:
            b, t = int(x.shape[0]), int(x.shape[1])
            h = x[..., : v.hc_mult * c.hidden_size].reshape(b, t, v.hc_mult, c.hidden_size)
            ids = (
                decode_ids(x[..., v.hc_mult * c.hidden_size :], c.vocab_size)
                if c.id_digits
                else None
            )
        pos = torch.cat([torch.arange(s, s + hi - lo) for lo, hi, s, _ in rows]).to(h.device)
        dt = h.dtype
        main = (
            self.rope_cos.index_select(0, pos).to(dt),
            self.rope_sin.index_select(0, pos).to(dt),
        )
        comp = (
            self.comp_cos.index_select(0, pos).to(dt),
            self.comp_sin.index_select(0, pos).to(dt),
        )
        ropes = (main, comp, (self.comp_cos, self.comp_sin))
        for j, layer in enumerate(self.layers):
            h = layer(h, ids, rows, j, ropes)
        if self.hc_head is not None:
            p = self.hc_head
            collapsed: Tensor = hc_head(
                h, p.hc_fn, p.hc_base, p.hc_scale, eps=v.hc_eps, norm_eps=c.rms_norm_eps
            )
            return collapsed
        out: Tensor = h.flatten(2)  # [B, T, n D]
        if c.id_digits and ids is not None:
            out = torch.cat([out, encode_ids(ids, c.id_digits, out.dtype)], dim=-1)
        return out

    @torch.no_grad()
    def forward(
        self, x: Tensor, start: int, cache: KVCache, *, head_rows: int | None = None,
        feature_rows: int | None = None,
    ) -> Tensor | TailOut:  # fmt: skip
        """``StageModel.forward``'s contract, on the wire hidden of ``hidden_wire_width``."""
        s = self._check_input(x, start, cache)
        return self.outputs(self._run(x, [(0, s, start, cache)]), head_rows, feature_rows)

    def forward_at(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("DeepSeek-V4 stages run eager: set graphs off for this model")

    def run_packed(self, x: Tensor, segments: Sequence[Any], static: bool) -> Tensor:
        """``shard.model.packed``'s layers for this family: ``x`` ``[1, T, *]``."""
        if static:
            raise NotImplementedError("DeepSeek-V4 stages run eager: set graphs off")
        rows, lo = [], 0
        for seg in segments:
            rows.append((lo, lo + seg.rows, seg.start, seg.cache))
            lo += seg.rows
        return self._run(x, rows)
