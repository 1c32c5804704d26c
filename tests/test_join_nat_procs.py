"""Joined nodes behind NAT, with real processes in network namespaces the test creates
(``test_nat_procs.nat_lab``: a public namespace with the coordinator, a MASQUERADE router,
one home per node that drops every inbound connection).

Two stages started with ``--join`` only (no layer range, no ``reachable`` key anywhere),
each with memory for four of the six layers, so both are needed. Nobody reaches either at its
``--listen`` address — not the other node, not the coordinator — so the mesh measurement
detects both as behind NAT; the scheduler activates them behind NAT, they register at the
coordinator's relay, and the ring forms through a callback (coordinator -> stage 0) and the
relay (stage 0 -> stage 1). The output equals ``shard generate --local``.

Needs root and ``ip``/``iptables`` like ``test_nat_procs`` (it fails loudly without them,
never skips). Loopback and its own namespaces only; processes are killed by PID, namespaces
deleted on every way out, every wait bounded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from join_fixtures import memory_gib
from procs import LineReader, run_shard, started_shard
from test_nat_procs import PUBLIC_IP, STAGE_PORT, can_connect, nat_lab

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea"
MAX_TOKENS = 24
MAX_LEN = 256
RUN_S = 180.0
COORD_PORT = 7700
NODES = ("j0", "j1")


def formation_spec(path: Path, model_dir: Path) -> Path:
    """The coordinator in the public namespace expecting two joined nodes."""
    lines = [
        "[swarm]",
        'name = "join-nat"',
        f"model = {json.dumps(str(model_dir))}",
        "insecure = true",
        "[limits]",
        f"max_len = {MAX_LEN}",
        "connect_timeout_s = 5.0",
        "[failover]",
        "dead_after_s = 3.0",
        "[coordinator]",
        'name = "coord"',
        f'listen = "{PUBLIC_IP}:{COORD_PORT}"',
        "[formation]",
        "expect = 2",
        "wait_s = 240.0",
        "probes = 3",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def test_joined_nodes_behind_nat_are_detected_and_form_a_ring_through_the_relay(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Both joined nodes are detected behind NAT, activated behind NAT, reached by callback
    and through the relay, and the ring's output equals --local."""
    model_dir = tiny_checkpoint(seed=5, n_layers=6)
    local = await run_shard(
        "generate", "--local", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS),
        "--max-len", str(MAX_LEN), "--ignore-eos", "--json", PROMPT, timeout_s=RUN_S,
    )  # fmt: skip
    assert local.returncode == 0, local.describe()
    (want,) = local.json_records()
    spec = formation_spec(tmp_path / "formed.toml", model_dir)
    logs = {name: tmp_path / f"{name}.err" for name in ("coord", *NODES)}
    common = ("--spec", str(spec), "--model", str(model_dir))
    async with nat_lab(len(NODES)) as lab, AsyncExitStack() as stack:
        up = ("-v", "up", "--role")
        coord = await stack.enter_async_context(
            started_shard(
                *up,
                "coordinator",
                *common,
                stderr_path=logs["coord"],
                prefix=lab.inside(lab.public),
            )
        )
        for i, name in enumerate(NODES):
            joining = (
                "--join", f"{PUBLIC_IP}:{COORD_PORT}", "--node", name,
                "--listen", f"{lab.home_ip(i)}:{STAGE_PORT}",
                "--memory-gib", memory_gib(model_dir, 4),
            )  # fmt: skip
            await stack.enter_async_context(
                started_shard(
                    *up,
                    "stage",
                    *joining,
                    *common,
                    stderr_path=logs[name],
                    prefix=lab.inside(lab.homes[i]),
                )
            )
        with trio.fail_after(RUN_S):  # ready: the ring is connected end to end
            await LineReader(coord.stdout).line_starting("SHARD READY")
        for ns, i in ((lab.public, 0), (lab.public, 1), (lab.homes[1], 0)):
            assert not await can_connect(lab, ns, lab.home_ip(i), STAGE_PORT), (ns, i)
        done = await run_shard(
            "generate", "--spec", str(spec), "--json", "--max-tokens", str(MAX_TOKENS),
            "--ignore-eos", PROMPT, timeout_s=RUN_S, prefix=lab.inside(lab.public),
        )  # fmt: skip
        text = {name: path.read_text() for name, path in logs.items()}
        assert done.returncode == 0, done.describe() + text["coord"][-3000:]
        (got,) = done.json_records()
    coord_log = text["coord"]
    for name in NODES:
        assert re.search(rf"{name} accepts no inbound connection at", coord_log), coord_log
        assert f"relay coord: {name} registered" in coord_log, coord_log
    formed = re.search(r"formed the ring (.+)", coord_log)
    assert formed is not None and "behind NAT (dialled through the relay): j0, j1" in formed[1]
    assert "relay coord: relaying" in coord_log, coord_log  # stage 0 -> stage 1
    s0, s1 = re.findall(r"(j\d) \[", formed[1])
    assert f"{s0}: answered coord's call: dialled it back at {PUBLIC_IP}" in text[s0], text[s0]
    assert f"{s1}: answered {s0}'s call: met it at relay {PUBLIC_IP}" in text[s1], text[s1]
    assert got["token_ids"] == want["token_ids"]
