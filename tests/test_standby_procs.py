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

import pytest
import trio

from procs import LOOPBACK, LineReader, alive, free_ports, orphans, run_shard, started_shard

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea and the sea runs to the river"
MAX_TOKENS = 40
RUN_S = 180.0
LATENCY_MS = 25.0  # per edge, one way: ~0.1 s a token, a request of several seconds


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
    lines += ["[api]", f'listen = "{where["api"]}"']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, where


async def local_text(model_dir: Path) -> str:
    """``shard generate --local`` of PROMPT: what it prints (the uninterrupted run)."""
    done = await run_shard(
        "generate",
        "--local",
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
    return done.stdout


async def test_the_cli_gets_its_whole_output_when_the_primary_coordinator_is_killed(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`swarm up` with a standby coordinator: SIGKILL the primary while `shard generate
    --spec` is mid-request; the launcher reports the exit and keeps the swarm, the standby
    takes over, and the client's output equals the uninterrupted run's."""
    spec, _ = standby_spec(tmp_path / "standby.toml", llama_dir)
    reference = await local_text(llama_dir)
    log = tmp_path / "launcher.log"
    async with started_shard("swarm", "up", str(spec), stderr_path=log) as launcher:
        stdout = LineReader(launcher.stdout)
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
            with trio.fail_after(60):  # some output: the request is running
                while not out.strip():
                    out += await client.stdout.receive_some(65536)
            os.kill(pids["coord"], signal.SIGKILL)
            before = out.decode(errors="replace")
            with trio.fail_after(RUN_S):
                async for chunk in client.stdout:
                    out += chunk
                code = await client.wait()
        client_log = (tmp_path / "client.log").read_text()
        assert code == 0, client_log[-3000:] + log.read_text()[-3000:]
        assert out.decode() == reference, log.read_text()[-3000:]
        assert len(before) < len(reference.rstrip()), f"killed after the end: {before!r}"
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
