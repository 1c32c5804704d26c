"""The failover spec on a loaded host: ``specs/failover.toml`` as shipped (SmolLM2, three stages,
a hot standby for s1, a scripted SIGKILL of s1 at 16 tokens) run by ``shard swarm run
--receipt`` beside ten CPU hogs on this machine's cores. The answer equals ``shard generate
--local`` (computed before the hogs start), the run exits 0 with its receipt written, and the
failure detector's only verdict is s1's death: no live node is suspected or declared dead
under the load.

Not asserted, reported: whether the receipt verifies. It did not before receipts spanned a
splice (version 4, docs/failover.md): ``shard receipt verify`` said "stage s1-standby [6, 26):
input chain differs from what s0 sent". It should now (``tests/test_splice_receipts.py``
checks it in process; this slow test was not re-run with real processes since). When the
splice lands while receipts are collected the request still fails ("a repair while receipts
are collected can leave a stage's receipt unsigned"): timing-dependent, a likely reading of
the issue's "`swarm run --receipt` failed once".

Issue 29 saw 1 of 4 such runs give the uninterrupted output at load ~12 on 2 cores. Here
(5 runs, load 7-22) the detector never suspected a live node; the start took 80-165 s, close
to the launcher's fixed 180 s deadline, which now waits for a start that works
(``shard.nodes.startup``). Later it failed 5 runs in 5: the tail stage's first full garbage
collection (210,000 objects, 0.67 s under this load) fell on the first request and paused its
heartbeats 1.0 s, so it was suspected; nodes now freeze their start-up heap when ready
(``shard.compute.collector``), and it passed 2 runs in 2. Hogs are ``python -c 'while True:
pass'`` children started in their own sessions and killed by PID; the swarm's processes by
``tests/procs.py``. Loopback only; the spec's ports are replaced by free ones, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from procs import alive, free_ports, run_shard, started_python

pytestmark = pytest.mark.slow

SPEC = Path(__file__).resolve().parents[1] / "specs" / "failover.toml"
PROMPT = "The capital of France is"  # the spec's own example
MAX_TOKENS = 48
HOGS = 10
_HOG = "while True: pass"
RUN_S = 900.0  # bound on the loaded run: its start alone took up to 165 s here


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> dict[str, Any]:
    """``generate --local --json`` of the spec's example, before any hog runs."""
    done = subprocess.run(
        [sys.executable, "-m", "shard", "generate", "--local", "--json", "--model",
         str(smollm2_dir), "--max-tokens", str(MAX_TOKENS), PROMPT],
        capture_output=True, text=True, timeout=RUN_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record: dict[str, Any] = json.loads(done.stdout)
    return record


@pytest.fixture
async def cpu_hogs() -> AsyncIterator[list[int]]:
    """``HOGS`` busy-looping processes for the test's duration, each in its own session and
    killed by PID (with its group) after it (``procs.started_python``)."""
    async with AsyncExitStack() as stack:
        hogs = [await stack.enter_async_context(started_python(_HOG)) for _ in range(HOGS)]
        yield [hog.pid for hog in hogs]


def _spec_on_free_ports(path: Path) -> Path:
    text = SPEC.read_text()
    ports = sorted(set(re.findall(r'listen = "127\.0\.0\.1:(\d+)"', text)))
    for old, new in zip(ports, free_ports(len(ports)), strict=True):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    path.write_text(text)
    return path


async def test_the_failover_spec_completes_identically_beside_ten_cpu_hogs(
    reference: dict[str, Any],
    cpu_hogs: list[int],
    tmp_path: Path,
    report: Callable[[str], None],
) -> None:
    """With ten CPU hogs running, `swarm run --receipt` of the failover spec kills s1, the
    standby takes over, and the tokens are --local's; the receipt is written (whether it
    verifies is reported, not asserted: the module docstring); no other node is suspected or
    declared dead before the answer (the detector's defaults hold)."""
    spec = _spec_on_free_ports(tmp_path / "failover.toml")
    receipt = tmp_path / "run.json"
    done = await run_shard(
        "swarm", "run", str(spec), "--json", "--prompt", PROMPT, "--max-tokens",
        str(MAX_TOKENS), "--receipt", str(receipt), timeout_s=RUN_S,
    )  # fmt: skip
    load = os.getloadavg()[0]
    assert done.returncode == 0, done.describe()
    assert done.stragglers == ()
    assert all(alive(pid) for pid in cpu_hogs)  # they ran throughout
    (record,) = done.json_records()
    assert record["token_ids"] == reference["token_ids"], done.describe()
    answered = done.stderr.split("shard: receipt written")[0]  # before teardown closes links
    assert re.search(r"fault: killed s1 \(pid \d+, SIGKILL\) after \d+ tokens", answered)
    assert re.search(r"s1-standby replaced s1 \(hot\)", answered), done.describe()
    wrongly = re.findall(r"scheduler: (s0|s2|s1-standby|coord) (?:is dead|suspected)", answered)
    assert wrongly == [], done.describe()
    assert receipt.exists()  # written; whether it verifies is reported (docstring)
    verified = await run_shard("receipt", "verify", str(receipt), timeout_s=60)
    pause = re.search(r"longest pause between tokens after kill s1: ([0-9.]+) s", done.stderr)
    report(
        f"failover spec beside {HOGS} CPU hogs: load {load:.1f}, identical output, longest "
        f"pause after the kill {pause.group(1) if pause else '?'} s; its receipt: "
        f"{(verified.stdout + verified.stderr).strip()[-160:]}"
    )
