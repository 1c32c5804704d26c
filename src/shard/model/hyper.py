"""DeepSeek-V4's manifold-constrained hyper-connections: ``n`` residual streams per token.

transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead``, op for op, as pure
functions of a block's parameters (the checkpoint keeps them on the layer: ``hc_attn_fn``,
``hc_attn_base``, ``hc_attn_scale``, and ``hc_ffn_*``; the model's ``hc_head``). Before a
sub-block the streams ``[B, S, n, D]`` are flattened, RMS-normed without weight, and projected
to three mixes: ``pre`` (collapse the streams into the sub-block's input), ``post`` (spread its
output back over the streams) and ``comb`` (mix the input streams into the output ones),
``comb`` projected onto doubly-stochastic matrices by Sinkhorn-Knopp iterations. Everything
is row-wise: a row's mixes depend on that row's streams only, so packing sessions' rows or
cutting the model into stages changes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["hc_collapse", "hc_head", "hc_merge", "unit_rms"]


def unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight, as transformers' ``DeepseekV4UnweightedRMSNorm``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_collapse(
    h: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, iters: int, eps: float, norm_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``post`` ``[B, S, n]``, ``comb`` ``[B, S, n, n]`` (float32) and the collapsed input
    ``[B, S, D]`` of streams ``h`` ``[B, S, n, D]``."""
    b, s, n = int(h.shape[0]), int(h.shape[1]), int(h.shape[2])
    flat = unit_rms(h.reshape(b, s, -1).float(), norm_eps)  # [B, S, n*D]
    mixes = F.linear(flat, fn.float())  # [B, S, (2 + n) n]
    pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n : 2 * n], mixes[..., 2 * n :]
    pre_b, post_b, comb_b = base[:n], base[n : 2 * n], base[2 * n :]
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(b, s, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)  # [B, S, D]
    return post, comb, collapsed


def hc_merge(h: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The streams after a sub-block: its output ``out`` ``[B, S, D]`` spread by ``post`` plus
    the input streams ``h`` mixed by ``comb`` transposed: ``[B, S, n, D]``."""
    dtype = h.dtype
    spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)  # [B, S, n, D]
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def hc_head(
    h: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, eps: float, norm_eps: float
) -> Tensor:
    """The final collapse of the streams ``[B, S, n, D]`` to ``[B, S, D]`` (``hc_head``)."""
    flat = unit_rms(h.flatten(2).float(), norm_eps)
    mixes = F.linear(flat, fn.float())  # [B, S, n]
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)
