"""A formed swarm that loses a stage with no standby repairs itself when the node comes back
late, with real processes (issue 40, part 5): a ``[formation]`` coordinator and two tiny-model
nodes started with ``shard up --role stage --join`` form a ring of two (no standby); one is
SIGKILLed; once ``join_deadline_s`` has passed the coordinator logs what it waits for and a
request fails; the same node started again with ``--join`` (it registers idle) is activated
back into its slot, and the next request equals ``shard generate --local``.

Loopback only; every process runs in its own session and is killed by PID on the way out
(``tests/procs.py``); every wait is bounded. The coordinator's log is another process's file:
it is read until the line comes (bounded), the one way to see the scheduler's state from here.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from join_fixtures import formation_lines, formed_ring, join, local, memory_gib, write_lines
from procs import LineReader, free_ports, run_shard, started_shard

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea"
TOKENS = ("--max-tokens", "24", "--ignore-eos")
RUN_S = 120.0
WAITING = "waiting for a node that can hold them"


async def _logged(path: Path, text: str, *, timeout_s: float) -> str:
    """The log at ``path`` once it contains ``text`` (read every 0.2 s, for ``timeout_s``)."""
    with trio.fail_after(timeout_s):
        # another process's file: there is no event to wait on
        while text not in (log := await trio.Path(path).read_text()):  # noqa: ASYNC110
            await trio.sleep(0.2)
    return log


async def test_a_joined_node_killed_with_no_standby_rejoins_late_and_the_ring_serves(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, report: Callable[[str], None]
) -> None:
    """Two --join nodes, no standby: SIGKILL the tail; past join_deadline_s the ring is down
    and says why; the tail restarted with --join is taken back and a new request equals
    --local."""
    model_dir = tiny_checkpoint(seed=5, n_layers=6)
    (port,) = free_ports(1)
    lines = [*formation_lines(model_dir, port, expect=2, max_len=128, wait_s=60.0)]
    lines += ["[failover]", "join_deadline_s = 2.0", "dead_after_s = 1.0"]
    spec = write_lines(tmp_path / "formed.toml", lines)
    coord_log = tmp_path / "coord.err"
    memory = memory_gib(model_dir, 4)  # one node cannot hold the model, two can
    ask = ("generate", "--spec", str(spec), "--json", *TOKENS, PROMPT)
    async with AsyncExitStack() as stack:
        coordinator = await stack.enter_async_context(
            started_shard(
                "up", "--role", "coordinator", "--spec", str(spec), "--model", str(model_dir),
                stderr_path=coord_log,
            )
        )  # fmt: skip
        pids = {}
        for name in ("j0", "j1"):
            pids[name] = await join(
                stack, spec, name, port, tmp_path / f"{name}.err", "--model", str(model_dir),
                "--memory-gib", memory, timeout_s=RUN_S,
            )  # fmt: skip
        with trio.fail_after(RUN_S):
            await LineReader(coordinator.stdout).line_starting("SHARD READY")
        ring, _ = formed_ring(coord_log)
        victim = ring[-1][0]
        killed = trio.current_time()
        os.kill(pids[victim], signal.SIGKILL)
        log = await _logged(coord_log, WAITING, timeout_s=RUN_S)
        down = await run_shard(*ask, timeout_s=RUN_S)  # the ring serves nothing meanwhile
        assert down.returncode != 0 and WAITING in down.stdout + down.stderr, down.describe()

        await join(
            stack, spec, victim, port, tmp_path / f"{victim}-again.err", "--model",
            str(model_dir), "--memory-gib", memory, timeout_s=RUN_S,
        )  # fmt: skip
        log = await _logged(coord_log, f"{victim} rejoined its slot", timeout_s=RUN_S)
        report(f"--join late rejoin: {victim} back {trio.current_time() - killed:.1f} s after")
        done = await run_shard(*ask, timeout_s=RUN_S)
        assert done.returncode == 0, f"{done.describe()}\n{coord_log.read_text()}"
        (record,) = done.json_records()
        reference = await local(
            model_dir, PROMPT, *TOKENS, "--max-len", "128", "--json", timeout_s=RUN_S
        )
        assert record["token_ids"] == json.loads(reference)["token_ids"], log
        assert "nothing to rewire" not in coord_log.read_text()
