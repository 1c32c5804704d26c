"""Helpers of the ``--join`` process tests (``test_join_procs``, ``test_join_fetch_procs``):
a ``[formation]`` spec, memory that forces a ring of two, the coordinator's logged ring, the
``--local`` reference, and a joining node started and waited for.

Loopback only; processes are started and cleaned up by ``tests/procs.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from procs import LOOPBACK, LineReader, run_shard, started_shard
from shard.model.config import ModelConfig
from shard.model.profile import weight_bytes

_STAGE = re.compile(r"(\S+) \[(\d+), (\d+)\)")


def formation_lines(
    model: str | Path,
    port: int,
    *,
    name: str = "join-test",
    expect: int = 3,
    max_len: int = 512,
    wait_s: float = 240.0,
    insecure: bool = True,
    stages: int | None = None,
) -> list[str]:
    """The TOML lines of a spec whose coordinator on ``port`` expects ``expect`` joined nodes
    (the default, WAN, timings), its ring of ``stages`` (None: the predicted lap's choice); a
    secure one (``insecure=False``) still needs ``[trust]`` and the coordinator's
    ``key``/``token`` lines added after ``[coordinator]``'s."""
    return [
        "[swarm]",
        f"name = {json.dumps(name)}",
        f"model = {json.dumps(str(model))}",
        f"insecure = {str(insecure).lower()}",
        "[limits]",
        f"max_len = {max_len}",
        "connect_timeout_s = 10.0",
        "[formation]",
        f"expect = {expect}",
        *([f"stages = {stages}"] if stages is not None else []),
        f"wait_s = {wait_s!r}",
        "probes = 3",
        "[coordinator]",
        'name = "coord"',
        f'listen = "{LOOPBACK}:{port}"',
    ]


def memory_gib(model_dir: Path, layers: int) -> str:
    """Room for ``layers`` layers with the embedding or the head, as ``--memory-gib`` takes
    it: below the whole model, so one node cannot hold it and two can."""
    layer, embedding, head = weight_bytes(ModelConfig.from_dir(model_dir), "float32")
    return repr((layers * layer + max(embedding, head) + 4096) / 2**30)


def ring_of(line: str) -> list[tuple[str, int, int]]:
    """``[(node, first, last), ...]`` of a logged ring ``coord -> a [0, 4) -> ... -> coord``."""
    return [(n, int(a), int(b)) for n, a, b in _STAGE.findall(line)]


def formed_ring(coord_log: Path) -> tuple[list[tuple[str, int, int]], str]:
    """The ring the coordinator logged it formed, and its standbys (``-`` for none). The
    line is good news: logged at NOTE (shown without ``--verbose``), never WARNING."""
    log = coord_log.read_text()
    formed = re.search(r" NOTE formation: formed the ring (.+); standbys: (\S+);", log)
    assert formed is not None, log
    return ring_of(formed.group(1)), formed.group(2)


async def local(model_dir: Path, prompt: str, *extra: str, timeout_s: float) -> str:
    """stdout of ``shard generate --local`` on ``model_dir`` (``extra``: more flags)."""
    done = await run_shard(
        "generate", "--local", "--model", str(model_dir), *extra, prompt, timeout_s=timeout_s
    )
    assert done.returncode == 0, done.describe()
    return done.stdout


async def join(
    stack: AsyncExitStack,
    spec: Path,
    name: str,
    port: int,
    stderr_path: Path,
    *extra: str,
    timeout_s: float,
) -> int:
    """Start ``shard up --role stage --join`` node ``name`` (``extra``: more flags) for the
    rest of ``stack``; wait until it registered (its READY line) and return its PID."""
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
            *extra,
            stderr_path=stderr_path,
        )
    )
    with trio.fail_after(timeout_s):
        line = await LineReader(proc.stdout).line_starting("SHARD READY")
    found = re.search(r"pid=(\d+)", line)
    assert found is not None, line
    return int(found.group(1))


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
