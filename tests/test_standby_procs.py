"""A standby coordinator under ``shard swarm up``, with real processes: the primary coordinator
is SIGKILLed mid-request and the clients get the rest of their output from the standby.

The spec names a ``[coordinator] standby`` (and its ``standby_api``), so the launcher starts a
standby coordinator process that follows the primary. Latency on every ring edge (``[links]``)
keeps the request running for seconds, and the primary is killed by PID only once each client
has shown some output: so the kill lands mid-request. Processes run in their own session and
are killed by PID on every way out (``tests/procs.py``); every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from procs import (
    LOOPBACK,
    Finished,
    LineReader,
    alive,
    free_ports,
    orphans,
    run_shard,
    started_shard,
)

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea and the sea runs to the river"
MAX_TOKENS = 40
RUN_S = 180.0
LATENCY_MS = 40.0  # per edge, one way: >= 0.16 s a token, a request of several seconds


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=5, n_layers=6)


def standby_spec(path: Path, model_dir: Path) -> tuple[Path, dict[str, str]]:
    """Three stages, a primary coordinator with an HTTP API and a standby coordinator with
    its own; returns the spec and its addresses by role."""
    ports = free_ports(7)
    where = {
        "coord": f"{LOOPBACK}:{ports[0]}",
        "standby": f"{LOOPBACK}:{ports[1]}",
        "api": f"{LOOPBACK}:{ports[2]}",
        "standby_api": f"{LOOPBACK}:{ports[3]}",
    }
    lines = [
        "[swarm]",
        'name = "standby-test"',
        f"model = {json.dumps(str(model_dir))}",
        "insecure = true",
        "[limits]",
        "max_len = 256",
        "connect_timeout_s = 10.0",
        "[coordinator]",
        'name = "coord"',
        f'listen = "{where["coord"]}"',
        f'standby = "{where["standby"]}"',
        f'standby_api = "{where["standby_api"]}"',
    ]
    for i in range(3):
        lines += ["[[stage]]", f'name = "s{i}"', f'listen = "{LOOPBACK}:{ports[4 + i]}"']
        lines.append(f"layers = [{2 * i}, {2 * i + 2}]")
    lines += ["[failover]", "dead_after_s = 1.0"]
    lines += ["[links]", f"latency_ms = {LATENCY_MS!r}"]
    lines += ["[api]", f'listen = "{where["api"]}"', 'model_name = "tiny"']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, where


async def local_reference(model_dir: Path, *json: str) -> Finished:
    """``shard generate --local [--json]`` of PROMPT: the uninterrupted run."""
    done = await run_shard(
        "generate",
        "--local",
        *json,
        "--model",
        str(model_dir),
        "--max-tokens",
        str(MAX_TOKENS),
        "--max-len",
        "256",
        PROMPT,
        timeout_s=RUN_S,
    )
    assert done.returncode == 0, done.describe()
    return done


class Sse:
    """A streamed completion read with a raw HTTP/1.1 client: the status, the headers and
    the events (the JSON of each ``data:`` line; ``"[DONE]"`` as is)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._raw = b""
        self._body = b""
        self.status = 0
        self.headers: dict[str, str] = {}

    async def _more(self) -> bool:
        try:
            chunk = await self._stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset: the coordinator was killed
            chunk = b""
        self._raw += chunk
        return bool(chunk)

    async def head(self) -> None:
        while b"\r\n\r\n" not in self._raw:
            if not await self._more():
                raise EOFError(f"no response head: {self._raw!r}")
        head, self._raw = self._raw.split(b"\r\n\r\n", 1)
        status, *fields = head.decode().split("\r\n")
        self.status = int(status.split()[1])
        self.headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}

    def _dechunk(self) -> None:
        while b"\r\n" in self._raw:
            size_line, rest = self._raw.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            if len(rest) < size + 2:
                return
            self._body += rest[:size]
            self._raw = rest[size + 2 :]

    async def event(self) -> Any:
        """The next event; None when the connection ended first."""
        while True:
            self._dechunk()
            if b"\n\n" in self._body:
                event, self._body = self._body.split(b"\n\n", 1)
                data = event.decode().removeprefix("data: ")
                return data if data == "[DONE]" else json.loads(data)
            if not await self._more():
                return None


async def post_stream(address: str, body: dict[str, Any], headers: dict[str, str]) -> Sse:
    """POST /v1/completions (streamed) to ``address``; the reply with its head read."""
    host, port = address.split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    data = json.dumps(body).encode()
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {address}", "Connection: close"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    await stream.send_all("\r\n".join(lines).encode() + b"\r\n\r\n" + data)
    reply = Sse(stream)
    await reply.head()
    return reply


async def read_text(reply: Sse, text: list[str], have: list[int], *, until: int = 0) -> bool:
    """Read ``reply``'s events into ``text`` (and the last token count into ``have``), up to
    ``until`` text chunks (0: to the end); whether ``[DONE]`` came."""
    seen = 0
    while (event := await reply.event()) is not None:
        if event == "[DONE]":
            return True
        assert "error" not in event, event
        if event["choices"] and event["choices"][0]["text"]:
            text.append(event["choices"][0]["text"])
            if "shard" in event:  # not on the decoder's tail, sent at the end
                have.append(event["shard"]["tokens"])
            seen += 1
            if seen == until:
                return False
    return False


async def resumed(address: str, body: dict[str, Any], key: str, have: int) -> Sse:
    """The same request re-issued to the standby's API with ``X-Shard-Resume: KEY:N``, once
    it serves (its API starts at the takeover; 503 until its ring is back)."""
    with trio.fail_after(60):
        while True:
            try:
                reply = await post_stream(address, body, {"X-Shard-Resume": f"{key}:{have}"})
            except OSError:  # not listening yet: the takeover is under way
                reply = None
            if reply is not None and reply.status != 503:
                return reply
            await trio.sleep(0.2)  # another process's state: nothing to wait on but time


async def test_the_cli_and_a_stream_get_their_whole_output_when_the_primary_is_killed(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`swarm up` with a standby coordinator: SIGKILL the primary while `shard generate
    --spec` and a streamed API request are mid-request. The launcher reports the exit and
    keeps the swarm; the standby takes over; the CLI's output equals the uninterrupted run's,
    and so does the stream's text, read from the primary and then from the standby's API
    re-issued with ``X-Shard-Resume``."""
    (reference,) = (await local_reference(llama_dir, "--json")).json_records()
    printed = (await local_reference(llama_dir)).stdout  # the CLI prints no decoder tail
    # Its ports picked last, just before the launcher binds them: free a moment ago.
    spec, where = standby_spec(tmp_path / "standby.toml", llama_dir)
    log = tmp_path / "launcher.log"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["stream"] = True
    async with started_shard("swarm", "up", str(spec), stderr_path=log) as launcher:
        stdout = LineReader(launcher.stdout, log)
        with trio.fail_after(RUN_S):
            up = await stdout.line_starting("SHARD SWARM UP")
        fields = dict(part.split("=", 1) for part in up.split()[3:])
        pids = {
            name: int(pid) for name, pid in fields.items() if name not in ("coordinator", "api")
        }
        assert set(pids) == {"coord", "coord/standby", "s0", "s1", "s2"}, up
        args = ("generate", "--spec", str(spec), "--max-tokens", str(MAX_TOKENS), PROMPT)
        async with started_shard(*args, stderr_path=tmp_path / "client.log") as client:
            assert client.stdout is not None
            out = bytearray()
            text: list[str] = []
            have: list[int] = []
            with trio.fail_after(60):  # both under way: the kill lands mid-request
                while not out.strip():  # the CLI first: its start (imports) is the slow one
                    out += await client.stdout.receive_some(65536)
                stream = await post_stream(where["api"], body, {})
                assert stream.status == 200
                key = stream.headers["x-shard-resume-key"]
                assert not await read_text(stream, text, have, until=2)
            os.kill(pids["coord"], signal.SIGKILL)
            before = out.decode(errors="replace")
            with trio.fail_after(30):  # the stream ends with the primary, short of [DONE]
                assert not await read_text(stream, text, have)
            cut = "".join(text)
            again = await resumed(where["standby_api"], body, key, have[-1])
            assert again.status == 200, again.headers
            assert again.headers["x-shard-resume-key"] == key
            with trio.fail_after(RUN_S):
                assert await read_text(again, text, have)
                async for chunk in client.stdout:
                    out += chunk
                code = await client.wait()
        client_log = (tmp_path / "client.log").read_text()
        assert code == 0, client_log[-3000:] + log.read_text()[-3000:]
        assert out.decode() == printed, log.read_text()[-3000:]
        assert len(before) < len(reference["text"]), f"killed after the end: {before!r}"
        assert "".join(text) == reference["text"], (cut, log.read_text()[-3000:])
        assert len(cut) < len(reference["text"]), f"stream cut after the end: {cut!r}"
        assert have == sorted(have) and have[-1] <= len(reference["token_ids"]), have
        assert "standby coordinator: took over" in log.read_text(), log.read_text()[-3000:]
        with trio.fail_after(30):
            exited = await stdout.line_starting("SHARD NODE EXITED")
        assert exited == f"SHARD NODE EXITED node=coord pid={pids['coord']} code=-9"
        assert launcher.returncode is None, "swarm up ended when the primary coordinator died"
        others = {name: pid for name, pid in pids.items() if name != "coord"}
        assert all(alive(pid) for pid in others.values())
        launcher.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            code = await launcher.wait()
        left = [name for name, pid in others.items() if alive(pid)]
        assert left == [], f"still running after the launcher exited: {left}"
        assert orphans() == []
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
