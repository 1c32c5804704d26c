"""Feed-forwards: the dense gated MLP and the sparse mixture of experts, per family.

A sparse layer routes each row to ``top_k`` of its experts and sums their outputs weighted by
the router. Each router is transformers' own, op for op (``MoeConfig.router``):

- ``softmax`` (Mixtral, Qwen3-MoE): softmax over all experts in fp32, top-k, renormalised when
  ``norm_topk_prob`` (Mixtral always); Qwen3-MoE casts the weights back to the model dtype.
- ``topk_softmax`` (gpt-oss): router with a bias, top-k of the logits, softmax over the chosen.
- ``sigmoid_group`` (GLM-4.5): sigmoid scores in fp32; the choice is made on score +
  ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups (a group's
  score: its two best), the weights are the plain scores, renormalised, times
  ``routed_scaling_factor``; shared experts are added for every row.

Qwen3-Next and Qwen3.5-MoE route as Qwen3-MoE and add one ``shared_expert`` for every row,
scaled by ``sigmoid(shared_expert_gate(x))`` (a one-output ``Router``: kept dense).

Experts run per row group: the router runs row-wise, then each chosen expert runs once over
the rows that chose it (gathered), and each row's outputs are added in ascending expert order
(``index_add_`` from zeros, as transformers does). Rows never interact: a row's experts, its
weights and its order of addition do not depend on the other rows; only the row count an
expert's product sees does — the same property the dense layers have
(``shard.model.packed``, "Batch invariance"). The loop over experts reads the chosen ids back to
the host, so a sparse block cannot be captured in a CUDA graph (graphs stay ``off`` for it).
On quantized blocks (``Router.rowwise``) the router's float product runs row by row too, so
with the quantized kernels' row invariance a verify chunk routes and sums exactly as its
decode steps do.

Checkpoint names: experts are ``<ffn>.experts.N.<gate|up|down>`` (Mixtral's ``w1|w3|w2`` under
``block_sparse_moe``), the router ``<ffn>.gate``; gpt-oss keeps its experts fused
(``mlp.experts.gate_up_proj`` ``[E, D, 2F]`` interleaved gate/up, with biases) and its router
as ``mlp.router``. Separate experts are ``Linear`` modules, so a loader that quantizes linears
(``weights = "int8" | "int4"``) quantizes experts the same way; gpt-oss's fused 3-D experts are
quantized expert by expert into ``QuantLinear`` s (``FusedExperts.install``); routers stay
dense (``Router``). (transformers 5 fuses Mixtral's, Qwen3-MoE's and GLM's experts in memory
too, but writes and reads them per expert: their checkpoints, and shard, hold them separate.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.config import ModelConfig, MoeConfig
from shard.model.fused import joined_of
from shard.model.linear import Linear

__all__ = ["FeedForward", "FusedExperts", "Router", "SparseMoE", "make_ffn"]


def _act(name: str, x: Tensor) -> Tensor:
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


class FeedForward(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU, or GELU-tanh for Gemma)."""

    def __init__(self, config: ModelConfig, size: int | None = None) -> None:
        super().__init__()
        d, f = config.hidden_size, size or config.intermediate_size
        self.act = config.hidden_act
        self.gate_proj = Linear(d, f, bias=False)
        self.up_proj = Linear(d, f, bias=False)
        self.down_proj = Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = joined_of(self, "gate_up")  # one product where joined (shard.model.fused)
        gate, up = gate_up(x) if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        out: Tensor = self.down_proj(_act(self.act, gate) * up)
        return out


class MixtralExpert(nn.Module):
    """One Mixtral expert under its checkpoint names: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: ModelConfig, size: int) -> None:
        super().__init__()
        d = config.hidden_size
        self.w1 = Linear(d, size, bias=False)
        self.w3 = Linear(d, size, bias=False)
        self.w2 = Linear(size, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Router(nn.Module):
    """A router's logits ``[T, E]`` of rows ``[T, D]``: a linear layer kept dense when the
    loader quantizes linears (its choices are discrete; a rounding flips an expert).
    ``group``: GLM-4.5's ``e_score_correction_bias`` (used for the selection only)."""

    def __init__(self, d: int, n_experts: int, *, bias: bool = False, group: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, d))
        self.bias = nn.Parameter(torch.zeros(n_experts)) if bias else None
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts)) if group else None
        #: run the product row by row, so a row's logits are its one-row decode step's bits
        #: whatever the row count (a float product of 6 rows may round a row differently
        #: than of 1, enough to move a routing weight); set by the loader with
        #: ``Attention.rowwise`` on quantized blocks, whose every other product is row-invariant
        self.rowwise = False

    def forward(self, h: Tensor) -> Tensor:
        return self.product(h, self.weight, self.bias)

    def product(self, h: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``h @ weight.T + bias`` over rows ``h`` ``[T, D]`` (row by row under ``rowwise``)."""
        if self.rowwise and h.shape[0] > 1:
            return torch.cat([F.linear(h[i : i + 1], weight, bias) for i in range(h.shape[0])])
        return F.linear(h, weight, bias)


class FusedExperts(nn.Module):
    """gpt-oss's experts, fused: ``gate_up_proj`` ``[E, D, 2F]`` (gate and up interleaved),
    ``down_proj`` ``[E, F, D]``, biases; clamped SwiGLU ``(up + 1) * gate * sigmoid(a gate)``.

    Quantized (``weights = "int8" | "int4"``), a fused weight is held as one ``QuantLinear``
    per expert instead (``install``): expert ``e``'s ``[D, 2F]`` slice transposed to a
    ``[2F, D]`` linear weight, so output column ``j`` is still the interleaved column ``j``.
    The biases stay float parameters, added after the product as in the dense path, and the
    expert runs on its own gathered rows through the same kernels as every quantized linear
    (whose rows do not interact: ``shard.model.quant``, "Row invariance").
    """

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        e, d, f = moe.n_experts, config.hidden_size, moe.expert_size
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.gate_up_proj: nn.Parameter | None = nn.Parameter(torch.zeros(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * f))
        self.down_proj: nn.Parameter | None = nn.Parameter(torch.zeros(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))
        #: Per-expert quantized linears replacing ``gate_up_proj`` / ``down_proj`` (``install``).
        self.gate_up_q: nn.ModuleList | None = None
        self.down_q: nn.ModuleList | None = None

    def install(self, name: str, linears: list[nn.Module]) -> None:
        """Hold fused weight ``name`` (``"gate_up_proj"`` or ``"down_proj"``) as ``linears``,
        one per expert (each maps ``x`` to ``x @ weight[e]``, bias aside)."""
        if name not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"FusedExperts has no fused weight {name!r}")
        setattr(self, name, None)  # drops the dense parameter
        setattr(self, name.replace("_proj", "_q"), nn.ModuleList(linears))

    def run(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on rows ``x`` ``[n, D]``."""
        gate_up = self._product(e, x, self.gate_up_proj, self.gate_up_q) + self.gate_up_proj_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # [n, F] each, interleaved
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out: Tensor = self._product(e, (up + 1) * glu, self.down_proj, self.down_q)
        return out + self.down_proj_bias[e]  # [n, D]

    @staticmethod
    def _product(e: int, x: Tensor, dense: Tensor | None, quant: nn.ModuleList | None) -> Tensor:
        if quant is not None:
            y: Tensor = quant[e](x)
            return y
        assert dense is not None
        return x @ dense[e]


class SparseMoE(nn.Module):
    """Router -> top-k experts -> weighted sum (module docstring), experts held per layer."""

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.moe, d = moe, config.hidden_size
        self.experts: nn.Module
        if moe.experts == "clamped_swiglu":
            self.router = Router(d, moe.n_experts, bias=True)
            self.experts = FusedExperts(config, moe)
        else:
            self.gate = Router(d, moe.n_experts, group=moe.router == "sigmoid_group")
            size = moe.expert_size
            make = MixtralExpert if moe.names == "mixtral" else FeedForward
            self.experts = nn.ModuleList(make(config, size) for _ in range(moe.n_experts))
        self.shared_experts = (
            FeedForward(config, moe.expert_size * moe.n_shared_experts)
            if moe.n_shared_experts
            else None
        )
        if moe.shared_gate:  # Qwen3-Next: one shared expert, scaled by a sigmoid gate
            self.shared_expert = FeedForward(config, moe.shared_size)
            self.shared_expert_gate = Router(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # [T, D]
        weights, chosen = self.route(h)  # [T, k] each
        out = torch.zeros_like(h)
        for e in sorted(set(chosen.flatten().tolist())):
            rows, slot = torch.where(chosen == e)  # the rows that chose e, and in which slot
            y = self._expert(e, h[rows]) * weights[rows, slot, None]  # [n, D]
            out.index_add_(0, rows, y.to(out.dtype))
        out = out.reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.moe.shared_gate:
            shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)  # [T, D]
            out = out + shared.reshape(shape)
        return out

    def _expert(self, e: int, x: Tensor) -> Tensor:
        if isinstance(self.experts, FusedExperts):
            return self.experts.run(e, x)
        assert isinstance(self.experts, nn.ModuleList)
        y: Tensor = self.experts[e](x)
        return y

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's expert weights and ids ``[T, top_k]``, as the family's router defines."""
        m = self.moe
        if m.router == "topk_softmax":
            logits = self.router(h)  # [T, E]
            top, chosen = torch.topk(logits, m.top_k, dim=-1)
            return F.softmax(top, dim=1, dtype=top.dtype), chosen
        if m.router == "sigmoid_group":
            return self._route_groups(h)
        logits = self.gate(h)  # [T, E]
        probs = F.softmax(logits.float(), dim=-1)
        top, chosen = torch.topk(probs, m.top_k, dim=-1)
        if m.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top.to(logits.dtype) if m.cast_weights else top), chosen

    def _route_groups(self, h: Tensor) -> tuple[Tensor, Tensor]:
        m, gate = self.moe, self.gate
        assert gate.e_score_correction_bias is not None
        scores = gate.product(h.float(), gate.weight.float()).sigmoid()  # [T, E]
        choice = scores + gate.e_score_correction_bias.float()
        per_group = m.n_experts // m.n_group
        group_scores = choice.view(-1, m.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        keep = group_mask.unsqueeze(-1).expand(-1, m.n_group, per_group).reshape(-1, m.n_experts)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        chosen = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, chosen


def make_ffn(config: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s feed-forward: sparse where the family says so, else dense."""
    if config.moe is not None and config.is_sparse(layer):
        return SparseMoE(config, config.moe)
    return FeedForward(config)
