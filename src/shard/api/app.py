"""The ASGI app: routes, bearer keys, bounded request bodies, admission, SSE streaming.

One ``ApiApp`` per coordinator; hypercorn (``shard.api.server``) calls it once per request.
Every refusal is an ``ApiError`` answered in the OpenAI error shape. A completion request
becomes one ring session (``shard.api.runner``) that lives exactly as long as its client: a
disconnect, noticed on the ASGI ``receive`` channel, cancels it and so ends the session on
every stage. Beyond ``max_sessions`` requests in flight the answer is 429 with Retry-After —
never a queue.

Every request is its own supervised scope: whatever fails on its path — a refusal (an
``ApiError``), the ring (503), the coordinator (``RequestFailed``: 500) or a bug here (500,
logged once) — is answered to that client in the OpenAI error shape (an error event once a
stream has started) and ends nothing else. A head over ``MAX_HEAD_BYTES`` is a 431; a prompt
over ``max_prompt_bytes`` a 413 before it is tokenized; tokenizing runs in a worker thread
(the coordinator's ``TextAdapter``, which its wire clients share).

Cancellation: cancelling a request's task ends its session.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.resources import files
from typing import Any

import attrs
import trio

from shard import strict_json
from shard.api import responses
from shard.api.errors import ApiError
from shard.api.keys import ApiKeys
from shard.api.metrics import ApiCounters, render
from shard.api.reply import (
    MAX_HEAD_BYTES,
    Receive,
    Reply,
    Scope,
    Send,
    head_bytes,
    header,
    lifespan,
)
from shard.api.resume import KEY_HEADER, REQUEST_HEADER, Resume, new_key, parse_resume
from shard.api.runner import Prepared, RingFailed, check_size, finished, prepare, text_request
from shard.api.schema import Generation, parse_chat, parse_completion
from shard.coordinator.checkpoint import CheckpointStore
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.service import ring_unready
from shard.coordinator.text import TextAdapter

log = logging.getLogger(__name__)

_PAGE_HEADERS = (
    ("content-type", "text/html; charset=utf-8"),
    # Nothing is fetched from anywhere but here: no CDN, no inline-loaded third party.
    (
        "content-security-policy",
        "default-src 'self'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'; connect-src 'self'",
    ),
    ("cache-control", "no-cache"),
)


@attrs.frozen
class ApiConfig:
    """What the app needs to know: the model id it serves, the limits, the keys (None: open)."""

    model_id: str
    max_len: int
    max_sessions: int = 16
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0
    keys: ApiKeys | None = None
    #: A prompt's UTF-8 size, refused with 413 before any tokenizing (``[limits]``'s, the
    #: bound the wire client has too).
    max_prompt_bytes: int = 256 * 1024


class Disconnected(Exception):
    """The client went away before its request body arrived."""


class ApiApp:
    """The HTTP API of one coordinator (see the module docstring)."""

    def __init__(
        self,
        coordinator: Coordinator,
        text: TextAdapter,
        config: ApiConfig,
        *,
        failovers: Callable[[], int] = lambda: 0,
        wall_clock: Callable[[], float] = time.time,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self._coordinator = coordinator
        self._checkpoints = checkpoints  # set: streams are resumable (shard.api.resume)
        self._text = text  # the coordinator's one text adapter (shared with the wire's)
        self._config = config
        self._failovers = failovers
        self._wall_clock = wall_clock
        self.counters = ApiCounters()
        self._page = files("shard.api").joinpath("page.html").read_bytes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        reply = Reply(send)
        path, method = scope.get("path", ""), scope.get("method", "")
        endpoint = path if path in _ROUTES else "other"
        try:
            _check_head(scope)
            await self._route(path, method, scope, receive, reply)
        except ApiError as exc:
            await _refuse(reply, exc)
        except Disconnected:
            self.counters.disconnects += 1
        except Exception as exc:  # this request's alone: its client hears why, the API serves on
            log.error("%s %s failed: %r", method, path, exc, exc_info=exc)
            message = f"the server failed this request ({type(exc).__name__}); it is logged"
            await _refuse(reply, ApiError(500, message, code="internal_error"))
        self.counters.request(endpoint, reply.status)

    async def _route(
        self, path: str, method: str, scope: Scope, receive: Receive, reply: Reply
    ) -> None:
        allowed = _ROUTES.get(path)
        if allowed is None and path.startswith("/v1/models/"):
            allowed = "GET"
        if allowed is None:
            raise ApiError(404, f"no route {path!r}; see /v1/models", code="unknown_url")
        if method != allowed:
            raise ApiError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed")
        if path == "/":
            await reply.raw(200, self._page, _PAGE_HEADERS)
        elif path == "/health":
            reason = ring_unready(self._coordinator)
            health = {
                "status": "ok" if reason is None else "unavailable",
                "ready": reason is None,
                "reason": reason,
            }
            await reply.json(200 if reason is None else 503, health)
        else:
            self._authorize(scope)
            if path == "/metrics":
                await reply.raw(200, self._metrics().encode(), (("content-type", _PROM),))
            elif path.startswith("/v1/models"):
                await reply.json(200, self._models(path.removeprefix("/v1/models")))
            else:
                data = await self._body(scope, receive)
                parse = parse_chat if path == "/v1/chat/completions" else parse_completion
                resume = header(scope, REQUEST_HEADER)
                await self._complete(parse(data), resume, receive, reply)

    def _authorize(self, scope: Scope) -> None:
        keys = self._config.keys
        if keys is None:
            return
        given = header(scope, b"authorization")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not keys.allows(key.strip()):
            why = "no API key" if not given else "the API key is not valid"
            raise ApiError(
                401,
                f"{why}: send Authorization: Bearer KEY (a key from the operator's keys_file)",
                code="invalid_api_key",
                headers=(("www-authenticate", "Bearer"),),
            )

    def _models(self, rest: str) -> dict[str, Any]:
        model = {
            "id": self._config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "shard",
            # shard's own: whether chat completions work (a base model has no chat template;
            # the chat page then offers plain completion)
            "shard": {"chat_template": self._text.tokenizer.has_chat_template},
        }
        if not rest:
            return {"object": "list", "data": [model]}
        self._check_model(rest.removeprefix("/"))
        return model

    def _check_model(self, name: str) -> None:
        if name != self._config.model_id:
            raise ApiError(
                404,
                f"the model {name!r} does not exist here; this swarm serves "
                f"{self._config.model_id!r}",
                param="model",
                code="model_not_found",
            )

    def _metrics(self) -> str:
        return render(
            self.counters,
            self._coordinator.statistics(),
            max_sessions=self._config.max_sessions,
            ready=ring_unready(self._coordinator) is None,
            failovers=self._failovers(),
        )

    async def _body(self, scope: Scope, receive: Receive) -> object:
        """The request's JSON, read within the size and time limits (413, 408, 400).

        A body over the limit is read to its end and dropped (up to ``_DRAIN_BYTES``), so
        the client, still sending, gets its 413 instead of a broken pipe."""
        limit = self._config.max_body_bytes
        declared = header(scope, b"content-length")
        if declared.isdigit() and int(declared) > _DRAIN_BYTES:
            raise _too_big(limit)
        data = bytearray()
        size = 0
        with trio.move_on_after(self._config.body_timeout_s) as waited:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Disconnected()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > _DRAIN_BYTES:
                    break
                if size <= limit:
                    data += chunk
                if not message.get("more_body", False):
                    break
        if size > limit:
            raise _too_big(limit)
        if waited.cancelled_caught:
            raise ApiError(
                408,
                f"the request body took over {self._config.body_timeout_s:g} s to arrive",
                code="timeout",
            )
        try:  # nesting is bounded here, so structuring it later cannot recurse deep
            return strict_json.loads(data, duplicate_keys=True, constants=True)
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None

    @contextmanager
    def _admit(self) -> Iterator[None]:
        """Hold one of ``max_sessions`` places, or refuse with 429 (never queue)."""
        counters = self.counters
        ring = self._coordinator
        if (
            counters.in_flight >= self._config.max_sessions
            or ring.sessions() >= ring.limits.max_sessions
        ):
            counters.rejected_busy += 1
            raise ApiError(
                429,
                f"{counters.in_flight} requests in flight, the most this swarm admits "
                f"([api] max_sessions = {self._config.max_sessions}); retry shortly",
                code="too_many_sessions",
                headers=(("retry-after", "1"),),
            )
        counters.in_flight += 1
        try:
            yield
        finally:
            counters.in_flight -= 1

    async def _complete(
        self, generation: Generation, resume: str, receive: Receive, reply: Reply
    ) -> None:
        self._check_model(generation.model)
        most = generation.max_tokens or self._config.max_len
        again = parse_resume(resume, stream=generation.stream, max_tokens=most)
        reason = ring_unready(self._coordinator)
        if reason is not None:
            raise ApiError(503, reason, code="ring_unavailable", headers=(("retry-after", "1"),))
        check_size(generation, self._config.max_prompt_bytes)
        request = await prepare(generation, self._text, max_len=self._config.max_len)
        prefix = "chatcmpl-" if generation.chat else "cmpl-"
        rid = responses.ReplyId(
            prefix + secrets.token_hex(12),
            generation.chat,
            int(self._wall_clock()),
            generation.model,
        )
        failure: ApiError | None = None
        with self._admit():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, receive, reply, nursery.cancel_scope)
                try:
                    if generation.stream:
                        await self._stream(request, rid, reply, again)
                    else:
                        await self._whole(request, rid, reply)
                except ApiError as exc:  # raised out of the nursery, not inside its group
                    failure = exc
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _watch(self, receive: Receive, reply: Reply, scope: trio.CancelScope) -> None:
        """End the request (and so its ring session) the moment its client goes away; the
        disconnect hypercorn posts as the reply ends is not one (``shard.api.reply``)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not reply.finishing:
            self.counters.disconnects += 1
            scope.cancel()

    async def _whole(self, request: Prepared, rid: responses.ReplyId, reply: Reply) -> None:
        pieces: list[str] = []
        async with self._text.stream(self._coordinator, text_request(request)) as stream:
            async for piece in stream:
                pieces.append(piece.text)
        outcome = finished(request, stream.done)
        pieces.append(outcome.tail)
        self._count(outcome.prompt_tokens, outcome.completion_tokens)
        use = responses.usage(outcome.prompt_tokens, outcome.completion_tokens)
        extra = responses.shard_stats(outcome.stats, outcome.completion_tokens)
        body = responses.whole(rid, "".join(pieces), outcome.finish_reason, use, extra)
        await reply.json(200, body)

    async def _stream(
        self, request: Prepared, rid: responses.ReplyId, reply: Reply, again: Resume | None
    ) -> None:
        usage = request.generation.include_usage
        store, key, have = self._checkpoints, None, 0 if again is None else again.have
        job = text_request(request, skip=have)
        if store is not None:  # resumable: checkpointed under its key (docs/api.md)
            key = again.key if again is not None else new_key()
            job = text_request(request, key, store.get(key), have)
        await reply.start_events(() if key is None else ((KEY_HEADER, key),))
        if rid.chat:  # the role first, at once: the client knows it was admitted
            await reply.event(responses.chunk(rid, role=True, with_usage=usage))
        async with self._text.stream(self._coordinator, job) as stream:
            async for piece in stream:  # each delta as its tokens commit
                have += len(piece.token_ids)
                if piece.text:
                    event = responses.chunk(rid, text=piece.text, with_usage=usage)
                    if key is not None:  # what a resumed request says it has (.resume)
                        event["shard"] = {"tokens": have}
                    await reply.event(event)
        try:
            outcome = finished(request, stream.done)
        except RingFailed as exc:
            self._count(len(request.prompt_ids), exc.completion_tokens)
            raise
        if outcome.tail:
            await reply.event(responses.chunk(rid, text=outcome.tail, with_usage=usage))
        self._count(outcome.prompt_tokens, outcome.completion_tokens)
        last = responses.chunk(rid, finish_reason=outcome.finish_reason, with_usage=usage)
        last["shard"] = responses.shard_stats(outcome.stats, outcome.completion_tokens)
        await reply.event(last)
        if usage:
            use = responses.usage(outcome.prompt_tokens, outcome.completion_tokens)
            await reply.event(responses.usage_chunk(rid, use))
        await reply.event("[DONE]", last=True)

    def _count(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.counters.prompt_tokens += prompt_tokens
        self.counters.completion_tokens += completion_tokens


async def _refuse(reply: Reply, exc: ApiError) -> None:
    if reply.started:  # mid-stream: the error becomes an event (never a silent stop)
        if not reply.finishing:
            await reply.event({"error": exc.body()["error"]}, last=True)
    else:
        await reply.json(exc.status, exc.body(), exc.headers)


def _check_head(scope: Scope) -> None:
    size = head_bytes(scope)
    if size > MAX_HEAD_BYTES:
        raise ApiError(
            431,
            f"the request head (request line and headers) is {size} bytes, over the "
            f"{MAX_HEAD_BYTES} this API takes; send fewer or shorter headers",
            code="request_header_fields_too_large",
        )


_PROM = "text/plain; version=0.0.4; charset=utf-8"
#: A body over the limit is read and dropped up to this size before the 413 (see ``_body``).
_DRAIN_BYTES = 64 << 20


def _too_big(limit: int) -> ApiError:
    return ApiError(
        413, f"the request body exceeds {limit} bytes ([api] max_body_kib)", code="too_large"
    )


_ROUTES = {
    "/": "GET",
    "/health": "GET",
    "/metrics": "GET",
    "/v1/models": "GET",
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
}
