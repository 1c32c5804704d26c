"""The HTTP API of a live swarm of processes, used through the real ``openai`` client (sync,
async, streaming) and the chat page in a real headless browser, compared token for token with
``shard generate --local``.

Charter: 127.0.0.1 only, free ports; one swarm (``shard swarm up SPEC --api 127.0.0.1:0``)
serves the whole module and is killed with its process group on the way out; every wait is
bounded; state is observed through what the processes report (the stages' ``StageReport``
feed, the SSE stream), never by sleeping.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
import trio

from browser import Browser, chromium_path
from procs import SHARD, child_env, kill_group, write_spec
from shard.api.keys import add_key
from shard.messages import Hello, NodeName, StageReport
from shard.transport import WebSocketNetwork
from shard.transport.links import dial_peer

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
MAX_LEN = 256
START_S = 150.0  # the swarm's processes start and import torch on 2 busy cores
PROMPTS = ("The capital of France is", "Hello, world! Hello", "in the beginning", "once upon")
CHATS = ("Write a haiku about rivers", "hi")

#: ``shard generate --local --json`` per item (``c:`` chat, ``p:`` plain) in one interpreter.
_LOCAL = """
import sys
from shard.cli import main
model, max_tokens, max_len, *items = sys.argv[1:]
for item in items:
    kind, prompt = item.split(":", 1)
    argv = ["generate", "--local", "--json", "--model", model, "--max-tokens", max_tokens,
            "--max-len", max_len, *(["--chat"] if kind == "c" else []), prompt]
    if main(argv) != 0:
        sys.exit(1)
"""


@attrs.frozen
class Swarm:
    """The running swarm: its API, an API key, the stages' addresses and PIDs, references."""

    api: str
    key: str
    model: str
    stages: dict[str, str]
    pids: dict[str, int]
    plain: dict[str, dict[str, Any]]
    chat: dict[str, dict[str, Any]]

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.api}/v1", api_key=self.key, max_retries=0, **kw)

    def async_client(self, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.api}/v1", api_key=self.key, max_retries=0, **kw)


def _lines(stream: Any, into: queue.Queue[str]) -> None:
    for raw in iter(stream.readline, b""):
        into.put(raw.decode(errors="replace").rstrip())


def _write_spec(tmp: Path, model_dir: Path) -> tuple[Path, str]:
    spec = write_spec(
        tmp / "api.toml",
        model_dir=model_dir,
        blocks=[(0, 2), (2, 4)],
        name="api",
        limits={"max_len": MAX_LEN, "connect_timeout_s": 5.0},
    )
    key = add_key(tmp / "api-keys.txt", "tests")
    # A stage stopped on purpose (SIGSTOP, the admission test) must not be declared dead.
    spec.write_text(
        spec.read_text()
        + '\n[speculation]\ndraft = "ngram"\n'
        + "\n[failover]\ndead_after_s = 60.0\nsend_timeout_s = 60.0\n"
        + '\n[api]\nkeys_file = "api-keys.txt"\nmax_sessions = 16\nmodel_name = "tiny"\n'
    )
    return spec, key


@pytest.fixture(scope="module")
def swarm(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Swarm]:
    model_dir = tiny_checkpoint(seed=3, n_layers=4)
    tmp = tmp_path_factory.mktemp("api")
    spec, key = _write_spec(tmp, model_dir)
    items = [f"p:{p}" for p in PROMPTS] + [f"c:{c}" for c in CHATS]
    local = subprocess.Popen(
        [sys.executable, "-c", _LOCAL, str(model_dir), str(MAX_TOKENS), str(MAX_LEN), *items],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    log = (tmp / "swarm.log").open("wb")
    proc = subprocess.Popen(
        [*SHARD, "swarm", "up", str(spec), "--api", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
        env=child_env(),
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
        try:
            up = next(
                line
                for line in iter(lambda: lines.get(timeout=START_S), None)
                if line.startswith("SHARD SWARM UP")
            )
        except queue.Empty:
            pytest.fail(f"no swarm after {START_S:g} s:\n{(tmp / 'swarm.log').read_text()[-3000:]}")
        fields = dict(part.split("=", 1) for part in up.split()[3:])
        out, _ = local.communicate(timeout=START_S)
        assert local.returncode == 0, "generate --local failed"
        records = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        refs = dict(zip(items, records, strict=True))
        stages = {"s0": "", "s1": ""}
        text = spec.read_text()
        for name in stages:
            block = text.split(f'name = "{name}"', 1)[1]
            stages[name] = block.split('listen = "', 1)[1].split('"', 1)[0]
        yield Swarm(
            api=fields["api"],
            key=key,
            model="tiny",
            stages=stages,
            pids={name: int(fields[name]) for name in stages},
            plain={p: refs[f"p:{p}"] for p in PROMPTS},
            chat={c: refs[f"c:{c}"] for c in CHATS},
        )
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=30)
        local.kill()
        log.close()


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def test_greedy_completions_equal_generate_local(swarm: Swarm) -> None:
    """Sync client: /v1/models, then plain and chat completions, token for token (usage)."""

    def run() -> None:
        client = swarm.client()
        assert [m.id for m in client.models.list()] == ["tiny"]
        for prompt, ref in swarm.plain.items():
            done = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert done.choices[0].text == ref["text"]
            assert done.choices[0].finish_reason == ref["finish_reason"]
            assert done.usage is not None
            assert done.usage.completion_tokens == len(ref["token_ids"])
        for content, ref in swarm.chat.items():
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": content}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            assert reply.choices[0].message.content == ref["text"]
            assert reply.choices[0].message.role == "assistant"
            assert reply.usage is not None
            assert reply.usage.completion_tokens == len(ref["token_ids"])
            assert reply.usage.total_tokens == reply.usage.prompt_tokens + len(ref["token_ids"])

    await in_thread(run)


async def test_streamed_chunks_concatenate_to_the_same_text(swarm: Swarm) -> None:
    """Sync and async streams: role first, finish_reason last, the usage chunk, same text."""
    content, ref = next(iter(swarm.chat.items()))
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def check(chunks: list[Any]) -> None:
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref["text"]
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishing) == 1 and finishing[0] is chunks[-2]
        assert finishing[0].choices[0].finish_reason == ref["finish_reason"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
            ref["token_ids"]
        )

    check(await in_thread(lambda: list(swarm.client().chat.completions.create(**kwargs))))
    client = swarm.async_client()
    stream = await client.chat.completions.create(**kwargs)
    check([chunk async for chunk in stream])
    prompt, plain = next(iter(swarm.plain.items()))
    pieces = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in pieces]) == plain["text"]


async def test_seeded_sampling_is_reproducible_and_stops_cut_text(swarm: Swarm) -> None:
    """The same seed gives the same sample (top_k via extra_body); a stop string cuts the
    greedy text right before it, with finish_reason stop."""
    client = swarm.async_client()
    prompt, ref = next(iter(swarm.plain.items()))

    async def sample(seed: int) -> str:
        done = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            top_p=0.95,
            seed=seed,
            extra_body={"top_k": 20},
        )
        return done.choices[0].text

    first = await sample(7)
    assert await sample(7) == first
    stop = ref["text"][4:6]
    cut = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == ref["text"][: ref["text"].find(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_errors_through_the_openai_client(swarm: Swarm) -> None:
    """No or a wrong key: 401; unknown model: 404; n=2 and huge max_tokens: 400 naming the
    parameter; a prompt longer than the context: 413."""
    messages = [{"role": "user", "content": "hi"}]
    anonymous = openai.AsyncOpenAI(base_url=f"{swarm.api}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await anonymous.models.list()
    client = swarm.async_client()
    with pytest.raises(openai.NotFoundError, match="tiny"):
        await client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=messages, n=2)
    assert bad.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10**9)
    with pytest.raises(openai.APIStatusError) as long:
        await client.completions.create(model="tiny", prompt="word " * 400, max_tokens=1)
    assert long.value.status_code == 413


class StageWatch:
    """Every stage's ``StageReport`` feed: ``wait(pred)`` returns once all stages satisfy it."""

    def __init__(self, names: list[str]) -> None:
        self.latest: dict[str, StageReport] = {}
        self._names = names
        self._changed = trio.Event()

    async def follow(self, network: WebSocketNetwork, name: str, address: str) -> None:
        hello = Hello(node=NodeName("test-monitor"), role="monitor", swarm="api")
        conn = await dial_peer(network, address, hello, timeout_s=10)
        while True:
            msg = await conn.receive()
            assert isinstance(msg, StageReport)
            self.latest[name] = msg
            self._changed.set()
            self._changed = trio.Event()

    async def wait(self, pred: Callable[[StageReport], bool]) -> None:
        while not (len(self.latest) == len(self._names) and all(map(pred, self.latest.values()))):
            await self._changed.wait()


async def test_a_disconnect_mid_stream_frees_every_stage_within_a_second(swarm: Swarm) -> None:
    """A client that closes its stream mid-reply: each stage's session count drops to 0
    within one second (the stages' own statistics, over their monitor feed)."""
    watch = StageWatch(list(swarm.stages))
    async with WebSocketNetwork() as network, trio.open_nursery() as nursery:
        for name, address in swarm.stages.items():
            nursery.start_soon(watch.follow, network, name, address)
        with trio.fail_after(20):
            await watch.wait(lambda r: r.sessions == 0)
        client = swarm.async_client()
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "tell me everything"}],
            max_tokens=MAX_LEN - 64,
            temperature=0.8,
            stream=True,
        )
        with trio.fail_after(20):
            pieces = stream.__aiter__()
            await pieces.__anext__()  # role
            await pieces.__anext__()  # first text: the session holds KV on every stage
            await watch.wait(lambda r: r.sessions == 1)
        await stream.close()
        with trio.fail_after(1.0):
            await watch.wait(lambda r: r.sessions == 0)
        nursery.cancel_scope.cancel()


async def test_sixteen_streams_complete_and_the_seventeenth_gets_429(swarm: Swarm) -> None:
    """16 concurrent streams are admitted (stage 0 is held stopped meanwhile, so all 16 are
    in flight at once), the 17th is refused with 429, and all 16 finish with the right text."""
    client = swarm.async_client()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    streams: list[Any] = []
    texts: list[str] = [""] * 16
    os.kill(swarm.pids["s0"], signal.SIGSTOP)
    try:
        with trio.fail_after(30):
            for prompt in prompts:
                stream = await client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                streams.append(stream)
            with pytest.raises(openai.RateLimitError) as busy:
                await client.completions.create(model="tiny", prompt="x", max_tokens=1)
            assert busy.value.response.headers["retry-after"] == "1"
    finally:
        os.kill(swarm.pids["s0"], signal.SIGCONT)

    async def drain(i: int) -> None:
        async for chunk in streams[i]:
            texts[i] += chunk.choices[0].text

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(drain, i)
    assert texts == [swarm.plain[p]["text"] for p in prompts]
    metrics = await in_thread(lambda: _get(f"{swarm.api}/metrics", swarm.key))
    assert "shard_api_rejected_busy_total 1" in metrics
    assert 'shard_api_requests_total{endpoint="/v1/completions",status="429"} 1' in metrics


def _get(url: str, key: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as r:  # loopback only
        return r.read().decode()


async def test_health_reports_a_ready_ring(swarm: Swarm) -> None:
    """``/health`` needs no key and says the ring is ready."""
    health = json.loads(await in_thread(lambda: _get(f"{swarm.api}/health")))
    assert health == {"status": "ok", "ready": True, "reason": None}


async def test_the_chat_page_streams_a_reply_in_a_real_browser(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Headless Chromium opens the page, the test types a message and presses Enter; the
    reply arrives in several pieces, equals the API's greedy reply, and shows tok/s."""
    content, ref = next(iter(swarm.chat.items()))
    async with Browser(chromium_path(), tmp_path) as browser:
        page = await browser.open(f"{swarm.api}/")
        await page.evaluate(f"localStorage.setItem('shard-api-key', {json.dumps(swarm.key)})")
        await page.navigate(f"{swarm.api}/")
        await page.wait_for("document.getElementById('status').textContent.startsWith('model')")
        await page.evaluate(f"document.getElementById('max-tokens').value = {MAX_TOKENS}")
        await page.evaluate(
            "window.__reply = new Promise(r => document.addEventListener("
            "'shard-reply', e => r(e.detail), {once: true}))"
        )
        await page.click("#input")
        await page.type_text(content)
        await page.press_enter()
        with trio.fail_after(60):
            detail = await page.evaluate("window.__reply", await_promise=True)
        assert detail["finish"] != "error", detail
        assert detail["text"] == ref["text"]
        assert detail["chunks"] >= 2  # streamed, not delivered whole
        shown = await page.evaluate("document.querySelector('.assistant .stats').textContent")
        assert "tok/s" in shown and "acceptance" in shown


async def test_the_page_offers_plain_completion_for_a_base_model(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Where ``/v1/models`` says the model has no chat template (a base model; here the
    answer is rewritten in the browser, the rest is the real swarm), the page says so and
    continues the typed text through ``/v1/completions``: the plain API's greedy reply."""
    models = json.loads(await in_thread(lambda: _get(f"{swarm.api}/v1/models", swarm.key)))
    assert models["data"][0]["shard"] == {"chat_template": True}  # the tiny model has one
    prompt, ref = next(iter(swarm.plain.items()))
    async with Browser(chromium_path(), tmp_path) as browser:
        page = await browser.open(f"{swarm.api}/")
        await page.evaluate(f"localStorage.setItem('shard-api-key', {json.dumps(swarm.key)})")
        await page.navigate(f"{swarm.api}/")
        await page.wait_for("document.getElementById('status').textContent.startsWith('model')")
        await page.evaluate(
            "const real = window.fetch; window.fetch = async (url, init) => {"
            " const r = await real(url, init); if (url !== '/v1/models') return r;"
            " const body = await r.json(); body.data[0].shard.chat_template = false;"
            " return new Response(JSON.stringify(body), {status: r.status}); }; loadModel()",
            await_promise=True,
        )
        await page.wait_for("document.getElementById('status').textContent.includes('plain')")
        await page.evaluate(f"document.getElementById('max-tokens').value = {MAX_TOKENS}")
        await page.evaluate(
            "window.__reply = new Promise(r => document.addEventListener("
            "'shard-reply', e => r(e.detail), {once: true}))"
        )
        await page.click("#input")
        await page.type_text(prompt)
        await page.press_enter()
        with trio.fail_after(60):
            detail = await page.evaluate("window.__reply", await_promise=True)
        assert detail["finish"] != "error", detail
        assert detail["text"] == ref["text"]
