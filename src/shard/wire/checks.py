"""Semantic checks on a whole message, run by ``encode`` before packing and ``decode`` after
structuring, so a sender learns of a bad message at once and a receiver never acts on one.

Types are already right by then (the converter is strict); these rules are about values:
counters and positions are non-negative, token ids are non-negative int64, every sequence is
within ``max_items``, tensors match their shape, and a compute chunk carries exactly one of ids
and hidden states. Floats are left alone: NaN in a timing field is a fact, not an attack.
"""

from __future__ import annotations

from typing import Any

import attrs

from shard.messages import Prefill, Tensor, Verify
from shard.wire.errors import WireError
from shard.wire.limits import INT64_MAX, INT64_MIN, WireLimits
from shard.wire.tensors import check_tensor

#: Int fields (in any message or nested record) that count or index and so must be >= 0.
NON_NEGATIVE_FIELDS = frozenset(
    {
        "session",
        "epoch",
        "seq",
        "start",
        "max_len",
        "accepted",
        "top_k",
        "protocol",
        "request",
        "max_tokens",
        "tokens",
        "chunks",
        "laps",
        "batch_rows",
        "features",  # OpenSession's window (a Verdict's features are a tensor, not checked here)
        "features_start",
        # receipts (shard.messages.receipts)
        "at",
        "chunks_in",
        "chunks_out",
        "n_layers",
        "signed_at",
        "at_token",
        # a standby coordinator (shard.messages.follow, GenerateRequest.have)
        "offset",
        "have",
        "generation",
    }
)

#: Sequence fields holding token ids: each id is in [0, INT64_MAX].
TOKEN_FIELDS = frozenset({"ids", "draft", "target_ids", "token_ids", "output_ids"})


def check_message(msg: object, limits: WireLimits) -> list[Tensor]:
    """Raise ``WireError`` if ``msg`` breaks a value rule; return its tensors in field order.

    The returned order is the order in which the codec lays out tensor payloads.
    """
    tensors: list[Tensor] = []
    _check_record(msg, type(msg).__name__, limits, tensors)
    if isinstance(msg, Prefill | Verify) and (len(msg.ids) > 0) == (msg.hidden is not None):
        raise WireError(
            f"message: {type(msg).__name__} must carry exactly one of ids and hidden "
            f"(ids has {len(msg.ids)}, hidden is {'set' if msg.hidden is not None else 'None'})"
        )
    return tensors


def _check_record(record: Any, path: str, limits: WireLimits, tensors: list[Tensor]) -> None:
    for field in attrs.fields(type(record)):
        _check_value(
            getattr(record, field.name), field.name, f"{path}.{field.name}", limits, tensors
        )


def _check_value(
    value: object, name: str, path: str, limits: WireLimits, tensors: list[Tensor]
) -> None:
    if isinstance(value, bool | float | str) or value is None:
        return
    if isinstance(value, int):
        low = 0 if name in NON_NEGATIVE_FIELDS else INT64_MIN
        if not low <= value <= INT64_MAX:
            raise WireError(f"message: {path} = {value} is outside [{low}, {INT64_MAX}]")
    elif isinstance(value, Tensor):
        check_tensor(len(tensors), value, limits)
        tensors.append(value)
    elif isinstance(value, tuple):
        _check_sequence(value, name, path, limits, tensors)
    elif attrs.has(type(value)):
        _check_record(value, path, limits, tensors)
    else:
        raise WireError(f"message: {path} has unsupported type {type(value).__name__}")


def _check_sequence(
    items: tuple[object, ...], name: str, path: str, limits: WireLimits, tensors: list[Tensor]
) -> None:
    if len(items) > limits.max_items:
        raise WireError(f"message: {path} has {len(items)} items, max_items is {limits.max_items}")
    if name in TOKEN_FIELDS:
        for index, token in enumerate(items):
            if type(token) is not int or not 0 <= token <= INT64_MAX:
                raise WireError(f"message: {path}[{index}] = {token!r} is not a token id")
        return
    for index, item in enumerate(items):
        _check_value(item, name, f"{path}[{index}]", limits, tensors)
