"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, as transformers
defines it (``Qwen3NextGatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet``).

Per position ``t`` the layer projects its input to a query, key and value per head (through a
causal depthwise convolution of ``kernel`` taps and SiLU), a decay ``g_t = -exp(A) *
softplus(a_t + dt_bias)`` and a write strength ``beta_t = sigmoid(b_t)``, and updates a state
``S`` ``[Hv, Dk, Dv]`` per head by the gated delta rule::

    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

with ``q`` and ``k`` L2-normalised and ``q`` divided by ``sqrt(Dk)``. The output is RMS-normed
per head, gated by ``silu(z_t)`` (``RMSNormGated``) and projected back. Key heads serve
``Hv / Hk`` value heads each.

The recurrence runs one position at a time with transformers' own decode ops
(``torch_recurrent_gated_delta_rule``), in fp32, for every chunk: a verify chunk's positions
are its decode steps, and the state after each is what ``shard.model.recurrent`` keeps for a
rollback. (transformers' prefill uses the chunked form of the same rule; the two agree within
float32 rounding, ``tests/test_model_families.py``.) The convolution is summed tap by tap in
fp32 so that a position's output is the same whatever chunk it sits in.

Layouts: Qwen3-Next projects ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head
(``[q_h | k_h | v_h... | z_h...]`` for each key head ``h``; ``_ungroup``); Qwen3.5 has four
plain projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shard.model.attention import ROWWISE_MAX_ROWS
from shard.model.config import ModelConfig
from shard.model.kvcache import KVCache
from shard.model.linear import Linear

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]

#: transformers' ``l2norm`` epsilon (as the FLA kernels).
L2_EPS = 1e-6


class GatedRMSNorm(nn.Module):
    """``RMSNormGated``: an RMSNorm (weight times the normed row, cast back first) then times
    ``silu(gate)`` in fp32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class DepthwiseConv(nn.Module):
    """The short causal convolution's weight ``[C, 1, K]`` (transformers' ``nn.Conv1d`` name
    and shape; applied by ``GatedDeltaNet._convolve``)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; its state lives in ``KVCache.recurrent`` (module docstring).

    ``project`` and ``attend`` split the work as ``Attention``'s do, for
    ``shard.model.packed``: ``project`` is row-wise, ``attend`` runs one session's chunk
    against its cache and returns ``[B, Hv, S, Dv]`` for ``o_proj``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        la = config.linear_attn
        assert la is not None
        d = config.hidden_size
        self.hk, self.hv = la.n_k_heads, la.n_v_heads
        self.dk, self.dv = la.k_head_dim, la.v_head_dim
        self.kernel = la.conv_kernel
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.grouped = la.grouped
        if self.grouped:
            self.in_proj_qkvz = Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(d, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = Linear(d, self.conv_dim, bias=False)
            self.in_proj_z = Linear(d, self.value_dim, bias=False)
            self.in_proj_b = Linear(d, self.hv, bias=False)
            self.in_proj_a = Linear(d, self.hv, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, d, bias=False)
        #: run a short chunk as its decode steps, one row at a time (``Attention.rowwise``; set
        #: by the loader on quantized blocks): the norms' small reductions may sum a row among
        #: several in another order than alone
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
        """``x`` ``[B, S, D]`` at positions ``[start, start+S)`` (``Attention.forward``'s
        contract; ``rope`` and ``mask`` are not read)."""
        y = self.attend(*self.project(x, rope), mask=mask, cache=cache, layer=layer, start=start)
        b, s, _ = x.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.value_dim))

    def o_proj(self, y: Tensor) -> Tensor:
        """The output projection of the gated, normed heads ``[B, S, Hv*Dv]``."""
        out: Tensor = self.out_proj(y)
        return out

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        """Row-wise: the convolution's input ``[B, 1, S, C]`` (``q | k | v``, heads in order),
        ``z`` ``[B, 1, S, Hv*Dv]``, ``b`` and ``a`` ``[B, 1, S, Hv]``."""
        if self.grouped:
            mixed, z, b, a = self._ungroup(self.in_proj_qkvz(x), self.in_proj_ba(x))
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return mixed.unsqueeze(1), z.unsqueeze(1), b.unsqueeze(1), a.unsqueeze(1)

    def _ungroup(self, qkvz: Tensor, ba: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Qwen3-Next's per-key-head groups to plain ``q | k | v``, ``z``, ``b``, ``a``
        (transformers' ``fix_query_key_value_ordering``)."""
        bsz, s, _ = qkvz.shape
        per = self.hv // self.hk
        groups = qkvz.view(bsz, s, self.hk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = torch.split(groups, [self.dk, self.dk, per * self.dv, per * self.dv], dim=3)
        b, a = torch.split(ba.view(bsz, s, self.hk, 2 * per), [per, per], dim=3)
        flat = [t.reshape(bsz, s, -1) for t in (q, k, v)]
        mixed = torch.cat(flat, dim=-1)  # [B, S, C]
        return mixed, z.reshape(bsz, s, -1), b.reshape(bsz, s, -1), a.reshape(bsz, s, -1)

    def attend(
        self,
        mixed: Tensor,
        z: Tensor,
        b: Tensor,
        a: Tensor,
        *,
        mask: Tensor,
        cache: KVCache,
        layer: int,
        start: int | Tensor,
    ) -> Tensor:
        """Run the chunk ``[start, start+S)`` from the session's kept state, keep what a
        rollback needs, return the gated, normed heads ``[B, Hv, S, Dv]``."""
        state_cache = cache.recurrent
        assert state_cache is not None, "a linear-attention stage's cache has a recurrent part"
        at = int(start[0]) if isinstance(start, Tensor) else start  # no graphs: read it back
        if self.rowwise and 1 < mixed.shape[2] <= ROWWISE_MAX_ROWS:
            rows = [
                self.attend(*(t[:, :, i : i + 1] for t in (mixed, z, b, a)), mask=mask,
                            cache=cache, layer=layer, start=at + i)
                for i in range(mixed.shape[2])
            ]  # fmt: skip
            return torch.cat(rows, dim=2)
        mixed, z, b, a = mixed[:, 0], z[:, 0], b[:, 0], a[:, 0]  # [B, S, *]
        bsz, s, _ = mixed.shape
        state, first = state_cache.state_before(layer, at)
        for p in range(first, at):  # replay the kept steps up to the chunk
            state = self._step(state, *state_cache.step_inputs(layer, p))[0]
        conv = self._convolve(torch.cat((state_cache.conv_history(layer, at), mixed), dim=1))
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid()  # [B, S, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        per = self.hv // self.hk
        q, k = (t.reshape(bsz, s, self.hk, self.dk).repeat_interleave(per, dim=2) for t in (q, k))
        v = v.reshape(bsz, s, self.hv, self.dv)
        q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
        q, k = _l2norm(q) / (self.dk**0.5), _l2norm(k)  # [B, Hv, S, Dk]
        state_cache.keep(layer, at, mixed, k, v, g, beta)
        outs: list[Tensor] = []
        for i in range(s):
            state, o = self._step(
                state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i], q[:, :, i]
            )
            state_cache.snapshot(layer, at + i, state)
            assert o is not None
            outs.append(o)
        state_cache.set_live(layer, at + s - 1, state)
        core = torch.stack(outs, dim=1).to(mixed.dtype)  # [B, S, Hv, Dv]
        y: Tensor = self.norm(core, z.reshape(bsz, s, self.hv, self.dv))
        return y.transpose(1, 2)  # [B, Hv, S, Dv]

    @staticmethod
    def _step(
        state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, q: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """One position of the gated delta rule on ``state`` ``[B, Hv, Dk, Dv]`` (k, q ``[B,
        Hv, Dk]``, v ``[B, Hv, Dv]``, g, beta ``[B, Hv]``): the new state, and its read by
        ``q``. transformers' ``torch_recurrent_gated_delta_rule``, op for op."""
        state = state * g.exp()[..., None, None]
        kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, Dv]
        delta = (v - kv_mem) * beta.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        out = None if q is None else (state * q.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, Dv]
        return state, out

    def _convolve(self, window: Tensor) -> Tensor:
        """The causal convolution and SiLU over ``window`` ``[B, K-1+S, C]`` (history, then
        the chunk): ``[B, S, C]``, each output summed over its taps in order in fp32."""
        taps = self.conv1d.weight[:, 0].float()  # [C, K]
        s = int(window.shape[1]) - self.kernel + 1
        acc = window[:, 0:s].float() * taps[:, 0]
        for j in range(1, self.kernel):
            acc = acc + window[:, j : j + s].float() * taps[:, j]
        w_dtype = self.conv1d.weight.dtype
        return F.silu(acc.to(w_dtype)).to(window.dtype)
