"""Text in, text out: the client-facing side of the coordinator.

Turns a ``GenerateRequest`` into token ids (with the model's own chat template when asked),
runs it on the ``Coordinator``, and streams ``TokensOut`` as tokens are committed, ending with
one ``GenerateDone`` — ``finish_reason="error"`` with the committed text when the ring fails,
never a silent stop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from shard.coordinator import Coordinator, RingError, done_message, error_message
from shard.decoding import BadRequest
from shard.messages import GenerateDone, GenerateRequest, Message, TokensOut
from shard.model.tokenizer import StreamDecoder, Tokenizer

Emit = Callable[[Message], Awaitable[None]]


def prompt_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """The request's prompt as ids, through the chat template when ``chat`` is set."""
    if request.chat:
        text = tokenizer.apply_chat([{"role": "user", "content": request.prompt}])
        return tokenizer.encode(text)
    return tokenizer.encode(request.prompt)


async def complete(
    coordinator: Coordinator, tokenizer: Tokenizer, request: GenerateRequest, emit: Emit
) -> GenerateDone:
    """Serve one request, streaming its tokens through ``emit``; returns (and emits) the end."""
    stream = StreamDecoder(tokenizer)
    committed: list[int] = []

    async def on_tokens(ids: list[int]) -> None:
        committed.extend(ids)
        text = "".join(stream.push(t) for t in ids)
        await emit(TokensOut(request=request.request, token_ids=tuple(ids), text=text))

    try:
        ids = prompt_ids(tokenizer, request)
        completion = await coordinator.generate(
            ids,
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            on_tokens=on_tokens,
        )
    except (RingError, BadRequest) as exc:
        done = error_message(request.request, exc, committed, tokenizer.decode(committed))
    else:
        text = tokenizer.decode(completion.token_ids)
        done = done_message(request.request, completion, text)
    await emit(done)
    return done
