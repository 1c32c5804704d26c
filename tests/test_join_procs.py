"""A swarm that forms itself, with real processes: a ``[formation]`` coordinator and three
tiny-model stages started with ``shard up --role stage --join`` only (no layer range
anywhere). Their memory allows no one-stage ring, and the spec asks for two stages
(``stages = 2``), so the planner forms a two-stage ring and keeps one standby; the output
equals ``shard generate --local``. (Left to the predicted lap, a 3-stage ring was formed
once in many runs: on loopback the hops cost almost nothing and the join-time speed
measurements are noisy on a busy machine; the same two-stage ring was predicted at 5.07 ms
in one run and 3.50 ms in the next.) Then the ring's first stage is
SIGKILLed while a long request streams: the sticky re-plan gives only its layers to the
standby, the request completes with the same output, and so does the next one. Before
that, an impostor started with ``--join`` under a live stage's name is refused (one line,
exit 1) and the live stage's link is never dropped: the requests that follow run on it.

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

from join_fixtures import (
    formation_lines,
    formed_ring,
    join,
    local,
    memory_gib,
    ring_of,
    write_lines,
)
from procs import LineReader, free_ports, run_shard, started_shard

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea and the sea runs to the river"
LONG = 400  # tokens: still streaming when the kill lands
MAX_LEN = 512
RUN_S = 300.0
NODES = ("j0", "j1", "j2")
#: what ``shard generate --local`` is given, so it decodes as the swarm does
REFERENCE = ("--max-tokens", str(LONG), "--max-len", str(MAX_LEN), "--ignore-eos")


async def test_joined_stages_form_a_ring_and_a_sigkill_moves_only_its_layers(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, report: Callable[[str], None]
) -> None:
    model_dir = tiny_checkpoint(seed=5, n_layers=6)
    (port,) = free_ports(1)
    spec = write_lines(
        tmp_path / "formed.toml", formation_lines(model_dir, port, expect=3, stages=2)
    )
    coord_log = tmp_path / "coord.err"
    reference_text = await local(model_dir, PROMPT, *REFERENCE, timeout_s=RUN_S)
    reference_json = await local(model_dir, PROMPT, *REFERENCE, "--json", timeout_s=RUN_S)
    (reference,) = [json.loads(line) for line in reference_json.splitlines()]
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
        # room for four of the six layers: one node cannot hold the model, two can
        memory = memory_gib(model_dir, 4)
        for name in NODES:
            pids[name] = await join(
                stack, spec, name, port, tmp_path / f"{name}.err", "--model", str(model_dir),
                "--memory-gib", memory, timeout_s=RUN_S,
            )  # fmt: skip
        with trio.fail_after(RUN_S):  # ready once the ring formed and the tail dialled back
            await LineReader(coordinator.stdout).line_starting("SHARD READY")
        ring, standby = formed_ring(coord_log)
        log = coord_log.read_text()
        assert len(ring) == 2 and standby in NODES, f"expected two stages + a standby: {log}"
        victim, first, last = ring[0]

        # an impostor joins under the live tail's name: refused, the live link untouched
        live = ring[1][0]
        impostor = await run_shard(
            "up", "--role", "stage", "--join", f"127.0.0.1:{port}", "--spec", str(spec),
            "--node", live, "--model", str(model_dir), "--memory-gib", memory, timeout_s=RUN_S,
        )  # fmt: skip
        assert impostor.returncode == 1, impostor.describe()
        assert f"{live} is the name of a live member" in impostor.stderr, impostor.describe()
        log = coord_log.read_text()
        assert "refused a registration" in log and f"{live} is dead" not in log, log

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
