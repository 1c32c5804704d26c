"""SIGKILL each stage in turn, at a seeded random token, with a hot standby for every stage.

Issue 13's failover check, with real processes: ``RUNS`` runs of ``shard swarm run`` on a
spec of three SmolLM2 stages with one hot standby each, run ``i`` killing stage ``s{i % 3}``
after a token drawn from a seeded ``random.Random``. Each run's token ids are compared with
``shard generate --local`` (the single-process reference, computed once), and the longest
pause between tokens after the kill (``swarm run`` reports it) is recorded. Writes JSON
(``--json``, default a new timestamped file under ``bench/results/``) and prints a table.

A benchmark, not a test: it asserts nothing and records everything, including failures.

    .venv/bin/python bench/kill_each.py --runs 21 --json bench/results/kill_each.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The capital of France is"
PAUSE = re.compile(r"longest pause between tokens after kill (\S+): ([0-9.]+) s")

SPEC = """\
[swarm]
name = "kill-each"
model = "smollm2"
dtype = "float32"
insecure = true

[limits]
max_len = 512

[coordinator]
name = "coord"
listen = "127.0.0.1:{base}"

{stages}
[failover]
heartbeat_s = 0.25
dead_after_s = 1.0

[[faults]]
kind = "kill"
node = "{victim}"
at_token = {at_token}
"""


def _spec(base: int, victim: str, at_token: int) -> str:
    stages = ""
    for i in range(3):
        stages += (
            f'[[stage]]\nname = "s{i}"\nlisten = "127.0.0.1:{base + 1 + i}"\nlayers = "auto"\n\n'
        )
    for i in range(3):
        stages += (
            f'[[standby]]\nname = "s{i}-standby"\nlisten = "127.0.0.1:{base + 4 + i}"\n'
            f'layers_of = "s{i}"\n\n'
        )
    return SPEC.format(base=base, stages=stages, victim=victim, at_token=at_token)


def _shard(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shard", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--base-port", type=int, default=7860)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    out = args.json or Path("bench/results") / time.strftime("kill_each-%Y%m%dT%H%M%SZ.json")
    if out.exists():
        print(f"kill_each: {out} exists; pass another --json", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    print(f"kill_each: seed {args.seed}, {args.runs} runs", flush=True)
    ref = _shard(
        "generate",
        "--local",
        PROMPT,
        "--max-tokens",
        str(args.max_tokens),
        "--ignore-eos",
        "--json",
        timeout_s=300,
    )
    reference = json.loads(ref.stdout.strip().splitlines()[-1])["token_ids"]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            victim = f"s{i % 3}"
            at_token = rng.randint(4, args.max_tokens - 8)
            spec = Path(tmp) / f"run{i}.toml"
            spec.write_text(_spec(args.base_port, victim, at_token))
            started = time.monotonic()
            try:
                done = _shard(
                    "swarm",
                    "run",
                    str(spec),
                    "--prompt",
                    PROMPT,
                    "--max-tokens",
                    str(args.max_tokens),
                    "--ignore-eos",
                    "--json",
                    timeout_s=300,
                )
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                record = json.loads(lines[-1]) if lines else {}
                pause = PAUSE.search(done.stderr)
                result = {
                    "run": i,
                    "victim": victim,
                    "at_token": at_token,
                    "rc": done.returncode,
                    "identical": record.get("token_ids") == reference,
                    "finish_reason": record.get("finish_reason"),
                    "pause_s": float(pause.group(2)) if pause else None,
                    "wall_s": round(time.monotonic() - started, 1),
                    "stderr_tail": done.stderr[-600:] if done.returncode else "",
                }
            except subprocess.TimeoutExpired:
                result = {
                    "run": i,
                    "victim": victim,
                    "at_token": at_token,
                    "rc": None,
                    "identical": False,
                    "pause_s": None,
                    "error": "timed out",
                }
            runs.append(result)
            print(
                f"run {i:2d} kill {victim} at token {at_token:2d}: rc {result['rc']} "
                f"identical {result['identical']} pause {result['pause_s']} s",
                flush=True,
            )
    pauses = [r["pause_s"] for r in runs if r["pause_s"] is not None]
    summary = {
        "identical": sum(r["identical"] for r in runs),
        "runs": len(runs),
        "pause_median_s": statistics.median(pauses) if pauses else None,
        "pause_max_s": max(pauses) if pauses else None,
        "by_victim": {
            v: statistics.median([r["pause_s"] for r in runs if r["victim"] == v and r["pause_s"]])
            for v in ("s0", "s1", "s2")
            if any(r["victim"] == v and r["pause_s"] for r in runs)
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "seed": args.seed,
                "prompt": PROMPT,
                "reference": reference,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
