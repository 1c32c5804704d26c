"""Bookkeeping shared by every decoding loop: what is committed, when a request stops.

Pure and synchronous: the ring's coordinator and the single-process reference both feed it
the target's token ids and get back what to emit, so they stop at exactly the same place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from shard.messages import Sampling


class BadRequest(ValueError):
    """A request that cannot be served as asked; the message says how to fix it."""


class RequestTooLong(BadRequest):
    """The prompt plus ``max_tokens`` does not fit the session's KV length."""


#: Below this a temperature means greedy: at 1e-4 a draw already equals the argmax unless two
#: logits are within ~1e-3 of each other, and dividing by much less overflows float32.
MIN_TEMPERATURE = 1e-4
#: The largest temperature served: far past it every distribution is uniform in float32.
MAX_TEMPERATURE = 1e4


def is_greedy(sampling: Sampling) -> bool:
    """Whether ``sampling`` means argmax: a temperature below ``MIN_TEMPERATURE`` (or NaN)."""
    return not sampling.temperature >= MIN_TEMPERATURE


def check_sampling(sampling: Sampling) -> None:
    """Refuse sampling settings that have no meaning (they would poison the tail's draws).

    Run where a request enters (the coordinator) and where a session opens (every stage).
    A temperature in [0, ``MIN_TEMPERATURE``) is valid and means greedy (``is_greedy``).
    """
    temperature = sampling.temperature
    if not (math.isfinite(temperature) and 0 <= temperature <= MAX_TEMPERATURE):
        raise BadRequest(
            f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] "
            f"(below {MIN_TEMPERATURE:g} is greedy), got {temperature}"
        )
    if not 0 < sampling.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise BadRequest(f"top_k must be >= 0, got {sampling.top_k}")


@attrs.define
class DecodeState:
    """Committed output of one request. ``commit`` takes target ids in order.

    A request stops at the first end-of-sequence id (which is not part of the output) or when
    ``max_tokens`` ids are committed. Ids arriving after the stop are ignored.
    """

    prompt_len: int
    max_tokens: int
    eos_ids: frozenset[int]
    output: list[int] = attrs.field(factory=list)
    finish_reason: str | None = None

    @property
    def positions(self) -> int:
        """Positions this request can fill: its prompt and every token it may commit (the
        KV a session needs; ``start`` checked that it fits the session length)."""
        return self.prompt_len + self.max_tokens

    @classmethod
    def start(
        cls, prompt_len: int, max_tokens: int, eos_ids: Iterable[int], *, max_len: int
    ) -> DecodeState:
        if prompt_len < 1:
            raise BadRequest("the prompt is empty: nothing to condition on")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_len + max_tokens > max_len:
            raise RequestTooLong(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the session "
                f"length {max_len}; shorten the prompt, lower max_tokens or raise limits.max_len"
            )
        return cls(prompt_len=prompt_len, max_tokens=max_tokens, eos_ids=frozenset(eos_ids))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Absolute position of the next token to be fed (== tokens in the KV so far + 1)."""
        return self.prompt_len + len(self.output)

    def commit(self, ids: Iterable[int]) -> list[int]:
        """Commit target ids in order; returns those that became output."""
        emitted: list[int] = []
        for token in ids:
            if self.done:
                break
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            self.output.append(token)
            emitted.append(token)
            if len(self.output) >= self.max_tokens:
                self.finish_reason = "length"
        return emitted
