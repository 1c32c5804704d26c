"""The one table of bounds on every number a generation request carries.

A request enters a swarm three ways: the HTTP API (``shard.api.schema``), the CLI
(``shard.cli.args.base``) and a wire client's ``GenerateRequest`` at the coordinator's client
port (``shard.coordinator.service``). Each checks its numbers against ``BOUNDS`` as they
enter, so a value the wire cannot carry (msgpack ints are 64-bit: ``shard.wire.checks``) or
the model cannot use never reaches the ring. Each entry point translates ``OutOfBounds`` into
its own refusal: a 400 naming the parameter, an argparse error, a ``GenerateDone`` with
``finish_reason="error"``.

Integers are ``int`` (never ``bool``); numbers are ``int`` or ``float`` and finite, so NaN,
infinities and JSON's ``1e309`` are refused by every bound. The limits:

- ``max_tokens`` and ``top_k`` are counts a model indexes with 32-bit positions; no context
  holds more (``top_k`` past the vocabulary keeps every token);
- ``seed`` is any signed 64-bit integer (the wire's slot; OpenAI documents the same range);
- ``temperature`` stops at 100 (past it every token is equally likely to 7 digits); 0 is
  greedy; ``top_p`` is a probability mass in (0, 1];
- ``k`` and ``depth`` are one request's speculation override (-1 and 0: the swarm's policy),
  capped again by the swarm's own ``k_max`` and ``depth_max``;
- ``stops`` and ``stop_chars`` bound the API's stop strings (how many, how long each).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

import attrs

from shard.messages.client import GenerateRequest

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
#: The longest count a request may ask for: a position index of any model fits in 32 bits.
MAX_COUNT: Final = (1 << 31) - 1


class OutOfBounds(ValueError):
    """``field`` holds a value outside its bound (or of the wrong type); the message says
    which values are allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@attrs.frozen
class Bound:
    """The values one field may hold: ``[low, high]`` (``(low, high]`` when ``open_low``),
    integers only when ``integer``."""

    low: int | float
    high: int | float
    integer: bool = True
    open_low: bool = False

    def describe(self) -> str:
        """``an integer in [1, 2147483647]`` / ``a finite number in (0, 1]``."""
        bracket = "(" if self.open_low else "["
        if self.integer:
            return f"an integer in {bracket}{self.low}, {self.high}]"
        return f"a finite number in {bracket}{self.low:g}, {self.high:g}]"

    def holds(self, value: object) -> bool:
        if isinstance(value, bool):
            return False
        if self.integer:
            if not isinstance(value, int):
                return False
        elif not isinstance(value, int | float) or not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        return above and value <= self.high

    def check(self, field: str, value: object) -> None:
        """Errors: ``OutOfBounds`` when ``value`` is not within this bound."""
        if not self.holds(value):
            raise OutOfBounds(field, f"must be {self.describe()}, got {_show(value)}")


#: Every numeric field of a request, by name (the API's and the CLI's names are the same).
BOUNDS: Final[Mapping[str, Bound]] = {
    "max_tokens": Bound(1, MAX_COUNT),
    "top_k": Bound(0, MAX_COUNT),
    "seed": Bound(INT64_MIN, INT64_MAX),
    "temperature": Bound(0.0, 100.0, integer=False),
    "top_p": Bound(0.0, 1.0, integer=False, open_low=True),
    "k": Bound(-1, 64),
    "depth": Bound(0, 64),
    "request": Bound(0, INT64_MAX),
    "stops": Bound(0, 16),
    "stop_chars": Bound(1, 256),
}


def check(field: str, value: object) -> None:
    """Check ``value`` against ``BOUNDS[field]``. Errors: ``OutOfBounds``."""
    BOUNDS[field].check(field, value)


def check_request(request: GenerateRequest) -> None:
    """Check every number of a wire client's request. Errors: ``OutOfBounds``."""
    check("request", request.request)
    check("max_tokens", request.max_tokens)
    check("k", request.k)
    check("depth", request.depth)
    sampling = request.sampling
    check("temperature", sampling.temperature)
    check("top_p", sampling.top_p)
    check("top_k", sampling.top_k)
    check("seed", sampling.seed)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = [
    "BOUNDS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_COUNT",
    "Bound",
    "OutOfBounds",
    "check",
    "check_request",
]
