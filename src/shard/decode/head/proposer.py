"""``HeadProposer``: drafting with a ``DraftHead`` from the target's features.

The coordinator hands it the target's features of committed positions (``observe``) and
asks it to continue a context (``propose``). Head position ``t`` reads the feature ``f_t``
and the token ``x_{t+1}``; its output predicts ``f_{t+1}``, whose readout is the draft for
``x_{t+2}``. For a context ``x_0..x_m`` it therefore needs head positions up to ``m - 1``:

- positions with an observed feature read it;
- positions past the last observed feature (a context that runs ahead of the verdicts, as
  when chunks are pipelined) read the head's own prediction ``g_{t-1}`` instead;
- then it drafts ``k`` tokens, each chained on the previous prediction.

Rollback is overwrite-by-position, as for every KV cache here: the proposer remembers the
tokens and features each cached position was computed from, and recomputes from the first
position whose inputs changed (a new feature for it, or a different token). Positions more
than a window behind are never read again, so a prompt needs only its last ``features`` rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.model import DraftHead, HeadError
from shard.decode.head.mtp import MtpHead

__all__ = ["HeadProposer", "SparseQ"]

SparseQ = tuple[Tensor, Tensor]
"""A draft distribution: token ids ``[n]`` (int64) and their probabilities ``[n]`` (sum 1)."""

_CHUNK = 128  # observed positions fed to the head in one forward


class HeadProposer:
    """Drafts greedily (``propose``) or by sampling its own q (``propose_sampled``).

    ``features``: how many trailing prompt features it wants after prefill (the head's
    ``feature_window``). The head is a ``DraftHead`` (``name`` "head"), a checkpoint's MTP
    block (``MtpHead``, ``name`` "mtp"; it observes the same final-norm features) or an
    EAGLE-3 head (``Eagle3Head``, ``name`` "eagle3"), whose observed features are its three
    target layers' states side by side and whose chained states are narrower (``feature_dim``,
    ``hidden_dim``).
    ``layers``: an EAGLE-3 head's target layers (``Eagle3Config.layers_for``, strictly
    increasing as its config must declare them), which the ring is asked for
    (``feature_layers``). Empty: the caller observes the states itself (in one process) and
    the ring is asked for no layers.
    """

    computes = True

    def __init__(
        self,
        head: DraftHead | Eagle3Head | MtpHead,
        *,
        max_len: int,
        top_k: int = 32,
        layers: Sequence[int] = (),
    ) -> None:
        self.name = _name(head)
        increasing = all(a < b for a, b in itertools.pairwise(layers))
        if layers and (self.name != "eagle3" or not increasing):
            raise HeadError(f"layers {list(layers)}: increasing layers of an EAGLE-3 head only")
        self.feature_layers = tuple(layers)
        self._head = head
        self._max_len = max_len
        self._top_k = top_k
        self._cache = head.new_cache(max_len)
        w = next(head.parameters())
        self._feats = torch.zeros(max_len, head.feature_dim, dtype=w.dtype, device=w.device)
        self._obs_lo = self._obs_hi = 0  # observed positions [lo, hi), contiguous
        self._g = torch.zeros(max_len, head.hidden_dim, dtype=w.dtype, device=w.device)
        self._tokens: list[int] = []  # x_0..x_{done}: what positions [first, done) read
        self._first = 0  # the first head position of this session (= _obs_lo when fed)
        self._done = 0  # head positions [_first, _done) are computed and current

    @property
    def features(self) -> int:
        return self._head.feature_window

    def observe(self, position: int, features: Tensor) -> None:
        """The target's features ``[n, D]`` at stream positions ``position..position+n-1``.

        Overwrites what was observed there and drops anything observed after it (those rows
        came from a context that is no longer committed). A gap after the observed range
        starts a new range at ``position``: the head restarts there.
        """
        n = int(features.shape[0])
        d = self._feats.shape[1]
        if features.dim() != 2 or features.shape[1] != d:
            raise HeadError(f"features must be [n, {d}], got {tuple(features.shape)}")
        if position < 0 or position + n > self._max_len:
            raise HeadError(f"positions [{position}, {position + n}) outside 0..{self._max_len}")
        if n == 0:
            return
        if self._obs_hi == self._obs_lo or position > self._obs_hi or position < self._obs_lo:
            self._obs_lo = position  # a fresh range (or one reaching further back)
            self._first = position
            self._done = position
        self._feats[position : position + n] = features.to(self._feats.device, self._feats.dtype)
        self._obs_hi = position + n
        self._done = min(self._done, position)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        tokens, _ = self._draft(context, k, None, 1.0)
        return tokens

    def propose_sampled(
        self, context: Sequence[int], k: int, generator: torch.Generator, temperature: float = 1.0
    ) -> tuple[list[int], list[SparseQ]]:
        """Up to ``k`` tokens, each drawn from the head's q (softmax of its readout logits at
        ``temperature``, restricted to its ``top_k`` and renormalized), with the q each was
        drawn from. The same generator state gives the same draws."""
        if temperature <= 0:
            raise HeadError(f"temperature must be positive, got {temperature}")
        return self._draft(context, k, generator, temperature)

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def ranked(self, context: Sequence[int], n: int) -> list[int]:
        """The head's ``n`` likeliest tokens for the first draft after ``context``, best first
        (its greedy draft is the first): what a tree verify would send (``bench/head_beta``)."""
        logits = self._first_logits(context)
        if logits is None:
            return []
        top = torch.topk(logits, min(n, int(logits.shape[0]))).indices
        return [int(t) for t in self._head.to_vocab(top)]

    def first_q(self, context: Sequence[int], temperature: float) -> SparseQ | None:
        """The q ``propose_sampled`` would draw the first draft after ``context`` from."""
        logits = self._first_logits(context)
        return None if logits is None else self._q(logits, temperature)

    def _first_logits(self, context: Sequence[int]) -> Tensor | None:
        tokens = list(context)
        m = len(tokens) - 1
        if m < 1 or self._obs_hi == self._obs_lo or m - 1 < self._first or m >= self._max_len:
            return None
        with torch.inference_mode():
            self._catch_up(tokens, m)
            logits: Tensor = self._head.logits(self._g[m - 1])  # [N]
            return logits

    def _draft(
        self,
        context: Sequence[int],
        k: int,
        generator: torch.Generator | None,
        temperature: float,
    ) -> tuple[list[int], list[SparseQ]]:
        tokens = list(context)
        m = len(tokens) - 1  # the last token's position; head positions up to m - 1 feed it
        k = min(k, self._max_len - m)
        if k <= 0 or self._obs_hi == self._obs_lo or m - 1 < self._first:
            return [], []
        with torch.inference_mode():
            self._catch_up(tokens, m)
            g = self._g[m - 1 : m]  # [1, D]: predicts f_m
            out: list[int] = []
            qs: list[SparseQ] = []
            for i in range(k):
                token, q = self._choose(g[0], generator, temperature)
                out.append(token)
                if q is not None:
                    qs.append(q)
                if i + 1 == k:
                    break
                self._feed_one(g, token, m + i)  # position m + i reads x_{m+i+1} = token
                self._tokens.append(token)
                self._done = m + i + 1
                g = self._g[m + i : m + i + 1]
            return out, qs

    def _catch_up(self, tokens: list[int], m: int) -> None:
        """Make head positions ``[_first, m)`` current for ``tokens`` (``x_0..x_m``)."""
        same = 0
        limit = min(len(self._tokens), len(tokens))
        while same < limit and self._tokens[same] == tokens[same]:
            same += 1
        # position t reads x_{t+1}: a change at x_i invalidates every t >= i - 1
        start = max(self._first, min(self._done, same - 1, m))
        real_end = min(self._obs_hi, m)
        for a in range(start, real_end, _CHUNK):
            b = min(a + _CHUNK, real_end)
            ids = torch.tensor([tokens[a + 1 : b + 1]])  # [1, S]
            g = self._head.step(self._feats[None, a:b], ids, a, self._cache, first=self._first)
            self._g[a:b] = g[0]
        for t in range(max(start, real_end), m):  # ahead of the observed features: chain
            self._feed_one(self._g[t - 1 : t], tokens[t + 1], t)
        self._tokens = tokens[: m + 1]
        self._done = m

    def _feed_one(self, feature: Tensor, token: int, t: int) -> None:
        """Head position ``t`` from ``feature`` ``[1, D]`` and token ``x_{t+1}``."""
        ids = torch.tensor([[token]])
        g = self._head.step(feature[None], ids, t, self._cache, first=self._first)
        self._g[t] = g[0, 0]

    def _choose(
        self, g: Tensor, generator: torch.Generator | None, temperature: float
    ) -> tuple[int, SparseQ | None]:
        logits = self._head.logits(g)  # [N]
        if generator is None:
            return int(self._head.to_vocab(logits.argmax())), None
        ids, probs = self._q(logits, temperature)
        cdf = probs.cumsum(0)
        u = torch.rand(1, generator=generator, dtype=cdf.dtype) * cdf[-1]
        pick = int(torch.searchsorted(cdf, u).clamp(max=len(probs) - 1))
        return int(ids[pick]), (ids, probs)

    def _q(self, logits: Tensor, temperature: float) -> SparseQ:
        """q: the softmax at ``temperature`` of the readout's ``top_k`` (token ids, probs),
        on the CPU (where the sampler's generator and the wire are)."""
        top, index = torch.topk(logits.float() / temperature, min(self._top_k, len(logits)))
        return self._head.to_vocab(index).cpu(), torch.softmax(top, dim=-1).cpu()


def _name(head: DraftHead | Eagle3Head | MtpHead) -> str:
    if isinstance(head, Eagle3Head):
        return "eagle3"
    return "mtp" if isinstance(head, MtpHead) else "head"
