"""DeepSeek-V4's mixture of experts: a learned or a hash router, clamped SwiGLU experts.

transformers' ``DeepseekV4SparseMoeBlock``: scores are ``scoring_func`` of the router's logits
(``sqrtsoftplus`` by default); a ``moe`` layer takes the top-k of scores plus the correction
bias (``gate.bias``), a ``hash_moe`` layer takes ``gate.tid2eid[token id]`` (a frozen table:
which experts a token id goes to); either way the chosen scores are renormalised and scaled by
``routed_scaling_factor``. Experts and the one shared expert are SwiGLU with the gate clamped
above and the up projection clamped both sides at ``swiglu_limit``. Names follow the layout
transformers' ``save_pretrained`` writes (``ffn.experts.E.w1`` gate, ``w3`` up, ``w2`` down).

``tid2eid`` is held as a float parameter (the loader places floats); expert ids below 2^8
are exact in every float dtype shard computes in (bfloat16 holds integers to 256).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.config import ModelConfig
from shard.model.linear import Linear

__all__ = ["V4Expert", "V4Gate", "V4MoE"]


class V4Expert(nn.Module):
    """One SwiGLU expert with clamps: ``w2(silu(min(w1 x, l)) * clamp(w3 x, -l, l))``."""

    def __init__(self, d: int, inner: int, limit: float) -> None:
        super().__init__()
        self.w1, self.w3 = Linear(d, inner, bias=False), Linear(d, inner, bias=False)
        self.w2 = Linear(inner, d, bias=False)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        out: Tensor = self.w2(F.silu(gate) * up)
        return out


class V4Gate(nn.Module):
    """The router: ``weight`` ``[E, D]`` and either ``bias`` (top-k) or ``tid2eid`` (hash)."""

    def __init__(self, d: int, n_experts: int, top_k: int, vocab: int, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, d))
        self.hashed, self.top_k = hashed, top_k
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(vocab, top_k), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)


class V4MoE(nn.Module):
    """A V4 feed-forward (module docstring); ``forward(x, ids)`` is row-wise."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        v = config.v4
        assert v is not None
        d, self.scoring, self.scale = config.hidden_size, v.scoring, v.routed_scaling_factor
        hashed = layer in v.hash_layers
        self.gate = V4Gate(d, v.n_experts, v.top_k, config.vocab_size, hashed)
        self.experts = nn.ModuleList(
            V4Expert(d, v.expert_size, v.swiglu_limit) for _ in range(v.n_experts)
        )
        self.shared_experts = V4Expert(d, v.expert_size, v.swiglu_limit)

    def route(self, x: Tensor, ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """Weights ``[N, k]`` and expert ids ``[N, k]`` of rows ``x`` ``[N, D]`` (ids ``[N]``)."""
        logits = F.linear(x, self.gate.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if self.gate.hashed:
            if ids is None:
                raise ValueError("a hash-routed layer needs the rows' token ids")
            chosen = self.gate.tid2eid[ids].long()
        else:
            chosen = torch.topk(
                scores + self.gate.bias, self.gate.top_k, dim=-1, sorted=False
            ).indices
        w = scores.gather(1, chosen)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, chosen

    def forward(self, x: Tensor, ids: Tensor | None) -> Tensor:
        """``x`` ``[B, S, D]``, ``ids`` ``[B, S]`` (hash layers) -> ``[B, S, D]``."""
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        weights, chosen = self.route(flat, None if ids is None else ids.reshape(-1))
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():  # ascending, as transformers sums them
            slot, row = torch.where((chosen == e).T)  # [k, N] -> by slot, then row
            y = self.experts[e](flat[row]) * weights[row, slot, None]
            out.index_add_(0, row, y.to(out.dtype))
        shared: Tensor = self.shared_experts(x)
        return out.view(b, s, d) + shared
