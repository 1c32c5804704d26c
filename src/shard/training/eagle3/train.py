"""Training an ``Eagle3Head`` on the target's own text: the training-time test.

At head position ``p`` the head reads the target's states ``a_p`` (entering its three
layers) and the token ``x_{p+1}``, and predicts ``x_{p+2}``: the label is the target's
distribution at ``p + 1`` over the draft vocabulary (its final normed hidden times the tied
head's rows for those tokens). Drafting past the last verified position chains: the head's
own output ``g`` stands in for ``fc(a)`` one position on (``Eagle3Head.step``). A head
trained on real states alone has never seen its own ``g`` as an input, so training unrolls
the chain as drafting runs it (EAGLE-3's training-time test): in unrolled step ``j`` the
query at ``p`` reads ``g`` of step ``j - 1`` at ``p - 1`` and attends to the real positions
up to ``p - j`` and to the chained positions ``p - j + 1 .. p`` of steps ``1 .. j`` -- exactly
the keys a proposer's cache holds when it drafts its ``j + 1``-th token from ``p - j``.
Every step keeps the teacher's token ``x_{p+1}`` as input and the same label.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from shard.decode.head.eagle3 import Eagle3Head
from shard.model.attention import apply_rotary

__all__ = ["Eagle3Recipe", "loss_mask", "step_loss", "unrolled"]


@attrs.frozen
class Eagle3Recipe:
    """How a head is trained: ``depth`` unrolled steps, ``rows`` rows a step, the readout
    scored at ``positions`` random positions per unrolled step, AdamW at ``lr`` (warm-up,
    then cosine to a tenth), uniform noise on the input states of ``noise`` x each layer's
    state's RMS at that position."""

    draft_vocab: int = 8192
    depth: int = 3
    decay: float = 0.8  # step j's loss weight: decay ** j
    rows: int = 16
    positions: int = 1024
    lr: float = 2e-3
    weight_decay: float = 0.01
    noise: float = 0.05
    clip: float = 0.5
    seed: int = 0


def unrolled(head: Eagle3Head, states: Tensor, next_ids: Tensor, depth: int) -> list[Tensor]:
    """``g`` ``[B, S, D]`` of each of ``depth`` unrolled steps over head positions
    ``0..S-1`` (``states`` ``[B, S, F]``, ``next_ids`` ``[B, S]``: ``x_{p+1}``). In step
    ``j`` rows ``p < j`` have no chain to read and are garbage: leave them out of the loss."""
    b, s = next_ids.shape
    head._cover(s)
    m = head.midlayer
    a = m.self_attn
    emb = m.input_layernorm(head.embed_tokens(next_ids))
    cos, sin = head.rope_cos[:s].to(emb.dtype), head.rope_sin[:s].to(emb.dtype)
    u = head.fc(states)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    outs: list[Tensor] = []
    for j in range(depth):
        if j:
            u = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # g of step j-1 at p-1, read at p
        x = torch.cat((emb, m.hidden_norm(u)), dim=-1)
        q = a.q_proj(x).view(b, s, a.n_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, s, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, s, a.n_kv, a.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = a.n_heads // a.n_kv
        keys.append(k.repeat_interleave(rep, dim=1))
        values.append(v.repeat_interleave(rep, dim=1))
        outs.append(head._rest(u, _attend(q, keys, values, j)))
    return outs


def _attend(q: Tensor, keys: list[Tensor], values: list[Tensor], j: int) -> Tensor:
    """Step ``j``'s attention ``[B, H, S, Dh]``: real keys at ``<= p - j``, and step ``i``'s
    key at ``p - j + i`` for ``i = 1..j``."""
    s, scale = q.shape[2], q.shape[-1] ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16 under autocast: softmax in fp32
    qf = q.to(acc)
    pos = torch.arange(s, device=q.device)
    real = qf @ keys[0].to(acc).transpose(-1, -2) * scale  # [B, H, S, S]
    real = real.masked_fill(pos[None, :] > pos[:, None] - j, float("-inf"))
    parts, vals = [real], []
    for i in range(1, j + 1):
        shift = j - i  # step i's key for query p sits at p - shift
        k_i = F.pad(keys[i].to(acc), (0, 0, shift, 0))[:, :, :s]
        parts.append((qf * k_i).sum(-1, keepdim=True) * scale)  # [B, H, S, 1]
        vals.append(F.pad(values[i].to(acc), (0, 0, shift, 0))[:, :, :s])
    w = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    y = w[..., :s] @ values[0].to(acc)
    for i, v in enumerate(vals):
        y = y + w[..., s + i : s + i + 1] * v
    return y.to(q.dtype)


def loss_mask(ids: Tensor, valid: Tensor, stop_ids: tuple[int, ...]) -> Tensor:
    """``[B, S-1]``: head position ``p`` is scored when ``x_{p+1}`` is real text and not a
    stop token (after one, the label would predict past the end)."""
    nxt = ids[:, 1:]
    return valid[:, 1:] & ~torch.isin(nxt, torch.tensor(stop_ids, device=ids.device))


def step_loss(
    head: Eagle3Head,
    outs: list[Tensor],
    target_rows: Tensor,
    final_next: Tensor,
    mask: Tensor,
    recipe: Eagle3Recipe,
    generator: torch.Generator,
) -> tuple[Tensor, list[float]]:
    """The weighted soft cross-entropy of every unrolled step against the target's
    distribution over the draft vocabulary (``target_rows`` ``[N, D]``: its head's rows for
    the draft ids; ``final_next`` ``[B, S, D]``: its final normed hidden at ``p + 1``), at up
    to ``recipe.positions`` random scored positions (the same for every step, each of which
    has a chain to read: ``p >= depth - 1``); and each step's top-1 agreement with the
    target's restricted argmax."""
    m = mask.clone()
    m[:, : len(outs) - 1] = False
    idx = m.flatten().nonzero()[:, 0]
    if len(idx) > recipe.positions:
        idx = idx[torch.randperm(len(idx), generator=generator)[: recipe.positions]]
    with torch.no_grad():
        t = (final_next.flatten(0, 1)[idx] @ target_rows.T).float()  # [R, N]
        p_t = torch.softmax(t, dim=-1)
        best = t.argmax(-1)
    weights = [recipe.decay**j for j in range(len(outs))]
    total = head.lm_head.weight.new_zeros(())
    agree = []
    for j, g in enumerate(outs):
        logits = head.logits(g.flatten(0, 1)[idx]).float()
        ce = -(p_t * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + weights[j] / sum(weights) * ce
        agree.append(float((logits.detach().argmax(-1) == best).float().mean()))
    return total, agree
