"""``TailProposer``: the coordinator's side of drafts the tail makes — a checkpoint's MTP
block run at the tail after the last layer (``shard.stage.tail_drafts``), its guesses
returned with each verdict (``Verdict.drafts``).

The proposer runs nothing. Each verdict's drafts guess the stream positions right after
its last committed id (``take``); ``propose`` hands out the part of that guess a context
has not used yet, as long as what the context holds past the verdict is the guess itself
(chunks pipelined on it). Any other context — a rejection the next verdict has not answered
yet, a guess the tail could not make — gets no draft: the coordinator sends a plain step, and
the next verdict brings a new guess.

The guesses come from a peer: ``take`` keeps only a guess of at most the asked count, every
id in the vocabulary, and says why it dropped one. Drafts only ever cost a lap; the verdict's
own ids decide what is committed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard.decode.head.mtp import MTP_WINDOW
from shard.messages import MAX_TAIL_DRAFTS

__all__ = ["TailProposer", "tail_draft_count"]


#: The longest chain a session asks the tail for: the block chains on its own outputs, and a
#: chain this long rarely holds to its end, while each link costs the tail one more step.
_CHAIN_MOST = 16


def tail_draft_count(k_max: int, depth_max: int) -> int:
    """How many drafts a session asks the tail for: enough to fill ``depth_max`` chunks of
    ``k_max`` drafts each, with the guess of each chunk's bonus token between them, at most
    16 (``_CHAIN_MOST``)."""
    return max(1, min(_CHAIN_MOST, MAX_TAIL_DRAFTS, (k_max + 1) * depth_max - 1))


class TailProposer:
    """Drafts from the tail's latest guess (``take``); see the module docstring."""

    name = "mtp"
    computes = False
    features = 0
    feature_layers: tuple[int, ...] = ()
    window = MTP_WINDOW  # a prompt chunk's last ids the tail reads (``Prefill.tail_ids``)

    def __init__(self, count: int, vocab_size: int) -> None:
        if not 1 <= count <= MAX_TAIL_DRAFTS:
            raise ValueError(f"count {count} not in [1, {MAX_TAIL_DRAFTS}]")
        self.tail_drafts = count
        self._vocab = vocab_size
        self._end = -1  # the guess is for stream positions [_end, _end + len(_guess))
        self._guess: list[int] = []

    def take(self, end: int, drafts: Sequence[int]) -> str | None:
        """The tail's guess for the stream positions from ``end`` (the stream's length once
        the verdict is folded in). Returns why a malformed guess was dropped, else None."""
        self._end, self._guess = end, []
        if len(drafts) > self.tail_drafts:
            return f"{len(drafts)} drafts where the session asked for {self.tail_drafts}"
        if any(not 0 <= t < self._vocab for t in drafts):
            return f"a draft id outside the vocabulary [0, {self._vocab})"
        self._guess = [int(t) for t in drafts]
        return None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        used = len(context) - self._end
        if self._end < 0 or used < 0 or list(context[self._end :]) != self._guess[:used]:
            return []
        return self._guess[used : used + k]

    def feedback(self, drafted: int, accepted: int) -> None:
        return None

    def observe(self, position: int, features: torch.Tensor) -> None:
        return None  # it asks for no features: the tail reads them itself
