"""One validated request (``shard.api.schema.Generation``) as one ring session.

``prepare`` tokenizes (chat through the model's own template) and checks the length against
the context before anything touches the ring; ``run`` generates through the coordinator,
streaming text deltas to ``emit`` as tokens commit, with stop strings applied on the text
(``shard.api.stops``). A stop string ends the session at once: the generation is cancelled,
which ends its session on every stage.

Cancellation: cancelling ``run`` (a client that went away) cancels the coordinator's
``generate``, which ends the session on the ring (``Coordinator.generate``).

Errors: ``ApiError`` — 400 for settings the ring refuses, 413 for a prompt over the byte
bound (``check_size``, before tokenizing) or one that leaves no room in the context, 503 when
the ring fails the request (``committed`` tells how far it got), 500 when the coordinator
failed it (``RequestFailed``, logged there).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

import attrs
import trio

from shard.api.errors import ApiError, bad_param
from shard.api.schema import Generation
from shard.api.stops import StopText
from shard.coordinator.coordinator import Coordinator, RingError
from shard.coordinator.events import RequestFailed
from shard.decode.state import BadRequest
from shard.messages import RunStats, Sampling
from shard.model.tokenizer import StreamDecoder, Tokenizer, TokenizerError

Emit = Callable[[str], Awaitable[None]]


@attrs.frozen
class Prepared:
    """A request ready for the ring: its prompt ids, token budget and sampling."""

    generation: Generation
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling


@attrs.frozen
class Outcome:
    """A finished reply (its text went to ``emit``): why it ended ("stop" or "length") and
    what it cost."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RunStats | None


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


def prepare(
    generation: Generation,
    tokenizer: Tokenizer,
    *,
    max_len: int,
    seed: Callable[[], int] = lambda: secrets.randbits(63),
) -> Prepared:
    """Tokenize and size ``generation``. Errors: ``ApiError`` (400, 413)."""
    ids = _prompt_ids(generation, tokenizer)
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


def _prompt_ids(generation: Generation, tokenizer: Tokenizer) -> list[int]:
    if generation.chat:
        messages = [{"role": m.role, "content": m.content} for m in generation.messages]
        try:
            return tokenizer.encode(tokenizer.apply_chat(messages))
        except TokenizerError as exc:
            raise bad_param("messages", str(exc)) from None
    if isinstance(generation.prompt, tuple):
        vocab = tokenizer.vocab_size
        if any(t >= vocab for t in generation.prompt):
            raise bad_param("prompt", f"token ids must be below the vocabulary size {vocab}")
        return list(generation.prompt)
    return tokenizer.encode(generation.prompt)


async def run(
    coordinator: Coordinator, tokenizer: Tokenizer, request: Prepared, emit: Emit
) -> Outcome:
    """Generate ``request`` on the ring, sending each safe piece of text to ``emit``."""
    decoder = StreamDecoder(tokenizer)
    stops = StopText(request.generation.stop)
    count = 0

    async def on_tokens(ids: list[int]) -> None:
        nonlocal count
        text = ""
        for token in ids:
            count += 1
            text += stops.push(decoder.push(token))
            if stops.hit:
                break
        if text:
            await emit(text)
        if stops.hit:
            scope.cancel()  # a stop string ends the session now, on every stage

    stats = None
    finish = "stop"
    with trio.CancelScope() as scope:
        try:
            completion = await coordinator.generate(
                request.prompt_ids,
                max_tokens=request.max_tokens,
                sampling=request.sampling,
                on_tokens=on_tokens,
            )
        except BadRequest as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        except RequestFailed as exc:  # logged at the coordinator, with its traceback
            raise ApiError(500, str(exc), code="internal_error") from None
        except RingError as exc:
            raise RingFailed(
                f"the ring failed the request after {count} tokens: {exc}", count
            ) from None
        stats, finish = completion.stats, completion.finish_reason
    if not stops.hit:
        tail = stops.push(decoder.flush()) + stops.flush()
        if tail:
            await emit(tail)
    return Outcome(
        finish_reason="stop" if stops.hit else finish,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=count,
        stats=stats,
    )
