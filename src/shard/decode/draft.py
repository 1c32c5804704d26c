"""Draft proposers: cheap guesses of the next tokens, verified by the ring in one lap.

A proposer continues a token context by up to ``k`` tokens. All proposers here are
deterministic (greedy), so the draft distribution q is one-hot and the lossless acceptance
rule reduces to "draw t ~ p; accept iff t == d" (see ``shard.decode.verify``).

- ``NGramProposer`` — prompt lookup: find the longest recent repeat of the context's suffix
  (tolerating one changed token, so a copied line with a new counter or operator still lines
  up) and propose what followed it. Free, and excellent on copy-heavy text (edits, quotes,
  summaries, code that repeats identifiers).
- ``ModelProposer`` — a small model with its own KV cache. Rollback is overwrite-by-position:
  it re-feeds only the part of the context that differs from what it has seen.
- ``OracleProposer`` — replays a known continuation (a prior reference run) at no cost, so
  α = 1: a benchmark ceiling that isolates engine efficiency from draft quality. Never a
  default; always labelled.
- ``AdaptiveProposer`` — per round, asks its proposers in order of recent acceptance and
  uses the first that has a guess.

``Drafter`` runs a session's proposer off the Trio thread when it computes (a model), behind
its own ``CapacityLimiter(1)``.

A proposer may read the target's own features (``features`` > 0: a draft head conditioned on
them): its session then opens with ``OpenSession.features`` set, and the driver hands it each
verdict's checked features (``observe``) before it next proposes. None of the proposers here
asks for any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np
import torch
import trio

from shard.compute import offload
from shard.decode.state import is_greedy
from shard.messages import DraftQ, Sampling
from shard.model.llama import StageModel


class Proposer(Protocol):
    """Continues a context by up to ``k`` tokens (fewer, or none, when it has no guess)."""

    @property
    def name(self) -> str: ...

    @property
    def computes(self) -> bool:
        """True when proposing runs a model (then it goes to a worker thread)."""
        ...

    @property
    def features(self) -> int:
        """Rows of the target's features it wants with each verdict, at most
        ``shard.messages.MAX_FEATURES`` (0: none, and ``observe`` is never called)."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose entering states, side by side, are its features
        (``shard.messages.OpenSession.feature_layers``; an EAGLE-3 head's), strictly
        increasing; empty: the final norm's output (or no features)."""
        ...

    def propose(self, context: Sequence[int], k: int) -> list[int]: ...

    def feedback(self, drafted: int, accepted: int) -> None: ...

    def observe(self, position: int, features: torch.Tensor) -> None:
        """The target's features at stream positions ``position .. position+n-1``: float32
        ``[n, hidden]`` on the drafter's device, row ``i`` the final-norm output the target's
        head read to choose the token at ``position + i + 1`` (``shard.messages.Verdict``),
        every row's input committed. Called on the Trio thread, after a verdict is folded in
        and before the next ``propose``, never while this proposer's ``propose`` runs: it
        should only keep what it gets, and do the work in ``propose`` (a worker thread)."""
        ...


SparseQ = tuple[torch.Tensor, torch.Tensor]
"""A draft distribution as a sampling proposer returns it: token ids ``[n]`` (int64) and
their probabilities ``[n]`` (summing to 1)."""


@runtime_checkable
class SamplingProposer(Protocol):
    """A proposer that can also draft by sampling from its own distribution q (a model): for
    a sampled request the tail then judges each token by the general rule with that q
    (``shard.decode.verify``), accepting more than a greedy draft's one-hot q would."""

    def propose_sampled(
        self, context: Sequence[int], k: int, generator: torch.Generator, temperature: float
    ) -> tuple[list[int], list[SparseQ]]:
        """Up to ``k`` tokens, each drawn from q at ``temperature`` with ``generator``, and
        the q each was drawn from (one per token)."""
        ...


#: Mixed into a request's seed for its draft's draws: the draft's randomness must be
#: independent of the tail's (seed, position) draws, or the acceptance rule is biased.
_DRAFT_SALT = 0xD1B54A32D192ED03


def draft_generator(sampling: Sampling, position: int) -> torch.Generator:
    """The generator a sampled draft starting at stream ``position`` draws with: keyed by
    (seed, position) like the tail's draws, so a seeded run drafts the same way each time,
    and salted apart from them."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((sampling.seed * _DRAFT_SALT + 7 * position + 1) % (1 << 63))
    return gen


def as_draft_q(q: SparseQ) -> DraftQ:
    """A sampling proposer's q as it goes on the wire."""
    ids, probs = q
    return DraftQ(ids=tuple(int(t) for t in ids.tolist()), probs=tuple(probs.tolist()))


class NGramProposer:
    """Prompt lookup over the context (prompt + committed + drafted so far).

    Every earlier position is a candidate: the tokens before it are compared with the
    context's last ``window`` tokens, walking backwards. The exact match is the candidate
    with the longest run of equal tokens (at least ``min_n``); the *tolerant* match allows
    one unequal token inside the window and counts the equal ones. The tolerant match wins
    when it holds at least 3 tokens and one more than the exact match: after a substitution
    (a log line's counter 0415 -> 0416, ``+`` -> ``-`` in a copied line of code) the exact
    suffix contains the new token and finds nothing long, while the line it was copied from
    still lines up around it. Ties go to the most recent candidate (local repetition).
    ``tolerant=False`` is plain longest-suffix prompt lookup.
    """

    name = "ngram"
    computes = False
    features = 0
    feature_layers: tuple[int, ...] = ()

    def __init__(self, *, window: int = 8, min_n: int = 1, tolerant: bool = True) -> None:
        if not 1 <= min_n <= window:
            raise ValueError(f"need 1 <= min_n <= window, got min_n={min_n}, window={window}")
        self._window = window
        self._min_n = min_n
        self._tolerant = tolerant

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self.lookup(context, k)[0]

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the best match, and how many context tokens
        that match lines up (0: no guess) — the confidence a hybrid draft reads.

        Every candidate is scored at once (a ``[candidates, window]`` comparison): a hybrid
        looks up several times per proposal and once per settled token, and a Python walk
        over a 3,000-token context took ~1.7 ms. ``tests/test_draft_ngram.py`` checks it
        against that walk, position by position."""
        tokens = list(context)
        end = len(tokens)
        if end < 2:
            return [], 0
        arr = np.fromiter(tokens, dtype=np.int64, count=end)
        at = np.arange(end - 1, 0, -1)  # candidate continuations, most recent first (ties)
        eq = np.zeros((end - 1, self._window), dtype=bool)  # [C, W]: token at - j == end - j
        inside = np.zeros_like(eq)  # j <= at: the walk stops at the context's start
        for j in range(1, min(self._window, end - 1) + 1):
            eq[: end - j, j - 1] = arr[end - 1 - j :: -1] == arr[end - j]
            inside[: end - j, j - 1] = True
        miss = inside & ~eq
        misses_before: np.ndarray = np.cumsum(miss, axis=1) - miss
        run = (eq & (misses_before == 0)).sum(axis=1)  # the exact run, up to the first miss
        best = int(np.argmax(run))  # the first (most recent) of the longest
        exact_n, exact_at = int(run[best]), int(at[best])
        if self._tolerant:
            equal = (eq & (misses_before <= 1)).sum(axis=1)  # equal ones, one miss allowed
            loose = int(np.argmax(equal))
            loose_n, loose_at = int(equal[loose]), int(at[loose])
            if loose_n >= 3 and loose_n > exact_n:
                return tokens[loose_at : loose_at + k], loose_n
        if exact_n >= self._min_n:
            return tokens[exact_at : exact_at + k], exact_n
        return [], 0

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        return None


class ModelProposer:
    """A small causal LM (a ``StageModel`` holding every layer) drafting greedily."""

    name = "model"
    computes = True
    features = 0
    feature_layers: tuple[int, ...] = ()

    def __init__(self, model: StageModel, *, max_len: int) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError("a draft model must hold every layer (embedding to head)")
        self._model = model
        self._cache = model.new_cache(max_len)
        self._fed: list[int] = []

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        tokens = list(context)
        room = self._cache.max_len - len(tokens)
        k = min(k, room)
        if k <= 0 or not tokens:
            return []
        common = 0
        for a, b in zip(self._fed, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # re-feed at least the last token for logits
        out: list[int] = []
        with torch.inference_mode():
            logits = self._feed(tokens[common:], common)
            self._fed = tokens
            while True:
                token = int(torch.argmax(logits[0, -1]).item())
                out.append(token)
                if len(out) == k:
                    return out
                ids = torch.tensor([[token]], device=self._model.device)  # [1, 1]
                logits = self._model(ids, len(self._fed), self._cache)
                self._fed.append(token)

    def _feed(self, tokens: list[int], start: int) -> torch.Tensor:
        logits = torch.empty(0)
        for i in range(0, len(tokens), 128):
            chunk = torch.tensor([tokens[i : i + 128]], device=self._model.device)  # [1, S]
            logits = self._model(chunk, start + i, self._cache)  # [1, S, V]
        return logits

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        return None


class OracleProposer:
    """Replays ``reference`` (prompt + a prior run's output): α = 1 while on script."""

    name = "oracle"
    computes = False
    features = 0
    feature_layers: tuple[int, ...] = ()

    def __init__(self, reference: Sequence[int]) -> None:
        self._reference = list(reference)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        n = len(context)
        if list(context) != self._reference[:n]:
            return []
        return self._reference[n : n + k]

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        return None


@attrs.define
class _Scored:
    proposer: Proposer
    alpha: float


class AdaptiveProposer:
    """Asks its proposers in order of recent acceptance (EWMA); the first guess wins."""

    name = "auto"

    def __init__(self, proposers: Sequence[Proposer], *, prior: float = 0.5) -> None:
        if len({p.feature_layers for p in proposers if p.features}) > 1:
            raise ValueError("its members read different features (layer states and others)")
        self._scored = [_Scored(p, prior) for p in proposers]
        self._last: _Scored | None = None

    @property
    def computes(self) -> bool:
        return any(s.proposer.computes for s in self._scored)

    @property
    def features(self) -> int:
        return max((s.proposer.features for s in self._scored), default=0)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Its members' (one kind of features for all: ``__init__`` checks)."""
        return next((s.proposer.feature_layers for s in self._scored if s.proposer.features), ())

    def observe(self, position: int, features: torch.Tensor) -> None:
        """Each member that reads features gets the last rows of its own window."""
        n = int(features.shape[0])
        for scored in self._scored:
            want = min(scored.proposer.features, n)
            if want:
                scored.proposer.observe(position + n - want, features[n - want :])

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self._last = None
        for scored in sorted(self._scored, key=lambda s: -s.alpha):
            guess = scored.proposer.propose(context, k)
            if guess:
                self._last = scored
                return guess
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        if self._last is not None and drafted > 0:
            self._last.alpha += 0.2 * (accepted / drafted - self._last.alpha)
            self._last.proposer.feedback(drafted, accepted)


ProposerFactory = Callable[[Sequence[int]], Proposer]
"""Makes a fresh proposer for one session, given its prompt ids."""


class Drafter:
    """Runs proposers for the coordinator's sessions; model proposers in a worker thread.

    Cancellation: a cancelled ``propose`` waits for the worker thread's forward to finish
    (threads are never killed mid-forward) and then raises ``Cancelled``.
    """

    def __init__(self, factory: ProposerFactory, *, device: torch.device | str = "cpu") -> None:
        """``device``: where the proposers compute, and so where ``observe`` puts features."""
        self._factory = factory
        self._limiter = trio.CapacityLimiter(1)
        self._device = torch.device(device)

    def session(self, prompt: Sequence[int]) -> Proposer:
        return self._factory(prompt)

    def observe(self, proposer: Proposer, position: int, features: torch.Tensor) -> None:
        """Hand ``proposer`` the target's checked features (float32 ``[n, hidden]``) for
        positions from ``position``, on the drafter's device."""
        proposer.observe(position, features.to(self._device))

    async def propose(
        self, proposer: Proposer, context: Sequence[int], k: int
    ) -> tuple[list[int], float]:
        """Up to ``k`` drafted tokens and the seconds it took."""
        if k <= 0:
            return [], 0.0
        began = time.perf_counter()
        if proposer.computes:
            tokens = await offload.run_sync(
                proposer.propose, list(context), k, limiter=self._limiter
            )
        else:
            tokens = proposer.propose(context, k)
        return tokens, time.perf_counter() - began

    async def propose_for(
        self, proposer: Proposer, context: Sequence[int], k: int, sampling: Sampling
    ) -> tuple[list[int], list[DraftQ] | None, float]:
        """Up to ``k`` drafted tokens for a request with ``sampling``: drawn from the
        proposer's q (returned, one per token) when the request samples and the proposer can
        (``SamplingProposer``), else greedy (q None). And the seconds it took."""
        if k <= 0 or is_greedy(sampling) or not isinstance(proposer, SamplingProposer):
            tokens, seconds = await self.propose(proposer, context, k)
            return tokens, None, seconds
        began = time.perf_counter()
        generator = draft_generator(sampling, len(context))
        draw = proposer.propose_sampled
        args = (list(context), k, generator, sampling.temperature)
        if proposer.computes:
            tokens, qs = await offload.run_sync(draw, *args, limiter=self._limiter)
        else:
            tokens, qs = draw(*args)
        if len(qs) != len(tokens):
            raise RuntimeError(f"{proposer.name}: {len(qs)} q for {len(tokens)} drafted tokens")
        return tokens, [as_draft_q(q) for q in qs], time.perf_counter() - began
