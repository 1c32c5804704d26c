"""Text in, text out: the client-facing side of the coordinator.

Turns a ``GenerateRequest`` into token ids (with the model's own chat template when asked),
runs it on the ``Coordinator``, and streams ``TokensOut`` as tokens are committed, ending with
one ``GenerateDone`` — ``finish_reason="error"`` with the committed text when the ring fails,
never a silent stop.

Every number of a request is checked against the one table of bounds
(``shard.messages.bounds``) as it arrives; a prompt is bounded in bytes before it is
tokenized (``limits.max_prompt_bytes``) and in tokens after (``limits.max_len``, by
``DecodeState.start``). Whatever fails on a request's path ends that request alone, with a
``GenerateDone`` of ``finish_reason="error"`` saying why (logged once); the node serves on.

Tokenizing and the final decode take time proportional to the text, so they run in a worker
thread behind their own ``CapacityLimiter`` (never queued behind a forward pass): the event
loop keeps reading heartbeats meanwhile, and a 900 KB prompt cannot make the scheduler think
a stage died.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.compute import offload
from shard.coordinator.coordinator import Completion, Coordinator, RingError
from shard.coordinator.events import RequestFailed
from shard.decode.control import SpeculationConfig
from shard.decode.state import BadRequest
from shard.messages import GenerateDone, GenerateRequest, Message, RunStats, TokensOut
from shard.messages.bounds import OutOfBounds
from shard.messages.bounds import check_request as check_bounds
from shard.model.tokenizer import StreamDecoder, Tokenizer, TokenizerError

Emit = Callable[[Message], Awaitable[None]]

log = logging.getLogger(__name__)


class PromptTooLarge(BadRequest):
    """The prompt's text is larger than ``limits.max_prompt_bytes``; refused untokenized."""


def check_request(request: GenerateRequest, max_prompt_bytes: int) -> None:
    """Refuse a wire client's request whose numbers are out of bounds
    (``shard.messages.bounds``) or whose prompt is over ``max_prompt_bytes``, before any
    tokenizing is spent on it. Errors: ``BadRequest`` (``PromptTooLarge``)."""
    try:
        check_bounds(request)
    except OutOfBounds as exc:
        raise BadRequest(f"{exc}; the request is refused, nothing ran") from None
    check_prompt_size(request, max_prompt_bytes)


def check_prompt_size(request: GenerateRequest, max_bytes: int) -> None:
    """Refuse a prompt over ``max_bytes`` of UTF-8 before any tokenizing is spent on it."""
    size = len(request.prompt.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise PromptTooLarge(
            f"the prompt is {size} bytes, limits.max_prompt_bytes is {max_bytes}; "
            "shorten it or raise the limit in the swarm spec"
        )


def prompt_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """The request's prompt as ids, through the chat template when ``chat`` is set."""
    if request.chat:
        text = tokenizer.apply_chat([{"role": "user", "content": request.prompt}])
        return tokenizer.encode(text)
    return tokenizer.encode(request.prompt)


async def complete(
    coordinator: Coordinator,
    tokenizer: Tokenizer,
    request: GenerateRequest,
    emit: Emit,
    *,
    limiter: trio.CapacityLimiter | None = None,
) -> GenerateDone:
    """Serve one request, streaming its tokens through ``emit``; returns (and emits) the end.

    ``limiter`` bounds the threads tokenizing at once (one per coordinator: ``nodes``).
    """
    text_limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
    stream = StreamDecoder(tokenizer)
    committed: list[int] = []

    async def on_tokens(ids: list[int]) -> None:
        committed.extend(ids)
        text = "".join(stream.push(t) for t in ids)
        await emit(TokensOut(request=request.request, token_ids=tuple(ids), text=text))

    try:
        check_request(request, coordinator.limits.max_prompt_bytes)
        ids = await offload.run_sync(prompt_ids, tokenizer, request, limiter=text_limiter)
        completion = await coordinator.generate(
            ids,
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            on_tokens=on_tokens,
            receipt=request.receipt,
            speculation=request_speculation(coordinator, request),
            ignore_eos=request.ignore_eos,
        )
    except (RingError, BadRequest, TokenizerError) as exc:
        text = await offload.run_sync(tokenizer.decode, committed, limiter=text_limiter)
        done = error_message(request.request, exc, committed, text)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise  # emit's: the client's connection is gone, nothing left to answer
    except Exception as exc:  # this request's alone: its client hears why, the node serves on
        log.error("request %d failed at the coordinator: %r", request.request, exc, exc_info=exc)
        done = error_message(request.request, RequestFailed(repr(exc)), committed, "")
    else:
        ids = list(completion.token_ids)
        text = await offload.run_sync(tokenizer.decode, ids, limiter=text_limiter)
        done = done_message(request.request, completion, text)
    await emit(done)
    return done


def request_speculation(
    coordinator: Coordinator, request: GenerateRequest
) -> SpeculationConfig | None:
    """The request's own K / depth over the swarm's policy (None: the policy as is)."""
    if request.k < 0 and request.depth <= 0:
        return None
    policy = coordinator.speculation
    k = policy.k if request.k < 0 else min(request.k, policy.k_max)
    depth = policy.depth if request.depth <= 0 else min(request.depth, policy.depth_max)
    return attrs.evolve(policy, k=k, depth=depth)


def done_message(request: int, completion: Completion, text: str) -> GenerateDone:
    """The client-facing end of a request (with its signed receipt when one was asked for)."""
    return GenerateDone(
        request=request,
        token_ids=completion.token_ids,
        text=text,
        finish_reason=completion.finish_reason,
        stats=completion.stats,
        receipt=completion.receipt,
    )


def error_message(
    request: int, exc: Exception, committed: Sequence[int], text: str
) -> GenerateDone:
    """A request that could not finish: ``finish_reason="error"`` and the committed text."""
    return GenerateDone(
        request=request,
        token_ids=tuple(committed),
        text=text,
        finish_reason="error",
        stats=RunStats(
            tokens=len(committed),
            seconds=0.0,
            tok_s=0.0,
            prefill_s=0.0,
            laps=0,
            mean_lap_s=math.nan,
        ),
        error=str(exc),
    )


def ring_unready(coordinator: Coordinator) -> str | None:
    """Why the ring cannot take a new request now (lost, or under repair), or None when it can.

    The HTTP API answers 503 with this reason, and ``/health`` reports it."""
    down = coordinator.ring_down
    if down is not None:
        return f"the ring is down: {down}"
    if coordinator.recovering:
        return "the ring is being repaired (a stage failed); retry shortly"
    return None
