"""The ``--join`` example of the docs, run as written: ``specs/formed.toml`` with its
coordinator and two joiners started as its header says (no ``--memory-gib``: each offers half
its free memory, room for the whole bundled model), then ``shard generate --spec``. The ring
it forms is the one the spec's comment promises, two stages splitting SmolLM2's 30 layers
(``[formation] stages = 2``; without it the planner made one stage of one node), and the
answer equals ``generate --local``.

Loopback only; the spec's port is replaced by a free one, nothing else; every process runs in
its own session and is killed by PID on the way out (``tests/procs.py``); every wait bounded.
"""

from __future__ import annotations

import shlex
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from join_fixtures import formed_ring, join, local
from procs import LineReader, free_ports, run_shard, started_shard

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
RUN_S = 300.0
PROMPT = "The capital of France is"


def _example_commands(text: str) -> list[list[str]]:
    """The ``shard ...`` commands of the spec's header comment, as argv lists."""
    lines = [line[1:] for line in text.splitlines() if line.startswith("#   shard ")]
    return [shlex.split(line)[1:] for line in lines]


async def test_the_formed_toml_example_forms_the_two_stage_ring_it_says(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The header's commands form a ring of two stages, gpu-a and gpu-b splitting the 30
    layers (order and split the planner's, from measured RTTs and speeds), no standby, and
    its generate answers as --local does."""
    text = (ROOT / "specs" / "formed.toml").read_text()
    assert "form a ring of two stages" in text  # what it promises
    (port,) = free_ports(1)
    spec = tmp_path / "formed.toml"
    spec.write_text(text.replace("127.0.0.1:7790", f"127.0.0.1:{port}"))
    coordinator_cmd, join_a, join_b, generate = _example_commands(spec.read_text())
    assert coordinator_cmd == ["up", "--role", "coordinator", "--spec", "specs/formed.toml"]
    coord_log = tmp_path / "coord.err"
    async with AsyncExitStack() as stack:
        coordinator = await stack.enter_async_context(
            started_shard("up", "--role", "coordinator", "--spec", str(spec), stderr_path=coord_log)
        )
        for argv in (join_a, join_b):
            name = argv[argv.index("--node") + 1]
            assert argv[argv.index("--join") + 1] == f"127.0.0.1:{port}"
            await join(stack, spec, name, port, tmp_path / f"{name}.err", timeout_s=RUN_S)
        with trio.fail_after(RUN_S):  # ready once the ring formed and the tail dialled back
            await LineReader(coordinator.stdout).line_starting("SHARD READY")
        ring, standbys = formed_ring(coord_log)
        assert sorted(node for node, _, _ in ring) == ["gpu-a", "gpu-b"], coord_log.read_text()
        (_, first, cut), (_, start, last) = ring
        assert (first, last) == (0, 30) and cut == start and 0 < cut < 30, ring
        assert standbys == "none"
        assert generate == ["generate", "--spec", "specs/formed.toml", PROMPT]
        done = await run_shard(
            "generate", "--spec", str(spec), "--max-tokens", "16", PROMPT, timeout_s=RUN_S
        )
    assert done.returncode == 0, done.describe()
    reference = await local(smollm2_dir, PROMPT, "--max-tokens", "16", timeout_s=RUN_S)
    assert done.stdout == reference
