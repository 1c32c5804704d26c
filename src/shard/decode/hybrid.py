"""A hybrid draft, per position: prompt lookup where it has a long match, a model elsewhere.

Copy spans (an edit of a file, a quoted paragraph, a log line repeated with a new counter)
are what prompt lookup guesses for free and almost always right; ordinary text is what it
guesses nothing of, and where a model draft (the feature-conditioned head) earns its cost.
``HybridProposer`` decides token by token inside one chunk: while the context's suffix lines
up with an earlier span over at least ``min_match`` tokens it copies what followed (the whole
span, up to the chunk's end); elsewhere it asks the model for one token, then looks again.
The model sees every token either way (a model proposer re-feeds what it has not seen), so
its state stays the one the chunk's context gives.

A shorter match goes first too where the request's own text says it should: before each
proposal the driver hands the hybrid what is settled (``settle``: the committed tokens and the
controller's acceptance of the model's guesses so far), and the hybrid scores how often a
short match would have guessed the next settled token. Structured text (a SQL schema, a
config file) lines up one token and continues as before far more often than prose does
(~0.4 against ~0.1), and a head trained on prose keeps missing there; where the scored rate
beats the model's acceptance, short matches are trusted. So are they in a copy task (at
least half of the settled output guessed by trusted matches), where a short match is the
copy realigning after the target's own edit.

Until the request shows whether it copies (``COPY_TASK_AFTER`` settled output tokens), a
short match the hybrid does not trust is not dropped either: ``branch`` hands the driver its
continuation, which rides beside the chunk as a branch (``shard.decode.speculation``) and is
committed where the target's first answer is its first guess. A reply that starts by copying
the prompt (a number, then the directions it came with) gets the copy from its first lap; a
reply in prose pays one more chunk's compute on a few laps (a branch adds no lap of its own).

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

#: The prior of a one-token lookup match's hit rate (what ``bench/hybrid_gate.py`` measured
#: over 18 prompts: 0.10-0.16) and its weight in tokens: the rate the hybrid scores on the
#: request's own settled text starts here.
SHORT_PRIOR = (0.1, 4.0)

#: Settled output tokens before the hybrid judges whether the request is a copy task: one
#: where at least half of its output so far was guessed by a trusted (long) match.
COPY_TASK_AFTER = 8

#: Settled positions a request scores at most at its start (the prompt's last ones), and the
#: context each scoring lookup searches: a bound on the work (~10 ms once a request on a long
#: prompt, then one lookup per settled token), the rate being an estimate anyway.
SCORE_WINDOW = 128
SCORE_CONTEXT = 512


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
        branch: bool = True,
    ) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self._model = model
        self._lookup = lookup if lookup is not None else NGramProposer()
        self._min_match = min_match
        self._branch = branch
        self.names: list[str] = []
        self._model_alpha: float | None = None
        self._scored = 0  # settled positions scored so far
        self._short = [0, 0]  # short matches among them: [tried, right]
        self._output_from: int | None = None  # the first output position (the first settle's end)
        self._copied = [0, 0]  # output positions: [scored, guessed by a trusted match]

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
        model drafts any (0: no match it trusts): what ``SpeculationController.choose`` prices.

        All ``k`` where it trusts the match, as ``propose`` drafts them: a span shorter than
        ``k`` is one the context's end cut short (a list whose next line repeats the last, a
        table's next row), and once it is copied the text lines up again over the span and
        the match before it, longer than the match it trusted, so the draft looks up again
        and goes on copying (``tests/test_hybrid.py``)."""
        span, matched = self._lookup.lookup(context, k)
        return k if span and self._trusts(matched) else 0

    def branch(self, committed: Sequence[int], k: int) -> list[int]:
        """The lookup's continuation of ``committed`` (up to ``k`` tokens) where its match is
        one the hybrid does not trust and the request has not yet settled enough output to
        say whether it copies (``COPY_TASK_AFTER``); else none. The driver sends it as a
        branch beside the chunk that starts at the last committed token (``next_chunk``)."""
        if not self._branch or self._copied[0] >= COPY_TASK_AFTER:
            return []
        span, matched = self._lookup.lookup(committed, k)
        return [] if not span or self._trusts(matched) else list(span)

    def settle(self, committed: Sequence[int], model_alpha: float) -> None:
        """What the request has settled before the next proposal: its committed tokens (the
        prompt and the verified output, no drafts) and the model's acceptance so far (the
        controller's ``model_alpha``). The hybrid scores, on the settled text, how often a
        match shorter than ``min_match`` guessed the next token, and how much of the output
        a trusted match guessed; short matches are trusted where the first beats the model's
        acceptance, or where the request is a copy task (``copy_task``)."""
        end = len(committed) - 1  # positions with a known next token
        if self._output_from is None:
            self._output_from = len(committed)
        start = max(self._scored, end - SCORE_WINDOW, 1)
        for i in range(start, end):
            span, matched = self._lookup.lookup(committed[max(0, i + 1 - SCORE_CONTEXT) : i + 1], 1)
            right = bool(span) and span[0] == committed[i + 1]
            if 0 < matched < self._min_match:
                self._short[0] += 1
                self._short[1] += int(right)
            if i + 1 >= self._output_from:
                self._copied[0] += 1
                self._copied[1] += int(right and matched >= self._min_match)
        self._scored = max(self._scored, end)
        self._model_alpha = model_alpha

    @property
    def copy_task(self) -> bool:
        """At least half of the settled output (``COPY_TASK_AFTER`` tokens or more) was guessed
        by a trusted match: the request copies, and a short match is a copy that realigned
        after the target's own edit (a comma in, a word out) far more often than in prose."""
        scored, copied = self._copied
        return scored >= COPY_TASK_AFTER and 2 * copied >= scored

    @property
    def short_rate(self) -> float:
        """The scored hit rate of matches shorter than ``min_match`` (with its prior)."""
        prior, weight = SHORT_PRIOR
        tried, right = self._short
        return (right + prior * weight) / (tried + weight)

    def _trusts(self, matched: int) -> bool:
        """Whether a lookup match of ``matched`` context tokens goes before the model."""
        if matched >= self._min_match:
            return True
        alpha = self._model_alpha
        if matched < 1 or alpha is None:
            return False
        return self.copy_task or self.short_rate > alpha

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
            if span and self._trusts(matched):
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
