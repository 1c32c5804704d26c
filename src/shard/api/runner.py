"""One validated request (``shard.api.schema.Generation``) as one ring session.

Both halves go through the coordinator's one text adapter (``shard.coordinator.text``), as
the wire client's requests do: ``prepare`` tokenizes there (chat through the model's own
template, off the event loop) and checks the length against the context before anything
touches the ring; ``text_request`` is what the app then streams (``TextAdapter.stream``: the
app reads each text delta as tokens commit, with stop strings applied on the text,
``shard.coordinator.stops``), and ``finished`` turns how the stream ended into an
``Outcome`` or the error to answer. A stop string ends the session at once: the generation is
cancelled, which ends its session on every stage.

Cancellation: cancelling the app's task (a client that went away) cancels the request, which
ends the session on the ring (``TextAdapter.stream``).

Errors: ``ApiError`` — 400 for settings the ring refuses, 413 for a prompt over the byte
bound (``check_size``, before tokenizing) or one that leaves no room in the context, 503 when
the ring fails the request (``committed`` tells how far it got), 500 when the coordinator
failed it (``RequestFailed``, logged there).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import attrs

from shard.api.errors import ApiError, bad_param
from shard.api.schema import Generation
from shard.coordinator.checkpoint import RequestCheckpoint
from shard.coordinator.coordinator import RingError
from shard.coordinator.events import RequestFailed
from shard.coordinator.text import Prompt, TextAdapter, TextDone, TextRequest
from shard.decode.state import BadRequest
from shard.messages import RunStats, Sampling
from shard.model.tokenizer import TokenizerError


@attrs.frozen
class Prepared:
    """A request ready for the ring: its prompt ids, token budget and sampling."""

    generation: Generation
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling


@attrs.frozen
class Outcome:
    """A finished reply: why it ended ("stop" or "length"), what it cost, and the text the
    decoder held back until the end (``tail``: send it after the streamed pieces)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RunStats | None
    tail: str = ""


class RingFailed(ApiError):
    """The ring could not finish the request; ``completion_tokens`` were committed first."""

    def __init__(self, message: str, completion_tokens: int) -> None:
        super().__init__(503, message, code="ring_failed", headers=(("retry-after", "1"),))
        self.completion_tokens = completion_tokens


def check_size(generation: Generation, max_bytes: int) -> None:
    """Refuse a prompt (or conversation) over ``max_bytes`` of UTF-8 before any tokenizing is
    spent on it: the bound the wire client has (``limits.max_prompt_bytes``). Errors:
    ``ApiError`` (413)."""
    if generation.chat:
        size = sum(len(m.content.encode()) for m in generation.messages)
    elif isinstance(generation.prompt, str):
        size = len(generation.prompt.encode())
    else:
        return  # token ids: their count is checked against the context, nothing to tokenize
    if size > max_bytes:
        raise ApiError(
            413,
            f"the prompt is {size} bytes of text, over the {max_bytes} this swarm tokenizes "
            "(limits.max_prompt_bytes); shorten it",
            param="messages" if generation.chat else "prompt",
            code="context_length_exceeded",
        )


async def prepare(
    generation: Generation,
    text: TextAdapter,
    *,
    max_len: int,
    seed: Callable[[], int] = lambda: secrets.randbits(63),
) -> Prepared:
    """Tokenize (in the adapter's worker thread) and size ``generation``. Errors:
    ``ApiError`` (400, 413)."""
    try:
        ids = await text.encode(_prompt(generation))
    except TokenizerError as exc:  # the chat template refused the conversation
        raise bad_param("messages" if generation.chat else "prompt", str(exc)) from None
    except BadRequest as exc:  # token ids outside the vocabulary
        raise bad_param("prompt", str(exc)) from None
    if len(ids) >= max_len:
        raise ApiError(
            413,
            f"the prompt is {len(ids)} tokens but the context holds {max_len} "
            "(prompt plus reply); shorten the prompt",
            param="messages" if generation.chat else "prompt",
            code="context_length_exceeded",
        )
    room = max_len - len(ids)
    max_tokens = generation.max_tokens if generation.max_tokens is not None else room
    if max_tokens > room:
        raise bad_param(
            "max_tokens",
            f"{max_tokens} tokens do not fit: the prompt is {len(ids)} tokens and the context "
            f"{max_len}; ask for at most {room}",
            code="context_length_exceeded",
        )
    sampling = Sampling(
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        seed=generation.seed if generation.seed is not None else seed(),
    )
    return Prepared(generation, tuple(ids), max_tokens, sampling)


def _prompt(generation: Generation) -> Prompt:
    if generation.chat:
        return [{"role": m.role, "content": m.content} for m in generation.messages]
    return generation.prompt


def text_request(
    request: Prepared,
    key: str | None = None,
    resume: RequestCheckpoint | None = None,
    skip: int = 0,
) -> TextRequest:
    """What the coordinator's text adapter runs for ``request`` (its stop strings too).

    ``key`` checkpoints it under that resume key; ``resume`` goes on from a checkpoint
    (a standby's takeover), and ``skip`` output tokens the client has are not given again
    (``shard.api.resume``)."""
    return TextRequest(
        request.prompt_ids,
        request.max_tokens,
        request.sampling,
        stop=tuple(request.generation.stop),
        request_id=key,
        resume=resume,
        skip=skip,
    )


def finished(request: Prepared, end: TextDone) -> Outcome:
    """How a reply whose ``TextStream`` was read out ends: an ``Outcome``, or the error it
    is answered with (``ApiError``: 400, 500; ``RingFailed``: 503)."""
    count = len(end.token_ids)
    if isinstance(end.error, BadRequest):
        raise ApiError(400, str(end.error), code="invalid_value")
    if isinstance(end.error, RequestFailed):  # logged at the coordinator, with its traceback
        raise ApiError(500, str(end.error), code="internal_error")
    if isinstance(end.error, RingError):
        raise RingFailed(f"the ring failed the request after {count} tokens: {end.error}", count)
    if end.error is not None:  # CallerLeft: the app never closes a stream early
        raise ApiError(500, str(end.error), code="internal_error")
    return Outcome(
        finish_reason=end.finish_reason,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=count,
        stats=end.stats,
        tail=end.tail,
    )
