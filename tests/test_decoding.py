"""Commit bookkeeping shared by the ring and the reference."""

from __future__ import annotations

import math

import pytest

from shard.decode.state import (
    MIN_TEMPERATURE,
    BadRequest,
    DecodeState,
    RequestTooLong,
    check_sampling,
    is_greedy,
)
from shard.messages import Sampling


def test_stops_at_eos_without_emitting_it() -> None:
    """An end-of-sequence id ends the request and is not part of the output."""
    state = DecodeState.start(3, 10, [0], max_len=64)
    assert state.commit([5, 6, 0, 7]) == [5, 6]
    assert state.finish_reason == "stop"
    assert state.output == [5, 6]


def test_stops_at_max_tokens() -> None:
    """Exactly max_tokens ids are committed; later ones are ignored."""
    state = DecodeState.start(3, 2, [0], max_len=64)
    assert state.commit([5, 6, 7]) == [5, 6]
    assert state.finish_reason == "length"
    assert state.commit([8]) == []


def test_position_tracks_the_next_input() -> None:
    """position is the prompt length plus committed tokens."""
    state = DecodeState.start(4, 8, [], max_len=64)
    state.commit([1, 2])
    assert state.position == 6


def test_refuses_requests_that_do_not_fit() -> None:
    """Too long, empty prompt, or no tokens asked: refused with a fix in the message."""
    with pytest.raises(RequestTooLong, match="max_len"):
        DecodeState.start(60, 10, [], max_len=64)
    with pytest.raises(BadRequest, match="empty"):
        DecodeState.start(0, 10, [], max_len=64)
    with pytest.raises(BadRequest, match="max_tokens"):
        DecodeState.start(3, 0, [], max_len=64)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=-1.0),
        Sampling(temperature=math.nan),
        Sampling(temperature=math.inf),
        Sampling(temperature=-math.inf),
        Sampling(temperature=1e5),
        Sampling(temperature=1.0, top_p=math.nan),
        Sampling(temperature=1.0, top_p=-1e-300),
        Sampling(temperature=1.0, top_p=0.0),
        Sampling(temperature=1.0, top_p=1.5),
        Sampling(temperature=1.0, top_k=-1),
    ],
)
def test_meaningless_sampling_is_refused(sampling: Sampling) -> None:
    """Sampling settings that would poison the tail's draws are a BadRequest."""
    with pytest.raises(BadRequest):
        check_sampling(sampling)


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-40, 9.9e-5])
def test_tiny_temperatures_are_accepted_as_greedy(temperature: float) -> None:
    """A temperature in [0, MIN_TEMPERATURE) is a valid request and means greedy."""
    sampling = Sampling(temperature=temperature, top_p=5e-324)
    check_sampling(sampling)
    assert is_greedy(sampling)
    assert not is_greedy(Sampling(temperature=MIN_TEMPERATURE))
