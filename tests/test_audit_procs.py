"""Spot checks with real processes: a stage process that adds small noise to what it sends is
audited by the standby holding its block, struck, evicted and replaced by that standby
mid-request, and the output is identical to ``shard generate --local``.

``shard.testing.cheat_node`` runs ``shard swarm run`` with s1 started as a cheater (the only way to
start one: a test-only entry script, no production flag). Every node is its own process on
loopback, killed by PID on every way out (``tests/procs.py``); every run is bounded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from procs import LOOPBACK, free_ports, run_python
from test_failover_procs import MAX_TOKENS, PROMPT, RUN_S, failover_spec, local_reference
from test_failover_procs import llama_dir as llama_dir

pytestmark = pytest.mark.slow

CHEAT_NODE = "shard.testing.cheat_node"
RUNNER = (
    "import runpy, sys; sys.argv = sys.argv[1:]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


async def test_a_cheating_stage_process_is_evicted_and_replaced_with_identical_output(
    llama_dir: Path, tmp_path: Path, report: Callable[[str], None]
) -> None:
    """s1 lies on every chunk; two failed audits evict it; the spare takes over; same output;
    the honest s0, audited all along by auditor0 (``shard up --role auditor``), is never
    accused, and the auditor is never spliced in.

    Every chunk is audited (rate 1.0), so the run does not depend on the per-session seed."""
    spec = failover_spec(tmp_path / "audit.toml", llama_dir, victim="s1", at_token=0, kind="")
    (port,) = free_ports(1)
    with spec.open("a", encoding="utf-8") as f:  # a dedicated auditor audits s0 meanwhile
        f.write(f'[[standby]]\nname = "auditor0"\nlisten = "{LOOPBACK}:{port}"\nlayers_of = "s0"\n')
        f.write('role = "auditor"\n')  # shard up --role auditor: never spliced in
        f.write("[audit]\nenabled = true\nrate = 1.0\nstrikes = 2\n")
    # Batching off, so audits are bit-exact and catch noise too small to change a token (a
    # batched forward matches a lone recomputation only to rounding: audits then use the
    # sketch, which such noise passes; tests/test_audit_swarm.py covers that case).
    spec.write_text(spec.read_text().replace("[limits]\n", "[limits]\nmax_batch_rows = 1\n", 1))
    reference = await local_reference(llama_dir)
    done = await run_python(
        RUNNER,
        CHEAT_NODE,
        "noise",
        "s1",
        "swarm",
        "run",
        str(spec),
        "--json",
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(MAX_TOKENS),
        "--model",
        str(llama_dir),
        timeout_s=RUN_S,
    )
    assert done.returncode == 0, done.describe()
    assert done.stragglers == (), f"processes outlived `swarm run`: {done.stragglers}"
    (record,) = done.json_records()
    stderr = done.stderr
    assert record["finish_reason"] != "error", done.describe()
    assert record["token_ids"] == reference["token_ids"], stderr
    strikes = re.findall(r"s1 failed an audit", stderr)
    assert len(strikes) >= 2, stderr
    assert "s1 evicted after failed audits" in stderr, stderr
    assert re.search(r"spare replaced s1 \(hot\)", stderr), stderr
    assert "auditor0 replaced" not in stderr, stderr
    assert "failed an audit" not in stderr.replace("s1 failed an audit", ""), stderr
    honest = re.findall(r"audit of s0 \(session \d+, chunk \d+\) by auditor0: ok", stderr)
    assert honest, stderr  # the honest stage was audited across processes, bit-exactly
    report(
        f"cheating s1 evicted after {len(strikes)} failed audits; honest s0 passed"
        f" {len(honest)} audits; output identical"
    )
