"""The target's choice and the acceptance rule: pure functions, no I/O.

The tail stage calls ``verify_chunk`` on the logits of one chunk; the single-process reference
(``shard.decode.reference``) calls ``choose_token`` one position at a time. A sampled draw is keyed
by
(request seed, absolute position), not by how many draws came before, so the token chosen at a
position depends only on the seed and the text before it: a seeded run gives the same output
through the ring, with or without speculation, pipelined or not, and with stale chunks
computed or skipped — and equals the reference run.

With a deterministic draft (q one-hot on the drafted token) the lossless speculative-sampling
rule — accept d with probability min(1, p(d)/q(d)) = p(d), else resample from the normalised
residual max(0, p - q) — is exactly "draw t ~ p; accept iff t == d": P(accept) = p(d), and a
rejected draw is distributed as p restricted to tokens != d. So one draw per position serves
greedy decoding, plain sampling and verification alike.

A draft that *samples* its token from a distribution q it sends along (``DraftQ``) is judged
by the general rule instead (``verify_chunk`` with ``q``): accept d with probability
min(1, p(d)/q(d)), else draw from the normalised residual max(0, p - q). The committed token
is distributed as p either way (lossless), but acceptance rises from Σ q·p to Σ min(p, q):
a draft as sure as the target is accepted as often, not only when its guess is the draw.
The uniform and the residual draw come from the same (seed, position) generator, so a seeded
request with a seeded draft gives the same text every run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from shard.decode.state import MAX_TEMPERATURE, MIN_TEMPERATURE, is_greedy
from shard.messages import DraftQ, Sampling

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads (seed, position) over the seed space


def position_generator(sampling: Sampling, position: int) -> torch.Generator:
    """The CPU generator for the draw at absolute ``position`` of a request."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((sampling.seed * _MIX + position) % (1 << 63))
    return gen


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, top-k and top-p (nucleus) applied to one row of logits [V] -> probs [V].

    Robust to whatever arrives: NaN logits count as impossible, infinities are clamped, the
    temperature is held inside [MIN_TEMPERATURE, MAX_TEMPERATURE] and the likeliest token
    always survives top-p, so the result is a finite distribution with positive mass (a row
    with nothing usable falls back to its argmax).
    """
    finfo = torch.finfo(torch.float32)
    clean = torch.nan_to_num(logits.float(), nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    temperature = min(max(sampling.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
    # The max is subtracted before dividing, so the likeliest token scales to exactly 0 and a
    # small temperature can only send the others to -inf (probability 0), never to inf/NaN.
    scaled = (clean - clean.max()) / temperature  # [V]
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays
        # (a top_p that rounds to 0 in float32 would otherwise drop every token).
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= sampling.top_p
        drop[0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        probs = torch.zeros_like(probs)
        probs[int(torch.argmax(clean))] = 1.0
    return probs


def choose_token(logits: torch.Tensor, sampling: Sampling, position: int) -> int:
    """The target's token at absolute ``position`` (the position it will occupy): argmax when
    greedy, else one draw keyed by (seed, position). Decided in fp32 whatever the logits' dtype
    (a bf16 tail's ties and near-ties would otherwise round differently from the reference)."""
    logits = logits.float()  # [V]; a no-op for the fp32 logits StageModel returns
    if is_greedy(sampling):
        finfo = torch.finfo(torch.float32)
        clean = torch.nan_to_num(logits, nan=finfo.min)
        return int(torch.argmax(clean).item())
    probs = filter_logits(logits, sampling)
    generator = position_generator(sampling, position)
    return int(torch.multinomial(probs, 1, generator=generator).item())


@attrs.frozen
class ChunkVerdict:
    """The target's ids for a verified chunk and how many drafted ids they confirmed."""

    target_ids: tuple[int, ...]
    accepted: int


def check_q(q: Sequence[DraftQ], draft: Sequence[int], vocab: int) -> str | None:
    """Why ``q`` cannot be the distributions ``draft`` was sampled from, or None: one per
    drafted token (or none at all), ids in the vocabulary and distinct, probabilities finite,
    non-negative and summing to 1, and each drafted token possible under its own q."""
    if not q:
        return None
    if len(q) != len(draft):
        return f"{len(q)} draft distributions for {len(draft)} drafted tokens"
    for i, (dq, token) in enumerate(zip(q, draft, strict=True)):
        if not dq.ids or len(dq.ids) != len(dq.probs) or len(set(dq.ids)) != len(dq.ids):
            return f"draft distribution {i}: ids and probs must be non-empty, distinct, paired"
        if any(not 0 <= t < vocab for t in dq.ids):
            return f"draft distribution {i}: token id out of range [0, {vocab})"
        if any(not (math.isfinite(x) and x >= 0.0) for x in dq.probs):
            return f"draft distribution {i}: probabilities must be finite and >= 0"
        if abs(math.fsum(dq.probs) - 1.0) > 1e-3:
            return f"draft distribution {i}: probabilities sum to {math.fsum(dq.probs):.6f}, not 1"
        if token not in dq.ids or dq.probs[dq.ids.index(token)] <= 0.0:
            return f"draft distribution {i}: the drafted token {token} has probability 0"
    return None


def _accept_or_resample(
    probs: torch.Tensor, token: int, dq: DraftQ, generator: torch.Generator
) -> int:
    """The general rule at one position: ``token`` if accepted, else a residual draw."""
    q = torch.zeros_like(probs)
    q[torch.tensor(dq.ids)] = torch.tensor(dq.probs, dtype=probs.dtype)
    q = q / q.sum()  # the sender's rounding, removed
    u = float(torch.rand((), generator=generator))
    if u * float(q[token]) < float(probs[token]):  # u < p(d)/q(d), without dividing
        return token
    residual = (probs - q).clamp_min(0.0)
    if not float(residual.sum()) > 0.0:  # p <= q everywhere: p == q, never rejected above
        residual = probs
    return int(torch.multinomial(residual, 1, generator=generator).item())


def verify_chunk(
    logits: torch.Tensor,
    draft: Sequence[int],
    sampling: Sampling,
    position: int,
    q: Sequence[DraftQ] = (),
) -> ChunkVerdict:
    """Decide a chunk of K drafted tokens from the target's logits at its K+1 positions.

    ``logits`` is [K+1, V]: row i is the target's distribution after the chunk's i-th input,
    i.e. for the token at absolute position ``position + i``.
    Walks the drafts in order: the target chooses at position i; if that equals draft[i] the
    draft is accepted and the walk goes on, otherwise the chosen token replaces it and the
    walk stops. When every draft holds, the last row gives a bonus token. Returns the accepted
    prefix plus one target token, so ``len(target_ids) == accepted + 1``.

    With ``q`` (one ``DraftQ`` per drafted token, checked by ``check_q``) and a sampled
    request, each drafted token is judged by the general rule (the module docstring); a
    greedy request ignores q (the target's argmax decides).
    """
    if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits {tuple(logits.shape)} do not fit {len(draft)} drafted tokens")
    if q and len(q) != len(draft):
        raise ValueError(f"{len(q)} draft distributions for {len(draft)} drafted tokens")
    general = bool(q) and not is_greedy(sampling)
    chosen: list[int] = []
    for i in range(len(draft) + 1):
        if general and i < len(draft):
            probs = filter_logits(logits[i].float(), sampling)
            generator = position_generator(sampling, position + i)
            token = _accept_or_resample(probs, int(draft[i]), q[i], generator)
        else:
            token = choose_token(logits[i], sampling, position + i)
        chosen.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return ChunkVerdict(target_ids=tuple(chosen), accepted=len(chosen) - 1)
