"""A planned ring with real processes: ``shard swarm run`` on a spec whose file order is bad
under its ``[links]`` runs the planner's order (each node started with ``shard up --layout``)
and gives the tokens of ``shard generate --local``.

Charter as in ``test_swarm_cli``: loopback only, free ports, every process killed by PID.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from procs import free_ports, run_python, run_shard
from shard.model.tokenizer import Tokenizer
from test_spec_swarm_cli import _LOCAL, check_same_or_tie

pytestmark = pytest.mark.slow

PROMPT = "in in in the the river river"
RUN_S = 150.0


def bad_order_spec(path: Path, model_dir: Path) -> Path:
    """Three "auto" stages; file order pays 20 ms on coord -> s0 and s0 -> s1, every other
    pair 1 ms (the default)."""
    ports = free_ports(4)
    lines = [
        "[swarm]",
        'name = "planned"',
        f"model = {json.dumps(str(model_dir))}",
        "insecure = true",
        "[limits]",
        "max_len = 256",
        "connect_timeout_s = 5.0",
        "[coordinator]",
        'name = "coord"',
        f'listen = "127.0.0.1:{ports[0]}"',
    ]
    for i in range(3):
        lines += ["[[stage]]", f'name = "s{i}"', f'listen = "127.0.0.1:{ports[i + 1]}"']
        lines.append('layers = "auto"')
    lines += ["[links]", "latency_ms = 1.0"]
    for src, dst in (("coord", "s0"), ("s0", "s1")):
        lines += ["[[links.edge]]", f'from = "{src}"', f'to = "{dst}"', "latency_ms = 20.0"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def test_swarm_run_on_the_planned_ring_matches_local(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """`swarm run` prints the plan, its stages run in the planner's order with its blocks
    (the signed receipt names them), and the tokens are `generate --local`'s."""
    model_dir = tiny_checkpoint(seed=8, n_layers=4)
    spec = bad_order_spec(tmp_path / "spec.toml", model_dir)
    shown = await run_shard("plan", str(spec), "--json", timeout_s=60)
    assert shown.returncode == 0, shown.describe()
    want = json.loads(shown.stdout)
    layout = want["swarm_up"]["layout"]
    assert layout is not None and not layout.startswith("s0=")
    local = await run_python(_LOCAL, str(model_dir), PROMPT, timeout_s=RUN_S)
    assert local.returncode == 0, local.describe()
    receipt = tmp_path / "run.json"
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompt", PROMPT, "--max-tokens", "20",
        "--model", str(model_dir), "--receipt", str(receipt), timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    assert f"swarm up:    --layout {layout} " in done.stderr
    ran = json.loads(receipt.read_text())["stages"]
    assert [(s["node"], s["first"], s["last"]) for s in ran] == [
        (s["node"], s["first"], s["last"]) for s in want["stages"]
    ]
    [record] = done.json_records()
    [ref] = local.json_records()
    prompt_ids = Tokenizer.from_dir(model_dir).encode(PROMPT)
    check_same_or_tie(model_dir, prompt_ids, record["token_ids"], ref["token_ids"])
