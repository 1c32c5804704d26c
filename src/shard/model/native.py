"""The native forward (issue 42): a Llama-family stage's layers run by a C++ extension
(``native_step.cpp``) that gives the eager forward's bytes, without its Python and its ~130
small torch operations a layer.

Every operation whose rounding is torch's own (the int4 products, the RMS norm's sum, SiLU,
scaled-dot-product attention) stays the same ATen call on a tensor of the same shape and
values; the int8 products are the q8 kernel the eager path calls too (``shard.model.q8``),
and a quantized block's short chunks and decode steps are attended by the row attention
kernel the eager path calls too (``shard.model.rowattn``);
everything else is one correctly rounded float32 operation per element (the mean is the sum
divided once, as torch's mean is), a copy or torch's bf16 rounding (the C++ file's comment).
So a stage gives the same bytes with and without it, in a ring as in one process, and an
audit replays either way (``tests/test_native.py`` checks stages, splits, chunks and both
bundled models byte for byte).

**When it runs.** ``load_stage`` calls ``attach`` (unless ``join=False``, the reference
path). A stage takes it when it is a CPU float32 ``StageModel`` whose layers are all alike
and each is a Llama-family or Gemma 3 layer: ``RMSNorm`` or Gemma's ``(1 + w)`` norm (with
sandwich norms and per-head q/k norms), grouped-query ``Attention`` without biases, gates,
sinks or partial rotary, full or sliding-window (each with its rope table), a SiLU or
GELU-tanh ``FeedForward``; every product on the CPU int4 kernel (an int4 weight, or an int8
one as two) with q/k/v and gate/up joined (``shard.model.fused``), or held in bf16
(``shard.model.held``). Both bundled models stored qualify, and such checkpoints loaded
``int4``. A forward then runs natively when it is one session (batch 1) with no recurrent
state and no hooks on the stage's modules but plain forward pre-hooks on layers' input norms:
that is how features capture the residual stream entering a layer
(``shard.stage.features.capturing``), and the native forward stops there and calls them with
it. The embedding, the final norm and the head stay in Python either way.
Everything else runs eagerly, as before; ``attach`` returns why a stage did not take it.

**Building.** ``shard.model.native_build`` compiles the extension on first use (~40 s, once
per machine and torch) and loads it. Without a compiler, or when the build fails, the stage
runs eagerly and a warning says why: the same bytes, slower. ``SHARD_NATIVE=0`` turns the
native forward off.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Final

import torch
from torch import Tensor, nn

from shard.model import rowattn
from shard.model.attention import ROWWISE_MAX_ROWS, Attention, GemmaRMSNorm, RMSNorm, Ropes
from shard.model.fused import JoinedInt4, joined_of
from shard.model.kvcache import KVCache
from shard.model.llama import Block, StageModel
from shard.model.moe import FeedForward
from shard.model.native_build import build, enabled, native_dir
from shard.model.q8 import Int8Group
from shard.model.quant import QuantLinear, _Int4

__all__ = ["NativeLayers", "attach", "build", "enabled", "native_dir"]

log = logging.getLogger(__name__)


def _product(module: nn.Module | None) -> tuple[list[Tensor], list[int]] | None:
    """A product's tensors and (part count, group) for the extension, if it runs on the CPU
    int4 kernel, the q8 kernel (count -1) or held in bf16 (count 0) with nothing around it (no
    bias, not a slice of a joined product)."""
    if isinstance(module, QuantLinear) and module.path == "held" and module.bias is None:
        held = module._held
        if (
            held is None
            or held.dtype != torch.bfloat16
            or held.device.type != "cpu"
            or not held.is_contiguous()
        ):
            return None
        return [held], [0, 0]
    if isinstance(module, JoinedInt4):
        parts = module.parts
    elif isinstance(module, QuantLinear) and module.joined is None and module.bias is None:
        parts = module._parts
    else:
        return None
    if len(parts) == 1 and isinstance(parts[0], Int8Group):  # int8-group: count -1
        q = parts[0]
        if module.compute != torch.float32 or q.device.type != "cpu":
            return None
        offset = q.offset if q.offset is not None else q.scale.new_empty(0)
        return [q.packed, q.scale, offset], [-1, q.group]
    if len(parts) != 1 or module.compute != torch.bfloat16:
        return None
    int4 = parts[0]
    if not isinstance(int4, _Int4) or int4.device.type != "cpu":
        return None
    return int4.tensors(), [1, int4.group]


#: The norm classes the extension computes, and whether each is Gemma's ``(1 + weight)``.
NORMS: Final = {RMSNorm: False, GemmaRMSNorm: True}
#: The feed-forward activations it computes (``shard.model.moe._act``).
ACTS: Final = ("silu", "gelu_pytorch_tanh")


def _layer(block: Block, slot: int, head_dim: int) -> tuple[list[Tensor], list[int]] | str:
    """One layer's weights and integers for the extension, or why it does not fit."""
    attn, ffn = getattr(block, "self_attn", None), block.get_submodule(block.ffn_name)
    if block.linear or type(attn) is not Attention:
        return "not a plain attention layer"
    assert isinstance(attn, Attention)
    if attn.gated or attn.sinks is not None or attn.qk_whole:
        return "attention with gates, sinks or a whole-width q/k norm"
    if attn.head_dim != head_dim:
        return "partial rotary"
    qk: list[nn.Module | None] = [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
    ffn_norms: list[nn.Module] = (
        [block.pre_feedforward_layernorm, block.post_feedforward_layernorm]
        if block.sandwich
        else []
    )
    norms = [block.input_layernorm, *qk, block.post_attention_layernorm, *ffn_norms]
    kinds = {type(n) for n in norms}
    if len(kinds) != 1 or kinds.pop() not in NORMS:
        return "norms of another kind"
    weights = [n.weight.data for n in norms if isinstance(n, RMSNorm | GemmaRMSNorm)]
    if len(weights) != len(norms) or any(w.dtype != torch.float32 for w in weights):
        return "norms not in float32"
    if type(ffn) is not FeedForward or ffn.act not in ACTS:
        return "not a SiLU or GELU-tanh feed-forward"
    products = [
        _product(joined_of(attn, "qkv")),
        _product(attn.o_proj),
        _product(joined_of(ffn, "gate_up")),
        _product(ffn.down_proj),
    ]
    if any(p is None for p in products):
        return "a product off the CPU int4 kernel and not held, or q/k/v or gate/up not joined"
    # the extension's order: norm1, [q/k norms], qkv, o, norm2, [pre/post ffn], gate_up, down
    n_before = 1 + len(qk)
    ordered = weights[:n_before]
    ints = [block.window or 0, int(block.local_rope)]
    for i, p in enumerate(products):
        assert p is not None
        if i == 2:
            ordered += weights[n_before:]
        ordered += p[0]
        ints += p[1]
    return ordered, [*ints, slot]


class NativeLayers:
    """A stage's layers in the extension (``attach`` builds it); ``__call__`` runs them."""

    def __init__(self, impl: Any, stage: StageModel) -> None:
        self._impl = impl
        self._watched = list(stage.modules())
        self._norms = [block.input_layernorm for block in stage.blocks()]
        self._norm_of = {id(norm): j for j, norm in enumerate(self._norms)}

    def stops(self, h: Tensor, cache: KVCache) -> list[int] | None:
        """None when this forward must run eagerly (module docstring); else the layers whose
        input norm carries plain forward pre-hooks (features capture the residual stream
        entering a layer with one, ``shard.stage.features.capturing``): ``__call__`` stops
        before each and calls its hooks with that stream, as the module would."""
        if h.shape[0] != 1 or h.dtype != torch.float32 or cache.recurrent is not None:
            return None
        k, v = cache.k, cache.v
        if k.dtype != torch.float32 or k.shape[1] != 1:
            return None
        if not (k.is_contiguous() and v.is_contiguous()):
            return None
        hooks = nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return None
        stops = []
        for m in self._watched:
            if m._forward_hooks or m._forward_pre_hooks_with_kwargs:
                return None
            if m._forward_pre_hooks:
                j = self._norm_of.get(id(m))
                if j is None:
                    return None
                stops.append(j)
        return sorted(stops)

    def __call__(self, h: Tensor, start: int, cache: KVCache, ropes: Ropes) -> Tensor | None:
        """The layers on ``h`` ``[1, S, D]`` at ``start`` (``ropes``: the chunk's rope rows,
        ``StageModel.ropes_at``), calling the hooks of ``stops`` on the way; None when this
        forward must run the modules instead."""
        stops = self.stops(h, cache)
        if stops is None:
            return None
        lc, ls = ropes.get(True, (None, None))
        full = ropes.get(False) or ropes[True]  # a block of sliding layers only has no full rope
        at = 0
        for j in [*stops, len(self._norms)]:
            if j > at:
                h = self._impl.forward(h, start, cache.k, cache.v, *full, lc, ls, at, j)
                at = j
            if j < len(self._norms):
                norm = self._norms[j]
                for hook in list(norm._forward_pre_hooks.values()):
                    if hook(norm, (h,)) is not None:  # the module would feed the norm that
                        raise RuntimeError(  # instead: not what this forward computes
                            "a forward pre-hook that replaces its input cannot run natively"
                        )
        return h


def attach(stage: nn.Module) -> str | None:
    """Give ``stage`` its native layers (``stage.native``) when it fits (module docstring);
    None when it took them, else why not."""
    if not enabled():
        return "turned off (SHARD_NATIVE)"
    if type(stage) is not StageModel:
        return "not a Llama-family StageModel"
    c = stage.config
    if stage.device.type != "cpu" or stage.dtype != torch.float32:
        return "not a CPU float32 stage"
    if stage.rope_cos is None or 2 * int(stage.rope_cos.shape[-1]) != c.head_dim:
        return "partial rotary"
    weights: list[Tensor] = []
    ints: list[int] = []
    blocks = stage.blocks()
    if len(blocks) != len(stage.layers) or not blocks:
        return "not every layer is an attention block"
    attns = [b.self_attn for b in blocks if isinstance(b.self_attn, Attention)]
    alike = {
        (a.scale, a.rowwise, a.q_norm is not None, b.sandwich, type(b.input_layernorm))
        for a, b in zip(attns, blocks, strict=False)
    }
    eps = {n.eps for b in blocks for n in b.modules() if type(n) in NORMS}
    ffns = {(getattr(f, "act", None), getattr(getattr(f, "down_proj", None), "in_features", 0))
            for f in (b.get_submodule(b.ffn_name) for b in blocks)}  # fmt: skip
    if len(attns) != len(blocks) or len(alike) != 1 or len(eps) != 1 or len(ffns) != 1:
        return "layers that differ in attention, norms or feed-forward"
    for j, block in enumerate(blocks):
        got = _layer(block, stage.cache_slot(j), c.head_dim)
        if isinstance(got, str):
            return f"layer {stage.first + j}: {got}"
        weights += got[0]
        ints += got[1]
    ext = build()
    if isinstance(ext, str):
        _warn_once(ext)
        return ext
    scale, rowwise, qk_norm, sandwich, norm = alike.pop()
    act, width = ffns.pop()
    rows = rowwise and rowattn.shapes_fit(c.head_dim, c.n_heads, c.n_kv_heads)
    flags = [NORMS[norm], sandwich, qk_norm, act == "gelu_pytorch_tanh", rows]
    iconf = [c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, width]
    iconf += [ROWWISE_MAX_ROWS if rowwise else 0, *(int(f) for f in flags)]
    impl = ext.Stage(weights, ints, iconf, [eps.pop(), float(scale)])
    stage.native = NativeLayers(impl, stage)
    return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("stages run the eager forward (the same bytes, slower): %s", reason)
