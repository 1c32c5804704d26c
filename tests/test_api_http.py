"""The HTTP API's edges, over real HTTP on loopback against a coordinator whose ring is a
test double: every error status from a malformed or hostile request, admission (429), and a
disconnect ending the session on the ring at once.

Charter: 127.0.0.1 only, port 0; raw bytes on a socket, so nothing is hidden by a client
library; every read is under a deadline; the server must answer ``/health`` after each attack.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from shard.api.app import ApiApp, ApiConfig
from shard.api.keys import ApiKeys, add_key
from shard.api.server import ApiServer
from shard.coordinator.checkpoint import CheckpointStore, RequestCheckpoint
from shard.coordinator.config import CoordinatorAides, CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.text import TextAdapter
from shard.failover.events import Pause, RingControl, RingLost
from shard.messages import EndSession, Message, NodeName, OpenSession, Sampling
from shard.model.tokenizer import StreamDecoder, Tokenizer
from shard.spec.limits import Limits

MODEL = "tiny"
MAX_LEN = 64


@attrs.define
class Ring:
    """A ring that takes every frame and never answers (requests wait on it forever)."""

    opened: list[int] = attrs.field(factory=list)
    ended: list[int] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def run(self, frames: trio.MemoryReceiveChannel[Message]) -> None:
        async for msg in frames:
            if isinstance(msg, OpenSession):
                self.opened.append(msg.session)
            elif isinstance(msg, EndSession):
                self.ended.append(msg.session)
            else:
                continue
            self.changed.set()
            self.changed = trio.Event()


@attrs.frozen
class Served:
    address: tuple[str, int]
    coordinator: Coordinator
    ring: Ring
    app: ApiApp
    #: What the scheduler would tell the router (``Pause``, ``RingLost``, ...).
    control: trio.MemorySendChannel[RingControl]


@asynccontextmanager
async def serve(
    tokenizer: Tokenizer, checkpoints: CheckpointStore | None = None, **config: Any
) -> AsyncIterator[Served]:
    to_ring, frames = trio.open_memory_channel[Message](0)
    _, from_ring = trio.open_memory_channel[Message](0)
    control_send, control = trio.open_memory_channel[RingControl](0)
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=tokenizer.eos_ids,
            limits=Limits(max_len=MAX_LEN, max_sessions=4),
        ),
        CoordinatorChannels(to_ring=to_ring, from_ring=from_ring, control=control),
        CoordinatorAides(checkpoints=checkpoints),
    )
    options = {"max_sessions": 2, "body_timeout_s": 0.5, "max_body_bytes": 4096, **config}
    app = ApiApp(
        coordinator,
        TextAdapter(tokenizer),
        ApiConfig(model_id=MODEL, max_len=MAX_LEN, **options),
        checkpoints=checkpoints,
    )
    ring = Ring()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ring.run, frames)
        await nursery.start(coordinator.run)
        bound: str = await nursery.start(ApiServer(app, "127.0.0.1:0").run)
        host, port = bound.removeprefix("http://").rsplit(":", 1)
        yield Served((host, int(port)), coordinator, ring, app, control_send)
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint(seed=3, n_layers=2))


@attrs.frozen
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        err = self.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err  # type: ignore[no-any-return]


def request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post(path: str, body: object, headers: dict[str, str] | None = None) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})


async def exchange(address: tuple[str, int], raw: bytes, *, timeout_s: float = 10.0) -> Answer:
    """Send ``raw``, read until the server closes, parse the one response."""
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(*address)
        async with stream:
            await stream.send_all(raw)
            data = bytearray()
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    return Answer(int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body)


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    """What the server sent up to and including ``marker`` (under the caller's deadline)."""
    data = b""
    while marker not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before {marker!r}; got {data!r}"
        data += chunk
    return data


async def healthy(served: Served) -> None:
    answer = await exchange(served.address, request("GET", "/health"))
    assert answer.status == 200 and answer.json()["ready"] is True


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_chat_template_that_renders_without_end_is_a_400(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A model whose chat template loops within loops: a chat request is answered 400 in the
    OpenAI shape naming the template's file, within seconds, and the server serves on."""
    model = tmp_path / "model"
    model.mkdir()
    source = tiny_checkpoint(seed=3, n_layers=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (model / name).write_bytes((source / name).read_bytes())
    (model / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    )
    async with serve(Tokenizer.from_dir(model)) as served:
        with trio.fail_after(5):
            answer = await exchange(served.address, post("/v1/chat/completions", CHAT))
        assert answer.status == 400 and answer.error()["param"] == "messages"
        assert "chat_template.jinja: the chat template failed" in answer.error()["message"]
        await healthy(served)


async def test_malformed_requests_get_400_naming_the_problem(tokenizer: Tokenizer) -> None:
    """Wrong JSON, wrong types and an unsupported parameter are 400s in the OpenAI shape."""
    async with serve(tokenizer) as served:
        bad_json = await exchange(served.address, post("/v1/chat/completions", b"{not json"))
        assert bad_json.status == 400 and bad_json.error()["code"] == "invalid_json"
        deep = b"[" * 4000  # nesting deeper than Python's recursion limit: a 400, no crash
        too_deep = await exchange(served.address, post("/v1/completions", deep))
        assert too_deep.status == 400 and too_deep.error()["code"] == "invalid_json"
        nested = b'{"prompt":' + b"[" * 65 + b"]" * 65 + b"}"  # parses, but past 64 levels
        past = await exchange(served.address, post("/v1/completions", nested))
        assert past.status == 400 and "nested more than 64" in past.error()["message"]
        wrong = await exchange(
            served.address, post("/v1/chat/completions", {**CHAT, "max_tokens": "9"})
        )
        assert wrong.status == 400 and wrong.error()["param"] == "max_tokens"
        assert wrong.error()["type"] == "invalid_request_error"
        n2 = await exchange(served.address, post("/v1/chat/completions", {**CHAT, "n": 2}))
        assert n2.status == 400 and n2.error()["param"] == "n"
        await healthy(served)


async def test_sizes_beyond_the_context_or_the_body_limit(tokenizer: Tokenizer) -> None:
    """Huge max_tokens is a 400 (past the context, or past the table of bounds); a prompt
    longer than the context and a 10 MB body are 413s."""
    async with serve(tokenizer) as served:
        huge = await exchange(
            served.address, post("/v1/chat/completions", {**CHAT, "max_tokens": 10**6})
        )
        assert huge.status == 400 and huge.error()["code"] == "context_length_exceeded"
        past = await exchange(
            served.address, post("/v1/chat/completions", {**CHAT, "max_tokens": 10**12})
        )
        assert past.status == 400 and past.error()["param"] == "max_tokens"
        long_prompt = {"model": MODEL, "prompt": "word " * 200, "max_tokens": 1}
        too_long = await exchange(served.address, post("/v1/completions", long_prompt))
        assert too_long.status == 413 and too_long.error()["param"] == "prompt"
        big = post("/v1/completions", b'{"prompt": "' + b"x" * (10 << 20) + b'"}')
        too_big = await exchange(served.address, big, timeout_s=30)
        assert too_big.status == 413 and too_big.error()["code"] == "too_large"
        await healthy(served)


async def test_unknown_model_route_and_method(tokenizer: Tokenizer) -> None:
    """An unknown model is a 404 naming the served one; unknown routes 404, wrong methods 405."""
    async with serve(tokenizer) as served:
        other = await exchange(
            served.address, post("/v1/chat/completions", {**CHAT, "model": "gpt-9"})
        )
        assert other.status == 404 and other.error()["code"] == "model_not_found"
        assert MODEL in other.error()["message"]
        models = await exchange(served.address, request("GET", "/v1/models"))
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        assert (await exchange(served.address, request("GET", "/v1/models/gpt-9"))).status == 404
        assert (await exchange(served.address, request("GET", "/nope"))).status == 404
        assert (await exchange(served.address, request("GET", "/v1/completions"))).status == 405


async def test_keys_are_required_when_configured(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """No key or a wrong key is a 401 with WWW-Authenticate; the right key passes."""
    key = add_key(tmp_path / "keys.txt")
    async with serve(tokenizer, keys=ApiKeys.from_file(tmp_path / "keys.txt")) as served:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": key}):
            answer = await exchange(served.address, post("/v1/chat/completions", CHAT, headers))
            assert answer.status == 401 and answer.error()["code"] == "invalid_api_key"
            assert answer.headers["www-authenticate"] == "Bearer"
        assert (await exchange(served.address, request("GET", "/metrics"))).status == 401
        ok = {"Authorization": f"Bearer {key}"}
        models = await exchange(served.address, request("GET", "/v1/models", headers=ok))
        assert models.status == 200
        page = await exchange(served.address, request("GET", "/"))  # the page asks for the key
        assert page.status == 200 and b"<title>shard chat</title>" in page.body
        assert "default-src 'self'" in page.headers["content-security-policy"]


async def test_a_ring_under_repair_answers_503(tokenizer: Tokenizer) -> None:
    """While the scheduler repairs the ring, requests and /health get 503 with the reason."""
    async with serve(tokenizer) as served:
        await served.control.send(Pause("s1 died"))
        answer = await exchange(served.address, post("/v1/chat/completions", CHAT))
        assert answer.status == 503 and answer.headers["retry-after"] == "1"
        assert "repaired" in answer.error()["message"]
        health = await exchange(served.address, request("GET", "/health"))
        assert health.status == 503 and health.json()["ready"] is False
        await served.control.send(RingLost("no standby"))
        down = await exchange(
            served.address, post("/v1/completions", {"model": MODEL, "prompt": "x"})
        )
        assert down.status == 503 and "no standby" in down.error()["message"]


async def test_hostile_http_never_ends_the_server(tokenizer: Tokenizer) -> None:
    """Garbage bytes, a 100 KB header and a body that stalls are refused per connection."""
    async with serve(tokenizer) as served:
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(*served.address)
            async with stream:
                await stream.send_all(b"\x16\x03\x01 not http at all\r\n\r\n")
                reply = await stream.receive_some(65536)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
        await healthy(served)
        big_header = request("GET", "/health", headers={"X-Big": "a" * 100_000})
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(*served.address)
            async with stream:
                try:
                    await stream.send_all(big_header)
                    reply = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    reply = b""  # closed on us mid-send: refused all the same
        assert reply == b"" or reply.split(b" ")[1] in (b"400", b"431")
        await healthy(served)
        stalled = post("/v1/chat/completions", b'{"model": "tiny"')[:-3]
        head = stalled.replace(b"Content-Length: 16", b"Content-Length: 500")
        answer = await exchange(served.address, head, timeout_s=10)
        assert answer.status == 408 and answer.error()["code"] == "timeout"
        await healthy(served)


async def test_admission_refuses_beyond_max_sessions(tokenizer: Tokenizer) -> None:
    """With two streams in flight (their ring never answers) the third gets 429 at once."""
    async with serve(tokenizer) as served, trio.open_nursery() as nursery:
        streams = []
        for _ in range(2):
            stream = await trio.open_tcp_stream(*served.address)
            await stream.send_all(post("/v1/chat/completions", {**CHAT, "stream": True}))
            with trio.fail_after(10):  # the role chunk: it was admitted
                first = await read_until(stream, b'"role":"assistant"')
            assert first.startswith(b"HTTP/1.1 200")
            streams.append(stream)
        busy = await exchange(served.address, post("/v1/chat/completions", CHAT))
        assert busy.status == 429 and busy.headers["retry-after"] == "1"
        assert busy.error()["type"] == "rate_limit_error"
        metrics = await exchange(served.address, request("GET", "/metrics"))
        assert b"shard_api_sessions_in_flight 2" in metrics.body
        assert b"shard_api_rejected_busy_total 1" in metrics.body
        for stream in streams:
            await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_a_disconnect_ends_the_session_on_the_ring(tokenizer: Tokenizer) -> None:
    """Closing the connection mid-stream sends EndSession for that session right away."""
    async with serve(tokenizer) as served:
        stream = await trio.open_tcp_stream(*served.address)
        await stream.send_all(post("/v1/chat/completions", {**CHAT, "stream": True}))
        with trio.fail_after(10):
            while not served.ring.opened:
                await served.ring.changed.wait()
            await read_until(stream, b'"role":"assistant"')
        session = served.ring.opened[0]
        await stream.aclose()
        with trio.fail_after(1.0):
            while session not in served.ring.ended:
                await served.ring.changed.wait()
        assert served.app.counters.disconnects == 1
        await healthy(served)
        assert served.app.counters.in_flight == 0


async def test_a_ring_failure_mid_stream_is_an_error_event(tokenizer: Tokenizer) -> None:
    """A stream whose ring is lost under it ends with an error event, never a finish_reason."""
    async with serve(tokenizer) as served:
        stream = await trio.open_tcp_stream(*served.address)
        await stream.send_all(post("/v1/chat/completions", {**CHAT, "stream": True}))
        with trio.fail_after(10):
            while not served.ring.opened:
                await served.ring.changed.wait()
            await read_until(stream, b'"role":"assistant"')
            await served.control.send(RingLost("every stage is gone"))
            rest = await read_until(stream, b"every stage is gone")
        event = json.loads(rest.split(b"data: ")[-1].split(b"\n\n")[0])
        assert event["error"]["code"] == "ring_failed"
        assert b'finish_reason":"stop' not in rest and b"[DONE]" not in rest
        await stream.aclose()


async def test_a_ring_failure_without_a_stream_is_a_503(tokenizer: Tokenizer) -> None:
    """A non-streamed request whose ring is lost under it gets a 503 saying so."""
    async with serve(tokenizer) as served, trio.open_nursery() as nursery:
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await exchange(served.address, post("/v1/chat/completions", CHAT)))

        nursery.start_soon(ask)
        with trio.fail_after(10):
            while not served.ring.opened:
                await served.ring.changed.wait()
        await served.control.send(RingLost("every stage is gone"))
    assert answers[0].status == 503 and answers[0].error()["code"] == "ring_failed"
    assert "every stage is gone" in answers[0].error()["message"]


PLAIN = {"model": MODEL, "prompt": "the river", "max_tokens": 8, "stream": True}


async def test_hostile_resume_headers_are_400s(tokenizer: Tokenizer) -> None:
    """A malformed ``X-Shard-Resume``, a count past the request's, or one on a request that
    is not streamed: 400 ``invalid_resume``, and the server serves on."""
    async with serve(tokenizer, CheckpointStore(None)) as served:
        for value, body in [
            ("nokey", PLAIN),
            ("k:", PLAIN),
            (":3", PLAIN),
            ("k:-1", PLAIN),
            ("k:1e3", PLAIN),
            ("k:٣", PLAIN),  # a digit, not an ASCII one
            ("../../etc/passwd:1", PLAIN),
            ("k" * 129 + ":1", PLAIN),
            ("k:9", PLAIN),  # more than max_tokens
            ("k:" + "9" * 4000, PLAIN),
            ("k:1", {**PLAIN, "stream": False}),
        ]:
            answer = await exchange(
                served.address, post("/v1/completions", body, {"X-Shard-Resume": value})
            )
            assert answer.status == 400, (value, answer.body)
            assert answer.error()["code"] == "invalid_resume"
            assert answer.error()["param"] == "X-Shard-Resume"
        await healthy(served)
        assert served.ring.opened == []


async def test_a_stream_names_its_resume_key_and_is_checkpointed_under_it(
    tokenizer: Tokenizer,
) -> None:
    """With checkpoints (a standby coordinator follows them), a streamed reply names its
    request's key in ``X-Shard-Resume-Key`` and the request is checkpointed under it."""
    store = CheckpointStore(None)
    async with serve(tokenizer, store) as served:
        stream = await trio.open_tcp_stream(*served.address)
        await stream.send_all(post("/v1/completions", PLAIN))
        with trio.fail_after(10):
            head = await read_until(stream, b"\r\n\r\n")
            while not served.ring.opened:
                await served.ring.changed.wait()
        key = head.decode().lower().split("x-shard-resume-key: ")[1].split("\r\n")[0]
        assert len(key) == 32 and store.get(key) is not None
        await stream.aclose()


async def test_a_resumed_stream_sends_only_the_tokens_past_have(tokenizer: Tokenizer) -> None:
    """Re-issued with ``X-Shard-Resume: KEY:N`` to a coordinator holding KEY's checkpoint,
    the stream gives the text of the tokens after the first N, each chunk saying the count
    its text covers."""
    ids = tokenizer.encode(" and the sea runs to the river")
    store = CheckpointStore(None)
    prompt = tuple(tokenizer.encode("the river"))
    store.save(RequestCheckpoint("k1", prompt, tuple(ids), len(ids), Sampling()))
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(token) for token in ids]
    async with serve(tokenizer, store) as served:
        answer = await exchange(
            served.address, post("/v1/completions", PLAIN, {"X-Shard-Resume": "k1:3"})
        )
    assert answer.status == 200 and answer.headers["x-shard-resume-key"] == "k1"
    assert served.ring.opened == []  # the checkpoint had every token: nothing to generate
    events = [json.loads(e[6:]) for e in _sse(answer.body) if e != "data: [DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == "".join(pieces[3:]) + decoder.flush()
    counts = [e["shard"]["tokens"] for e in events[:-1] if e["choices"][0]["text"]]
    assert counts and counts[-1] <= len(ids) and counts == sorted(counts)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def _sse(body: bytes) -> list[str]:
    """The ``data:`` lines of a chunked SSE body."""
    data = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        data, body = data + rest[:n], rest[n + 2 :]
    return [line for line in data.decode().split("\n") if line.startswith("data: ")]
