"""A swarm that forms itself, with real processes: a ``[formation]`` coordinator and three
tiny-model stages started with ``shard up --role stage --join`` only (no layer range
anywhere). Their memory allows two per ring, so the planner forms a two-stage ring and keeps
one standby; the output equals ``shard generate --local``. Then the ring's first stage is
SIGKILLed while a long request streams: the sticky re-plan gives only its layers to the
standby, the request completes with the same output, and so does the next one.

Loopback only; every process runs in its own session and is killed by PID on the way out
(``tests/procs.py``); every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from procs import LOOPBACK, LineReader, free_ports, run_shard, started_shard
from shard.model.config import ModelConfig
from shard.model.profile import weight_bytes

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea and the sea runs to the river"
LONG = 400  # tokens: still streaming when the kill lands
MAX_LEN = 512
RUN_S = 300.0
NODES = ("j0", "j1", "j2")
_STAGE = re.compile(r"(\S+) \[(\d+), (\d+)\)")


def formation_spec(path: Path, model_dir: Path, port: int) -> Path:
    """A coordinator on ``port`` expecting three joined nodes; the default (WAN) timings."""
    lines = [
        "[swarm]",
        'name = "join-test"',
        f"model = {json.dumps(str(model_dir))}",
        "insecure = true",
        "[limits]",
        f"max_len = {MAX_LEN}",
        "connect_timeout_s = 10.0",
        "[coordinator]",
        'name = "coord"',
        f'listen = "{LOOPBACK}:{port}"',
        "[formation]",
        "expect = 3",
        "wait_s = 240.0",
        "probes = 3",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def memory_gib(model_dir: Path) -> str:
    """Room for four of the six layers with the embedding or the head: one node cannot hold
    the model, two can."""
    layer, embedding, head = weight_bytes(ModelConfig.from_dir(model_dir), "float32")
    return repr((4 * layer + max(embedding, head) + 4096) / 2**30)


def ring_of(line: str) -> list[tuple[str, int, int]]:
    """``[(node, first, last), ...]`` of a logged ring ``coord -> a [0, 4) -> ... -> coord``."""
    return [(n, int(a), int(b)) for n, a, b in _STAGE.findall(line)]


async def local(model_dir: Path, *extra: str) -> str:
    done = await run_shard(
        "generate", "--local", "--model", str(model_dir), "--max-tokens", str(LONG),
        "--max-len", str(MAX_LEN), "--ignore-eos", *extra, PROMPT, timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    return done.stdout


async def test_joined_stages_form_a_ring_and_a_sigkill_moves_only_its_layers(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, report: Callable[[str], None]
) -> None:
    model_dir = tiny_checkpoint(seed=5, n_layers=6)
    (port,) = free_ports(1)
    spec = formation_spec(tmp_path / "formed.toml", model_dir, port)
    coord_log = tmp_path / "coord.err"
    reference_text = await local(model_dir)
    (reference,) = [json.loads(line) for line in (await local(model_dir, "--json")).splitlines()]
    pids: dict[str, int] = {}
    async with AsyncExitStack() as stack:
        coordinator = await stack.enter_async_context(
            started_shard(
                "up",
                "--role",
                "coordinator",
                "--spec",
                str(spec),
                "--model",
                str(model_dir),
                stderr_path=coord_log,
            )
        )
        for name in NODES:
            proc = await stack.enter_async_context(
                started_shard(
                    "up",
                    "--role",
                    "stage",
                    "--join",
                    f"{LOOPBACK}:{port}",
                    "--spec",
                    str(spec),
                    "--node",
                    name,
                    "--model",
                    str(model_dir),
                    "--memory-gib",
                    memory_gib(model_dir),
                    stderr_path=tmp_path / f"{name}.err",
                )
            )
            with trio.fail_after(RUN_S):
                line = await LineReader(proc.stdout).line_starting("SHARD READY")
            pids[name] = int(re.search(r"pid=(\d+)", line).group(1))  # type: ignore[union-attr]
        with trio.fail_after(RUN_S):  # ready once the ring formed and the tail dialled back
            await LineReader(coordinator.stdout).line_starting("SHARD READY")
        log = coord_log.read_text()
        formed = re.search(r"formed the ring (.+); standbys: (\S+);", log)
        assert formed is not None, log
        ring, standby = ring_of(formed.group(1)), formed.group(2)
        assert len(ring) == 2 and standby in NODES, f"expected two stages + a standby: {log}"
        victim, first, last = ring[0]

        # a long request streams; the first stage is SIGKILLed once tokens flow
        client = await stack.enter_async_context(
            started_shard(
                "generate",
                "--spec",
                str(spec),
                "--max-tokens",
                str(LONG),
                "--ignore-eos",
                PROMPT,
                stderr_path=tmp_path / "client.err",
            )
        )
        assert client.stdout is not None
        with trio.fail_after(RUN_S):
            out = await client.stdout.receive_some(65536)
        os.kill(pids[victim], signal.SIGKILL)
        with trio.fail_after(RUN_S):
            while chunk := await client.stdout.receive_some(65536):
                out += chunk
            assert await client.wait() == 0, (tmp_path / "client.err").read_text()
        assert out.decode() == reference_text, coord_log.read_text()

        # the next request runs on the re-planned ring
        done = await run_shard(
            "generate", "--spec", str(spec), "--json", "--max-tokens", str(LONG),
            "--ignore-eos", PROMPT, timeout_s=RUN_S,
        )  # fmt: skip
        assert done.returncode == 0, done.describe()
        (record,) = done.json_records()
        assert record["token_ids"] == reference["token_ids"]
        log = coord_log.read_text()
        assert re.search(rf"{standby} replaced {victim} \(cold\)", log), log
        replanned = re.search(
            rf"re-planned after {victim} died: (.+); standbys: .*\(moved (\d+) layers", log
        )
        assert replanned is not None, log
        # only the victim's layers moved, to the standby; the other stage kept its block
        assert ring_of(replanned.group(1)) == [(standby, first, last), ring[1]]
        assert int(replanned.group(2)) == last - first
        pause = re.search(rf"{standby} replaced {victim} \(cold\) in ([0-9.]+) s", log)
        assert pause is not None
        report(f"--join swarm: SIGKILL {victim} [{first}, {last}) -> {standby}: {pause.group(1)} s")
