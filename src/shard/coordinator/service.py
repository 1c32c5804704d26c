"""The wire client's side of the coordinator: a ``GenerateRequest`` in, ``TokensOut`` and one
``GenerateDone`` out.

``complete`` checks the request, has the coordinator's ``TextAdapter``
(``shard.coordinator.text``, the one text adapter, which the HTTP API uses too) tokenize it
(with the model's own chat template when asked) and run it, and streams one ``TokensOut`` per
committed batch, ending with one ``GenerateDone`` — ``finish_reason="error"`` with the
committed text when the ring fails, never a silent stop.

Every number of a request is checked against the one table of bounds
(``shard.messages.bounds``) as it arrives; a prompt is bounded in bytes before it is
tokenized (``limits.max_prompt_bytes``) and in tokens after (``limits.max_len``, by
``DecodeState.start``). Whatever fails on a request's path ends that request alone, with a
``GenerateDone`` of ``finish_reason="error"`` saying why (logged once); the node serves on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from shard.coordinator.checkpoint import CheckpointError, CheckpointStore, checkpoint_name
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.events import RequestFailed
from shard.coordinator.text import Prompt, TextAdapter, TextDone, TextRequest, encode_prompt
from shard.decode.control import SpeculationConfig
from shard.decode.state import BadRequest
from shard.messages import GenerateDone, GenerateRequest, Message, RunStats, TokensOut
from shard.messages.bounds import OutOfBounds
from shard.messages.bounds import check_request as check_bounds
from shard.model.tokenizer import Tokenizer, TokenizerError

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


def request_prompt(request: GenerateRequest) -> Prompt:
    """What a wire request asks to be tokenized: its text, or with ``chat`` one user turn
    through the model's own chat template."""
    return [{"role": "user", "content": request.prompt}] if request.chat else request.prompt


def prompt_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """The request's prompt as ids, tokenized here (the local ``shard generate --local``
    and offline tools; a coordinator tokenizes off its event loop: ``TextAdapter``)."""
    return encode_prompt(tokenizer, request_prompt(request))


async def complete(
    coordinator: Coordinator,
    text: TextAdapter,
    request: GenerateRequest,
    emit: Emit,
    store: CheckpointStore | None = None,
) -> GenerateDone:
    """Serve one request, streaming its tokens through ``emit``; returns (and emits) the end.

    ``store``: the coordinator's checkpoints. A request with a ``resume`` key is checkpointed
    under it; one whose key names a checkpoint (a standby that took over, or the same
    coordinator after the client's link broke) goes on from it, and ``have`` tokens are not
    sent again (docs/failover.md, "Standby coordinator").

    Errors: only ``emit``'s (the client's connection is gone: nothing left to answer)."""
    try:
        check_request(request, coordinator.limits.max_prompt_bytes)
        ids = await text.encode(request_prompt(request))
        done = await _run(coordinator, text, request, ids, emit, store)
    except (BadRequest, TokenizerError, CheckpointError) as exc:
        done = error_message(request.request, exc, (), "")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise  # emit's: the client's connection is gone, nothing left to answer
    except Exception as exc:  # this request's alone: its client hears why, the node serves on
        log.error("request %d failed at the coordinator: %r", request.request, exc, exc_info=exc)
        done = error_message(request.request, RequestFailed(repr(exc)), (), "")
    await emit(done)
    return done


async def _run(
    coordinator: Coordinator,
    text: TextAdapter,
    request: GenerateRequest,
    ids: list[int],
    emit: Emit,
    store: CheckpointStore | None = None,
) -> GenerateDone:
    key = request.resume if request.resume and store is not None else None
    if key is not None:
        checkpoint_name(key)  # a key that cannot name a checkpoint is refused
    job = TextRequest(
        tuple(ids),
        request.max_tokens,
        request.sampling,
        speculation=request_speculation(coordinator, request),
        receipt=request.receipt,
        ignore_eos=request.ignore_eos,
        request_id=key,
        resume=None if key is None or store is None else store.get(key),
        skip=request.have if key is not None else 0,
    )
    async with text.stream(coordinator, job) as stream:
        async for piece in stream:
            out = TokensOut(request=request.request, token_ids=piece.token_ids, text=piece.text)
            await emit(out)
    end = stream.done
    whole = await text.decode(end.token_ids)
    if end.error is not None:
        return error_message(request.request, end.error, end.token_ids, whole)
    return done_message(request.request, end, whole)


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


def done_message(request: int, end: TextDone, text: str) -> GenerateDone:
    """The client-facing end of a request (with its signed receipt when one was asked for)."""
    assert end.stats is not None  # a request that completed has its stats
    return GenerateDone(
        request=request,
        token_ids=end.token_ids,
        text=text,
        finish_reason=end.finish_reason,
        stats=end.stats,
        receipt=end.receipt,
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
