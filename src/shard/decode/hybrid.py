"""A hybrid draft, per position: prompt lookup where it has a long match, a model elsewhere.

Copy spans (an edit of a file, a quoted paragraph, a log line repeated with a new counter)
are what prompt lookup guesses for free and almost always right; ordinary text is what it
guesses nothing of, and where a model draft (the feature-conditioned head) earns its cost.
``HybridProposer`` decides token by token inside one chunk: while the context's suffix lines
up with an earlier span over at least ``min_match`` tokens it copies what followed (the whole
span, up to the chunk's end); elsewhere it asks the model for one token, then looks again.
The model sees every token either way (a model proposer re-feeds what it has not seen), so
its state stays the one the chunk's context gives.

``names`` records which draft guessed each token of the last proposal (``LOOKUP``, "ngram",
or the model's name): the coordinator prices the two apart (``SpeculationController``), and
``lookup_span`` says how far the lookup would copy before the model drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard.decode.control import LOOKUP
from shard.decode.draft import NGramProposer, Proposer, SamplingProposer, SparseQ

__all__ = ["HybridProposer"]

#: Context tokens a lookup match must line up before the hybrid trusts it over the model:
#: measured along the target's greedy continuations (``bench/hybrid_match.py``, 10 prompts,
#: ``bench/results/hybrid_match.json``), a one-token match guesses right 12 % of the time
#: against the head's 23 %, a two-token match 39 % against 23 %, and longer ones more still.
DEFAULT_MIN_MATCH = 2


def _one_hot(token: int) -> SparseQ:
    return torch.tensor([token]), torch.tensor([1.0])


class HybridProposer:
    """Prompt lookup over long matches, ``model`` elsewhere (see the module docstring)."""

    name = "hybrid"

    def __init__(
        self,
        model: Proposer,
        *,
        lookup: NGramProposer | None = None,
        min_match: int = DEFAULT_MIN_MATCH,
    ) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self._model = model
        self._lookup = lookup if lookup is not None else NGramProposer()
        self._min_match = min_match
        self.names: list[str] = []

    @property
    def computes(self) -> bool:
        return self._model.computes

    @property
    def features(self) -> int:
        return self._model.features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._model.feature_layers

    def observe(self, position: int, features: torch.Tensor) -> None:
        self._model.observe(position, features)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return self._draft(context, k, None, 1.0)[0]

    def lookup_span(self, context: Sequence[int], k: int) -> int:
        """How many of the next (up to ``k``) tokens the lookup would copy now, before the
        model drafts any (0: no match it trusts): what ``SpeculationController.choose`` prices."""
        span, matched = self._lookup.lookup(context, k)
        return len(span) if span and matched >= self._min_match else 0

    def propose_sampled(
        self, context: Sequence[int], k: int, generator: torch.Generator, temperature: float
    ) -> tuple[list[int], list[SparseQ]]:
        """As ``propose``, the model's tokens drawn from its q (when it samples; else its
        greedy guess), the copied ones with a one-hot q: the tail's general rule then
        accepts a copied token with probability p(token), as for any greedy draft."""
        return self._draft(context, k, generator, temperature)

    def _draft(
        self,
        context: Sequence[int],
        k: int,
        generator: torch.Generator | None,
        temperature: float,
    ) -> tuple[list[int], list[SparseQ]]:
        tokens = list(context)
        out: list[int] = []
        qs: list[SparseQ] = []
        self.names = []
        sampler = self._model if isinstance(self._model, SamplingProposer) else None
        while len(out) < k:
            span, matched = self._lookup.lookup([*tokens, *out], k - len(out))
            if span and matched >= self._min_match:
                out.extend(span)
                qs.extend(_one_hot(t) for t in span)
                self.names.extend([LOOKUP] * len(span))
                continue
            if generator is not None and sampler is not None:
                guess, q = sampler.propose_sampled([*tokens, *out], 1, generator, temperature)
            else:
                guess = self._model.propose([*tokens, *out], 1)
                q = [_one_hot(t) for t in guess]
            if not guess:
                break
            out.append(guess[0])
            qs.append(q[0])
            self.names.append(self._model.name)
        return out[:k], qs[:k]

    def feedback(self, drafted: int, accepted: int) -> None:
        self._model.feedback(drafted, accepted)
