"""Hostile requests against a live swarm (issue 29's first "done when"): a Hypothesis property
over every field of the API's request bodies (completions and chat) and of the wire
``GenerateRequest``, with integers past 2**64, floats past 1e308, NaN, wrong types and
nesting. Every request gets a 4xx in the OpenAI error shape, or on the wire a ``GenerateDone``
with ``finish_reason="error"`` (numbers the wire carries but the table of bounds refuses) or
its connection closed 1008 (a frame the wire refuses); no node exits; and an honest request
afterwards equals the single-process reference (``shard generate --local``), token for token.

The swarm (a coordinator with its API and two stages, ``shard.nodes.coordinator``'s roots
on WebSockets) runs in its own Trio loop in a thread for the whole module; each example's
client runs in that loop (``trio.from_thread.run``). A node that raises ends that loop, and a
node that returns is recorded: either fails the test.

Charter: 127.0.0.1 only, free ports; every exchange under a deadline; the Hypothesis seed is
printed (``SHARD_PROPERTY_SEED`` replays one); ~100 examples in a few seconds once up.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from procs import LOOPBACK, free_ports
from shard.decode.reference import generate_reference
from shard.messages import GenerateDone, GenerateRequest, Hello, NodeName, TokensOut, Welcome
from shard.messages.bounds import BOUNDS, INT64_MAX, INT64_MIN
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.tokenizer import Tokenizer
from shard.nodes.coordinator import run_coordinator, run_stage
from shard.spec.swarm import SwarmSpec
from shard.transport import WebSocketNetwork
from shard.wire import decode, encode
from shard.wire.frame import PREFIX, WIRE_VERSION

pytestmark = pytest.mark.slow

SWARM = "hostile"
MODEL = "tiny"
MAX_LEN = 256
START_S = 120.0
EXCHANGE_S = 30.0
PROPERTY_SEED = int(os.environ.get("SHARD_PROPERTY_SEED", "29"))
HONEST = "The capital of France is"
HONEST_TOKENS = 8
#: Issue 29's request: a top_k past int64 passed the schema and killed the coordinator.
ISSUE_29 = b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808}'


# --- the live swarm, in a thread ------------------------------------------------------------


@attrs.define
class Live:
    """The running swarm: its API and client addresses, its loop, and what went wrong."""

    api: tuple[str, int] = ("", 0)
    client: str = ""
    token: trio.lowlevel.TrioToken | None = None
    stop: trio.CancelScope | None = None
    exits: list[str] = attrs.field(factory=list)
    failure: BaseException | None = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run the async ``fn`` in the swarm's loop (each call under ``EXCHANGE_S``)."""
        assert self.failure is None, f"the swarm's loop ended: {self.failure!r}"

        async def bounded() -> Any:
            with trio.fail_after(EXCHANGE_S):
                return await fn()

        return trio.from_thread.run(bounded, trio_token=self.token)


def swarm_spec(model_dir: Path) -> SwarmSpec:
    coord, s0, s1 = free_ports(3)
    return SwarmSpec.from_dict(
        {
            "swarm": {"name": SWARM, "model": str(model_dir), "insecure": True},
            "limits": {"max_len": MAX_LEN, "max_sessions": 16, "connect_timeout_s": 5.0},
            "failover": {"dead_after_s": 30.0},
            "coordinator": {"name": "coord", "listen": f"{LOOPBACK}:{coord}"},
            "api": {"listen": f"{LOOPBACK}:0", "model_name": MODEL},
            "stage": [
                {"name": "s0", "listen": f"{LOOPBACK}:{s0}", "layers": [0, 2]},
                {"name": "s1", "listen": f"{LOOPBACK}:{s1}", "layers": [2, 4]},
            ],
        },
        source="hostile.toml",
    )


def _serve(spec: SwarmSpec, model_dir: Path, live: Live, ready: threading.Event) -> None:
    async def node(name: str, run: Any, *, task_status: trio.TaskStatus[Any]) -> None:
        await run(task_status=task_status)
        live.exits.append(name)  # a node that returns has stopped serving

    async def main() -> None:
        network = WebSocketNetwork(connect_timeout_s=5.0)
        async with network, trio.open_nursery() as nursery:
            live.token, live.stop = trio.lowlevel.current_trio_token(), nursery.cancel_scope
            handles: dict[str, Any] = {}

            async def start(name: str, run: Any) -> None:
                handles[name] = await nursery.start(partial(node, name, run))

            async with trio.open_nursery() as starting:
                for stage in spec.stages:
                    run = partial(run_stage, spec, stage.name, network=network)
                    starting.start_soon(start, stage.name, partial(run, model_dir=model_dir))
                run = partial(run_coordinator, spec, network=network, model_dir=model_dir)
                starting.start_soon(start, "coord", run)
            host, port = handles["coord"].api.removeprefix("http://").rsplit(":", 1)
            live.api, live.client = (host, int(port)), handles["coord"].address
            ready.set()

    try:
        trio.run(main)
    except BaseException as exc:  # reported by the test, not swallowed
        live.failure = exc
    finally:
        ready.set()


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=3, n_layers=4)


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    live = Live()
    ready = threading.Event()
    thread = threading.Thread(
        target=_serve, args=(swarm_spec(model_dir), model_dir, live, ready), daemon=True
    )
    thread.start()
    assert ready.wait(START_S), f"no swarm after {START_S:g} s"
    assert live.failure is None, f"the swarm failed to start: {live.failure!r}"
    try:
        yield live
    finally:
        if live.token is not None and live.stop is not None and live.failure is None:
            trio.from_thread.run_sync(live.stop.cancel, trio_token=live.token)
        thread.join(timeout=30)


# --- the clients ------------------------------------------------------------------------------


@attrs.frozen
class Http:
    """One HTTP request: a path and its raw body."""

    path: str
    body: bytes


@attrs.frozen
class Wire:
    """One wire request: a ``GenerateRequest`` header tree, possibly one no encoder makes."""

    tree: dict[str, Any]


async def http(address: tuple[str, int], path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` with Connection: close; the status and body once the server closes."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(head.encode() + body)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    status_line, _, rest = bytes(data).partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def frame(tree: dict[str, Any]) -> bytes:
    """A wire frame of ``tree`` as msgpack: what a hostile client sends (no value checks)."""
    header = msgpack.packb(tree, use_bin_type=True)
    return PREFIX.pack(WIRE_VERSION, 0, len(header)) + header


async def wire(address: str, tree: dict[str, Any]) -> str:
    """Send ``tree`` on a client link: "done-error", "closed-1008", or what went wrong."""
    host, _, port = address.rpartition(":")
    async with await trio.open_tcp_stream(host, int(port)) as tcp, trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(nursery, tcp, address, "/")
        await ws.send_message(encode(Hello(NodeName("fuzzer"), "client", SWARM)))
        welcome = decode(await ws.get_message())  # type: ignore[arg-type]
        assert isinstance(welcome, Welcome), welcome
        await ws.send_message(frame(tree))
        try:
            reply = decode(await ws.get_message())  # type: ignore[arg-type]
        except trio_websocket.ConnectionClosed as closed:
            return f"closed-{closed.reason.code if closed.reason else None}"
        finally:
            nursery.cancel_scope.cancel()
        if isinstance(reply, GenerateDone) and reply.finish_reason == "error":
            return "done-error"
        if isinstance(reply, TokensOut):
            return f"generated: {reply}"
        return f"unexpected {reply!r}"


# --- the hostile values -----------------------------------------------------------------------

#: JSON text Python's json cannot write: a number past float range (parsed as inf).
_RAW = {"__raw_1e309__": "1e309", "__raw_-1e309__": "-1e309"}
RAW_BIG = st.sampled_from(sorted(_RAW))
SURROGATE = "a\ud800b"


def to_json(body: object) -> bytes:
    text = json.dumps(body)
    for marker, raw in _RAW.items():
        text = text.replace(json.dumps(marker), raw)
    return text.encode()


#: Integers msgpack can pack (what a wire client can send at all).
PACKABLE = st.integers(min_value=INT64_MIN, max_value=(1 << 64) - 1)


def nested(depth: int = 3, ints: st.SearchStrategy[int] = PACKABLE) -> st.SearchStrategy[Any]:
    """JSON-like nesting (its integers packable: the API gets bigger ones elsewhere)."""
    leaves = st.one_of(ints, st.floats(), st.text(max_size=5), st.none())
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=depth * 3,
    )


def wrong_type(*, allow_bool: bool = True) -> st.SearchStrategy[Any]:
    """Values of no numeric type a field takes: text, containers, nesting (and bools)."""
    kinds = [
        st.text(max_size=8),
        st.lists(nested(), min_size=0, max_size=3),
        st.dictionaries(st.text(max_size=4), nested(), max_size=3),
    ]
    if allow_bool:
        kinds.append(st.booleans())
    return st.one_of(*kinds)


def bad_int(field: str, low: int | None = None) -> st.SearchStrategy[Any]:
    """Anything the API must refuse for integer ``field``: past the table (to 2**200),
    non-integral or non-finite floats, 1e309, wrong types."""
    bound = BOUNDS[field]
    low = int(bound.low) if low is None else low
    high = int(bound.high)
    return st.one_of(
        st.integers(min_value=high + 1, max_value=1 << 200),
        st.integers(min_value=-(1 << 200), max_value=low - 1),
        st.sampled_from([1 << 63, 1 << 64, (1 << 64) + 1, -(1 << 63) - 1]).filter(
            lambda v: not low <= v <= high
        ),
        st.floats().filter(lambda f: not (f.is_integer() and low <= f <= high)),
        RAW_BIG,
        wrong_type(),
    )


def bad_number(field: str) -> st.SearchStrategy[Any]:
    bound = BOUNDS[field]
    return st.one_of(
        st.floats().filter(lambda f: not bound.holds(f)),
        st.sampled_from([math.nan, math.inf, -math.inf, 1e308 * 10, -0.0, 1e-320 * -1]).filter(
            lambda f: not bound.holds(f)
        ),
        st.integers(min_value=-(1 << 70), max_value=1 << 70).filter(lambda i: not bound.holds(i)),
        RAW_BIG,
        wrong_type(),
    )


def bad_stop() -> st.SearchStrategy[Any]:
    word = st.text(min_size=1, max_size=3)
    return st.one_of(
        st.lists(word, min_size=17, max_size=24, unique=True),
        st.just([""]),
        st.just(["x" * 257]),
        st.just([SURROGATE]),
        st.lists(st.one_of(st.integers(), st.none(), st.lists(word)), min_size=1, max_size=3),
        st.integers(),
        st.floats(),
        st.dictionaries(st.text(max_size=3), word, min_size=0, max_size=2),
    )


def bad_prompt(vocab: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(""),
        st.just(SURROGATE),
        st.just("word " * 400),  # past the context: a 413
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.lists(st.integers(min_value=vocab, max_value=1 << 100), min_size=1, max_size=3),
        st.lists(st.text(min_size=1, max_size=3), min_size=2, max_size=3),  # two prompts
        st.just([[1, [2]]]),
        st.integers(),
        st.floats(),
        st.dictionaries(st.text(max_size=3), nested(), max_size=2),
        st.none(),
    )


def bad_messages() -> st.SearchStrategy[Any]:
    user = {"role": "user"}
    return st.one_of(
        st.just([]),
        st.lists(st.integers(), min_size=1, max_size=2),
        st.just([{"role": "tool", "content": "x"}]),
        st.just([{**user, "content": SURROGATE}]),
        st.just([{**user, "content": [{"type": "text", "text": SURROGATE}]}]),
        st.just([{**user, "content": [{"type": "image_url"}]}]),
        st.just([{**user, "content": "x", "tool_calls": []}]),
        st.just([{**user, "content": "word " * 400}]),
        st.builds(lambda v: [{**user, "content": v}], st.one_of(st.integers(), st.floats())),
        nested(),
        st.none(),
    )


def fields(chat: bool, vocab: int) -> dict[str, st.SearchStrategy[Any]]:
    """Every field of the body, each with values it must refuse."""
    common: dict[str, st.SearchStrategy[Any]] = {
        "model": st.one_of(
            st.integers(), st.none(), st.just(""), st.text().filter(lambda s: s != MODEL)
        ),
        "max_tokens": st.one_of(
            bad_int("max_tokens"), st.integers(MAX_LEN, BOUNDS["max_tokens"].high)
        ),
        "max_completion_tokens": bad_int("max_tokens"),
        "temperature": bad_number("temperature"),
        "top_p": bad_number("top_p"),
        "top_k": bad_int("top_k", low=-1),
        "seed": bad_int("seed"),
        "stop": bad_stop(),
        "stream": st.one_of(st.integers(), st.text(max_size=4), st.floats(), st.lists(nested())),
        "stream_options": st.one_of(
            st.just({"include_usage": True}), st.just({"include_usage": 1}), nested()
        ).filter(lambda v: v is not None),
        "user": st.one_of(st.integers(), st.floats(), st.lists(nested())),
        "n": st.one_of(st.integers().filter(lambda v: v != 1), st.floats(), RAW_BIG),
        "best_of": st.integers(min_value=2, max_value=1 << 70),
        "logprobs": st.one_of(st.integers(), st.just(True)),
        "top_logprobs": st.integers().filter(lambda v: v != 0),
        "presence_penalty": st.floats().filter(lambda v: v != 0),
        "logit_bias": st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), min_size=1),
        "tools": st.lists(nested(), min_size=1, max_size=2),
        "unknown": st.text(min_size=1, max_size=10),  # an unknown key (drawn as its name)
    }
    if chat:
        common["messages"] = bad_messages()
    else:
        common["prompt"] = bad_prompt(vocab)
    return common


_KNOWN = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stream", "stream_options", "user", "n", "best_of", "logprobs", "top_logprobs",
    "presence_penalty", "logit_bias", "tools", "messages", "prompt", "frequency_penalty",
    "echo", "suffix", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "modalities", "audio", "prediction", "store", "metadata",
    "reasoning_effort", "web_search_options", "service_tier",
}  # fmt: skip


@st.composite
def http_case(draw: st.DrawFn, vocab: int) -> Http:
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if draw(st.integers(0, 9)) == 0:  # not an object at all, or not JSON
        body = draw(
            st.one_of(
                st.builds(to_json, st.one_of(st.lists(nested()), st.integers(), st.text())),
                st.just(b"[" * 5000 + b"]" * 5000),
                st.just(b'{"model": "tiny", "prompt": '),
                st.binary(max_size=20),
            )
        )
        return Http(path, body)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    options = fields(chat, vocab)
    names = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True))
    for name in names:
        value = draw(options[name])
        if name == "unknown":
            body[value if value not in _KNOWN else value + "_"] = 1
        else:
            body[name] = value
    return Http(path, to_json(body))


def _wire_int(field: str) -> st.SearchStrategy[Any]:
    """Ints msgpack can carry (int64 and uint64) but the table refuses, and wrong types."""
    bound = BOUNDS[field]
    # Past the table yet inside int64: decodes, then refused by the coordinator's bounds.
    decodes = st.integers(min_value=min(int(bound.high) + 1, INT64_MAX), max_value=INT64_MAX)
    return st.one_of(
        decodes.filter(lambda v: not bound.holds(v)),
        st.integers(min_value=INT64_MIN, max_value=(1 << 64) - 1).filter(
            lambda v: not bound.holds(v)
        ),
        st.sampled_from([INT64_MAX, INT64_MAX + 1, (1 << 64) - 1, INT64_MIN]).filter(
            lambda v: not bound.holds(v)
        ),
        st.floats(),
        wrong_type(),
        st.none(),
    )


def _wire_float(field: str) -> st.SearchStrategy[Any]:
    bound = BOUNDS[field]
    return st.one_of(
        st.floats().filter(lambda f: not bound.holds(f)),
        st.integers(min_value=-(1 << 62), max_value=1 << 62).filter(lambda i: not bound.holds(i)),
        wrong_type(),
    )


@st.composite
def wire_case(draw: st.DrawFn) -> Wire:
    sampling: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    tree: dict[str, Any] = {"t": "GenerateRequest", "request": 1, "prompt": "hi"}
    tree.update(max_tokens=4, sampling=sampling)
    top = {
        "request": _wire_int("request"),
        "max_tokens": _wire_int("max_tokens"),
        "k": _wire_int("k"),
        "depth": _wire_int("depth"),
        "prompt": st.one_of(
            st.just("x" * 300_000),  # past limits.max_prompt_bytes
            PACKABLE,
            st.binary(max_size=4),
            st.lists(nested(), max_size=3),
            st.dictionaries(st.text(max_size=3), nested(), max_size=2),
        ),
        "chat": st.one_of(PACKABLE, st.text(max_size=3), st.lists(nested())),
        "ignore_eos": st.one_of(PACKABLE, st.floats()),
        "receipt": st.one_of(PACKABLE, st.text(max_size=3), st.none()),
        "sampling": st.one_of(st.lists(nested()), PACKABLE, st.text(max_size=3)),
        "extra": PACKABLE,
    }
    inner = {
        "temperature": _wire_float("temperature"),
        "top_p": _wire_float("top_p"),
        "top_k": _wire_int("top_k"),
        "seed": st.one_of(
            st.integers(min_value=INT64_MAX + 1, max_value=(1 << 64) - 1), st.floats(), wrong_type()
        ),
        "bogus": PACKABLE,
    }
    options = sorted(top) + [f"sampling.{k}" for k in sorted(inner)]
    names = draw(st.lists(st.sampled_from(options), min_size=1, max_size=3, unique=True))
    for name in names:
        if name.startswith("sampling."):
            key = name.removeprefix("sampling.")
            if isinstance(tree["sampling"], dict):
                tree["sampling"][key] = draw(inner[key])
        else:
            tree[name] = draw(top[name])
    return Wire(tree)


# --- the property -----------------------------------------------------------------------------


def reference(model_dir: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """``shard generate --local``'s ids for the honest prompt: the whole model here."""
    config = ModelConfig.from_dir(model_dir)
    model = load_stage(model_dir, 0, config.n_layers)
    result = generate_reference(
        model,
        tokenizer.encode(HONEST),
        max_tokens=HONEST_TOKENS,
        eos_ids=(*config.eos_token_ids, *tokenizer.eos_ids),
        max_len=MAX_LEN,
    )
    return result.token_ids


def test_hostile_requests_are_refused_and_the_swarm_serves_on(live: Live, model_dir: Path) -> None:
    """Every hostile request (HTTP or wire) is a 4xx, an error GenerateDone or a 1008 close;
    no node exits; then the honest request equals the reference over both doors."""
    tokenizer = Tokenizer.from_dir(model_dir)
    print(f"property seed: {PROPERTY_SEED} (replay with SHARD_PROPERTY_SEED={PROPERTY_SEED})")
    seen: dict[str, int] = {}

    @seed(PROPERTY_SEED)
    @settings(
        max_examples=int(os.environ.get("SHARD_PROPERTY_EXAMPLES", "100")),
        deadline=None,  # each exchange has its own (EXCHANGE_S)
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=st.one_of(http_case(tokenizer.vocab_size), wire_case()))
    @example(case=Http("/v1/completions", ISSUE_29))  # the request that ended a swarm
    def hostile(case: Http | Wire) -> None:
        if isinstance(case, Http):
            status, body = live.call(partial(http, live.api, case.path, case.body))
            assert 400 <= status < 500, (status, body[:300], case.body[:300])
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            outcome = f"http {status}"
        else:
            outcome = live.call(partial(wire, live.client, case.tree))
            assert outcome in ("done-error", "closed-1008"), (outcome, case.tree)
        seen[outcome] = seen.get(outcome, 0) + 1
        assert live.exits == [], f"nodes exited: {live.exits}"

    started = time.monotonic()
    hostile()
    took = time.monotonic() - started
    print(f"outcomes: {dict(sorted(seen.items()))} in {took:.1f} s")
    assert live.exits == [] and live.failure is None
    want = reference(model_dir, tokenizer)

    async def honest_wire() -> GenerateDone:
        from shard.coordinator.client import request

        req = GenerateRequest(7, HONEST, HONEST_TOKENS)
        async with WebSocketNetwork(connect_timeout_s=5.0) as network:
            return await request(network, live.client, req, swarm=SWARM)

    done = live.call(honest_wire)
    assert done.finish_reason != "error", done.error
    assert done.token_ids == want
    body = to_json(
        {"model": MODEL, "prompt": HONEST, "max_tokens": HONEST_TOKENS, "temperature": 0}
    )
    status, reply = live.call(partial(http, live.api, "/v1/completions", body))
    assert status == 200, reply
    assert json.loads(reply)["choices"][0]["text"] == tokenizer.decode(want)
