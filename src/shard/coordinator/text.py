"""Text in, text out: the one adapter between text and a ring session.

The wire client's requests (``shard.coordinator.service``, which ``shard generate`` and
``swarm run`` reach) and the HTTP API's (``shard.api.runner``) both go through here:

- ``TextAdapter.encode`` turns a prompt (text, a chat through the model's own template, or
  token ids) into ids, and ``decode`` ids into text, in a worker thread behind the adapter's
  ``CapacityLimiter`` (one per coordinator), never on the event loop: a 900 KB prompt cannot
  make the scheduler think a stage died;
- ``TextAdapter.stream`` runs one ``TextRequest`` on the ``Coordinator``. The request's driver
  sends each batch of committed ids on a channel (``Committed``), and the task that runs the
  request sends its end there last (``Ended``: the completion or the error); the caller iterates the
  ``TextStream`` for ``TextPiece``s — the text each batch completes (``StreamDecoder``:
  a short window per token, on the loop), cut at the first stop string (``StopText``) — and
  reads ``TextStream.done`` (a ``TextDone``) after the last one. A stop string cancels the
  request at once, which ends its session on every stage.

Cancellation: leaving the ``stream`` block (the caller cancelled, its client went away, or
its own code raised) cancels the request, which ends its session on the ring. What the
caller's own code raises comes back to it as it was.

Errors: the request's own — ``BadRequest``, ``RingError`` (``RequestFailed`` included) or
``CallerLeft`` — are values (``TextDone.error``, with the ids delivered before), never raised;
``encode`` raises ``TokenizerError`` (a chat the template refuses) and ``BadRequest`` (token
ids outside the vocabulary).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from shard.compute import offload
from shard.coordinator.checkpoint import RequestCheckpoint
from shard.coordinator.coordinator import Completion, Coordinator
from shard.coordinator.events import (
    CallerLeft,
    Committed,
    Ended,
    Piece,
    RequestFailed,
    RingError,
)
from shard.coordinator.stops import StopText
from shard.decode.control import SpeculationConfig
from shard.decode.state import BadRequest
from shard.messages import RunStats, Sampling
from shard.model.tokenizer import StreamDecoder, Tokenizer
from shard.trust.receipts import RunReceipt

log = logging.getLogger(__name__)

#: A prompt: text, a chat (``{"role", "content"}`` turns, through the chat template) or ids.
Prompt = str | tuple[int, ...] | Sequence[Mapping[str, str]]


@attrs.frozen
class TextRequest:
    """A request ready for the ring: prompt ids, budget, sampling, and what ends it early."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    speculation: SpeculationConfig | None = None  # None: the swarm's policy
    receipt: bool = False
    ignore_eos: bool = False
    #: a standby coordinator's takeover (docs/failover.md): the request's checkpoint name,
    #: the checkpoint to go on from (None: from the start), and how many output tokens the
    #: caller already has (their text is not given again)
    request_id: str | None = None
    resume: RequestCheckpoint | None = None
    skip: int = 0


@attrs.frozen
class TextPiece:
    """Text safe to show now, and the ids of the batch it came with (a piece may be empty:
    a character split across tokens waits for the next batch)."""

    text: str
    token_ids: tuple[int, ...]


@attrs.frozen(eq=False)
class TextDone:
    """How a ``TextRequest`` ended.

    ``token_ids``: every id delivered as a ``TextPiece`` (up to the one that completed a stop
    string); ``finish_reason``: "stop", "length" or "error"; ``error``: why it failed (a
    ``BadRequest``, ``RingError``, ``RequestFailed`` or ``CallerLeft``), None otherwise;
    ``tail``: text the stream decoder still held when the request completed (a stop string's
    possible start, an unfinished character), "" after a stop or an error; ``stats`` and
    ``receipt``: the completion's (None after a stop or an error)."""

    token_ids: tuple[int, ...]
    finish_reason: str
    error: Exception | None = None
    tail: str = ""
    stats: RunStats | None = None
    receipt: RunReceipt | None = None


class TextStream:
    """One request's text as it commits (see the module docstring); iterate it for
    ``TextPiece``s, then read ``done``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str],
        pieces: trio.MemoryReceiveChannel[Piece],
        request: trio.CancelScope,
        skip: int = 0,
    ) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self._skip = skip
        self._stops = StopText(stop)
        self._pieces = pieces
        self._outcome: Completion | Exception | None = None  # the request's end, once it came
        self._request = request
        self._delivered: list[int] = []
        self._done: TextDone | None = None

    @property
    def done(self) -> TextDone:
        """How the request ended. Errors: ``RuntimeError`` before the stream was read out."""
        if self._done is None:
            raise RuntimeError("the text stream was not read to its end")
        return self._done

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> TextPiece:
        while self._done is None:
            try:
                batch = await self._pieces.receive()
            except trio.EndOfChannel:
                self._done = self._ended()
                break
            if isinstance(batch, Ended):
                self._outcome = batch.outcome
                continue
            ids: list[int] = []
            text = ""
            for token in batch.token_ids:
                piece = self._stops.push(self._decoder.push(token))
                self._delivered.append(token)
                if len(self._delivered) > self._skip:  # the caller had the first ``skip``
                    ids.append(token)
                    text += piece
                if self._stops.hit:
                    break
            if self._stops.hit:  # a stop string ends the session now, on every stage
                self._request.cancel()
                self._done = TextDone(tuple(self._delivered), "stop")
            if ids or self._done is not None:
                return TextPiece(text, tuple(ids))
        raise StopAsyncIteration

    def _ended(self) -> TextDone:
        delivered = tuple(self._delivered)
        outcome = self._outcome
        if outcome is None:  # cancelled from outside before it ended
            why = RingError("the request was cancelled", committed=delivered)
            return TextDone(delivered, "error", error=why)
        if isinstance(outcome, Exception):
            return TextDone(delivered, "error", error=outcome)
        tail = self._stops.push(self._decoder.flush()) + self._stops.flush()
        if self._stops.hit:
            return TextDone(delivered, "stop", tail=tail)
        return TextDone(
            outcome.token_ids,
            outcome.finish_reason,
            tail=tail,
            stats=outcome.stats,
            receipt=outcome.receipt,
        )


class TextAdapter:
    """The coordinator's text side: one per coordinator, shared by the wire client's
    requests and the HTTP API's (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, limiter: trio.CapacityLimiter | None = None) -> None:
        """``limiter`` bounds the threads tokenizing at once (default: one)."""
        self.tokenizer = tokenizer
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)

    async def encode(self, prompt: Prompt) -> list[int]:
        """``prompt`` as ids (see ``encode_prompt``), tokenized in a worker thread."""
        return await offload.run_sync(encode_prompt, self.tokenizer, prompt, limiter=self._limiter)

    async def decode(self, ids: Sequence[int]) -> str:
        """``ids`` as text, decoded in a worker thread."""
        return await offload.run_sync(self.tokenizer.decode, list(ids), limiter=self._limiter)

    @asynccontextmanager
    async def stream(
        self, coordinator: Coordinator, request: TextRequest
    ) -> AsyncIterator[TextStream]:
        """Run ``request`` on ``coordinator`` while the block reads its ``TextStream``."""
        send, receive = trio.open_memory_channel[Piece](0)
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(_generate, coordinator, request, send, scope)
            with receive:
                try:
                    yield TextStream(self.tokenizer, request.stop, receive, scope, request.skip)
                except Exception as exc:  # the caller's own: raised as it was, below
                    failure = exc
            scope.cancel()  # read out or left early: nothing more is wanted
        if failure is not None:
            raise failure


async def _generate(
    coordinator: Coordinator,
    request: TextRequest,
    tokens: trio.MemorySendChannel[Piece],
    scope: trio.CancelScope,
) -> None:
    """Run the request; its end is the last message on ``tokens`` (``Ended``) before it
    closes. Never raises (a bug past the coordinator's own boundary becomes
    ``RequestFailed``, logged here)."""
    with tokens, scope:
        try:
            completion: Completion | Exception
            if request.resume is not None:  # the committed tokens first, then the rest
                if request.resume.output_ids:
                    await tokens.send(Committed(request.resume.output_ids))
                completion = await coordinator.resume_request(
                    request.resume,
                    tokens=tokens,
                    speculation=request.speculation,
                    receipt=request.receipt,
                )
            else:
                completion = await coordinator.generate(
                    request.prompt_ids,
                    max_tokens=request.max_tokens,
                    sampling=request.sampling,
                    tokens=tokens,
                    speculation=request.speculation,
                    receipt=request.receipt,
                    ignore_eos=request.ignore_eos,
                    request_id=request.request_id,
                )
        except (BadRequest, RingError, CallerLeft) as exc:
            completion = exc
        except Exception as exc:
            log.error("a request failed at the coordinator: %r", exc, exc_info=exc)
            completion = RequestFailed(f"the coordinator failed this request: {exc!r}")
        try:
            await tokens.send(Ended(completion))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the reader left (a stop string, a caller gone): nobody wants the end


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """``prompt`` as ids: text as it is, a chat through the model's own template, ids checked
    against the vocabulary. Errors: ``TokenizerError`` (the template refuses the chat),
    ``BadRequest`` (an id outside the vocabulary)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    turns = [{"role": m["role"], "content": m["content"]} for m in prompt if isinstance(m, Mapping)]
    if turns:
        return tokenizer.encode(tokenizer.apply_chat(turns))
    ids = [int(t) for t in prompt if isinstance(t, int)]
    vocab = tokenizer.vocab_size
    if len(ids) != len(prompt) or any(t >= vocab or t < 0 for t in ids):
        raise BadRequest(f"token ids must be below the vocabulary size {vocab}")
    return ids


__all__ = [
    "Prompt",
    "TextAdapter",
    "TextDone",
    "TextPiece",
    "TextRequest",
    "TextStream",
    "encode_prompt",
]
