"""The OpenAI response shapes: whole replies, streamed chunks and usage, as plain dicts.

Pure. Each reply and chunk also carries a ``shard`` object on the last piece: the run's tok/s,
drafted and accepted tokens (acceptance) and laps, which the chat page shows per reply;
OpenAI clients keep unknown fields (``model_extra``) and otherwise ignore them.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from shard.messages import RunStats


@attrs.frozen
class ReplyId:
    """What every piece of one reply repeats: its id, kind (chat or not), time and model."""

    id: str
    chat: bool
    created: int
    model: str

    def head(self, *, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def shard_stats(stats: RunStats | None, completion_tokens: int) -> dict[str, Any]:
    """The ``shard`` extension: what the reply cost on the ring (None values when unknown)."""
    if stats is None:
        return {"tokens": completion_tokens, "tok_s": None, "drafted": 0, "accepted": 0}
    acceptance = stats.accepted / stats.drafted if stats.drafted else None
    lap = stats.mean_lap_s if math.isfinite(stats.mean_lap_s) else None
    return {
        "tokens": stats.tokens,
        "tok_s": round(stats.tok_s, 3),
        "seconds": round(stats.seconds, 4),
        "laps": stats.laps,
        "mean_lap_s": None if lap is None else round(lap, 5),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance": None if acceptance is None else round(acceptance, 4),
        "tokens_per_lap": round(stats.tokens_per_lap, 3),
    }


def whole(
    reply: ReplyId, text: str, finish_reason: str, use: dict[str, int], extra: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed reply."""
    if reply.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {**reply.head(chunk=False), "choices": [choice], "usage": use, "shard": extra}


def chunk(
    reply: ReplyId,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: text (or, for chat, the role) and maybe the finish reason."""
    if reply.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
    choice["logprobs"] = None
    body = {**reply.head(chunk=True), "choices": [choice]}
    if with_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the usage chunk
    return body


def usage_chunk(reply: ReplyId, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {**reply.head(chunk=True), "choices": [], "usage": use}


def sse(event: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: JSON`` (or the literal ``[DONE]``) and a blank line."""
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
