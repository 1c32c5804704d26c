"""The HTTP API's details as a user expects them (issue 29, item 8), over real HTTP on
loopback against a coordinator whose ring is a scripted double that answers every chunk:
``Connection: close`` closes, a head over 16 KiB is a 431, a lone surrogate is a 400, a
prompt over the byte bound is a 413 before any tokenizing, and a failure on a request's path
is a 500 in the OpenAI error shape while the server serves on.

Charter: 127.0.0.1 only, port 0; raw bytes on a socket; every read under a deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from shard.api.app import ApiApp, ApiConfig
from shard.api.server import ApiServer
from shard.coordinator.config import CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.text import TextAdapter
from shard.messages import Message, NodeName, Prefill, Verdict, Verify
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits
from test_api_http import MODEL, exchange, post, request
from test_api_http import tokenizer as tokenizer  # the module's fixture

MAX_LEN = 64


async def answering_ring(
    frames: trio.MemoryReceiveChannel[Message], back: trio.MemorySendChannel[Message]
) -> None:
    """Answer every chunk that wants a verdict with token 7."""
    async for msg in frames:
        if isinstance(msg, Prefill | Verify) and (not isinstance(msg, Prefill) or msg.final):
            await back.send(Verdict(msg.session, msg.epoch, msg.seq, msg.start, (7,), accepted=0))


@asynccontextmanager
async def serve(
    tokenizer: Tokenizer, **config: Any
) -> AsyncIterator[tuple[tuple[str, int], ApiApp]]:
    to_ring, frames = trio.open_memory_channel[Message](0)
    back, from_ring = trio.open_memory_channel[Message](0)
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=tokenizer.eos_ids,
            limits=Limits(max_len=MAX_LEN, max_sessions=4),
        ),
        CoordinatorChannels(to_ring=to_ring, from_ring=from_ring),
    )
    app = ApiApp(
        coordinator, TextAdapter(tokenizer), ApiConfig(model_id=MODEL, max_len=MAX_LEN, **config)
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answering_ring, frames, back)
        await nursery.start(coordinator.run)
        bound: str = await nursery.start(ApiServer(app, "127.0.0.1:0").run)
        host, port = bound.removeprefix("http://").rsplit(":", 1)
        yield (host, int(port)), app
        nursery.cancel_scope.cancel()


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}


async def test_connection_close_closes_after_a_completion(tokenizer: Tokenizer) -> None:
    """A completion, whole or streamed, asked with Connection: close is answered and the
    server closes the connection at once (it stayed open); no disconnect is counted."""
    async with serve(tokenizer) as (address, app):
        whole = await exchange(address, post("/v1/completions", COMPLETION), timeout_s=5)
        assert whole.status == 200 and whole.json()["usage"]["completion_tokens"] == 3
        streamed = await exchange(
            address, post("/v1/completions", {**COMPLETION, "stream": True}), timeout_s=5
        )
        assert streamed.status == 200 and streamed.body.rstrip().endswith(b"0")
        assert b"data: [DONE]" in streamed.body
        assert app.counters.disconnects == 0


async def test_a_whole_head_over_16_kib_is_a_431(tokenizer: Tokenizer) -> None:
    """A 20 KiB head arriving at once is a 431 in the OpenAI shape; 15 KiB is served."""
    async with serve(tokenizer) as (address, _):
        big = await exchange(address, request("GET", "/health", headers={"X-Pad": "a" * 20480}))
        assert big.status == 431
        assert big.error()["code"] == "request_header_fields_too_large"
        fine = await exchange(address, request("GET", "/health", headers={"X-Pad": "a" * 15360}))
        assert fine.status == 200


async def test_a_lone_surrogate_is_a_400(tokenizer: Tokenizer) -> None:
    """ "\\ud800" in a prompt or a message is a 400 naming where (it was a 500)."""
    async with serve(tokenizer) as (address, _):
        body = b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 2}'
        plain = await exchange(address, post("/v1/completions", body))
        assert plain.status == 400 and plain.error()["param"] == "prompt"
        body = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'
        chat = await exchange(address, post("/v1/chat/completions", body))
        assert chat.status == 400 and chat.error()["param"] == "messages[0].content"


async def test_a_prompt_over_the_byte_bound_is_refused_untokenized(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt over max_prompt_bytes is a 413 before encode is called; one under it is
    tokenized (off the event loop) and served."""
    calls: list[int] = []
    encode: Callable[[str], list[int]] = tokenizer.encode

    def counting(text: str) -> list[int]:
        calls.append(len(text))
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", counting)
    async with serve(tokenizer, max_prompt_bytes=1000) as (address, _):
        big = {**COMPLETION, "prompt": "é" * 501}  # 1002 bytes in 501 characters
        refused = await exchange(address, post("/v1/completions", big))
        assert refused.status == 413 and "max_prompt_bytes" in refused.error()["message"]
        assert calls == []
        served = await exchange(address, post("/v1/completions", COMPLETION))
        assert served.status == 200 and calls == [len("hello")]


async def test_a_failure_on_the_request_path_is_a_500_error_object(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while serving one request (here: in tokenizing) is a 500 in the OpenAI shape,
    logged; the server answers the next request."""
    encode = tokenizer.encode

    def broken(text: str) -> list[int]:
        if text == "boom":
            raise RuntimeError("a bug")
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", broken)
    async with serve(tokenizer) as (address, _):
        failed = await exchange(address, post("/v1/completions", {**COMPLETION, "prompt": "boom"}))
        assert failed.status == 500
        assert failed.error()["type"] == "server_error"
        assert failed.error()["code"] == "internal_error"
        again = await exchange(address, post("/v1/completions", COMPLETION))
        assert again.status == 200
