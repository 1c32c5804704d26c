"""The throughput cost of spot checks, side by side: tok/s of one in-process ring without
audits and with them at ``--rate`` (default: the spec default, 0.05), in one run.

Both modes run the same swarm (``shard.nodes.inprocess.run_swarm``, memory network, no
emulated latency, compute in worker threads) on a tiny random-weight model (``--model DIR``
for another checkpoint), alternating round by round so a drift in the machine's load hits
them alike. With audits, an ``AuditTap`` samples s1's chunks (hash chains, the decision, a
copy of each chunk's input and output) and an ``Auditor`` holding s1's block re-runs every
chosen chunk — in this process, on the same CPU, so the number is an upper bound on what a
ring pays when its auditor is another machine (then only the sampling stays on the ring).

Writes JSON (``--json``): per mode the tok/s of each round, the median, and the ratio.
Benchmarks are not tests: nothing here asserts a speed.

    PYTHONPATH=src .venv/bin/python bench/audit_cost.py --rounds 2 --max-tokens 16   # short
    PYTHONPATH=src .venv/bin/python bench/audit_cost.py --rounds 7 --max-tokens 96   # full
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from shard.messages import NodeName
from shard.messages.audit import AuditRequest, AuditVerdict
from shard.model.loader import load_stage
from shard.nodes.inprocess import run_swarm
from shard.spec.audit import AuditSpec
from shard.spec.swarm import SwarmSpec
from shard.stage.auditor import Auditor
from shard.testing import AuditTap, make_tiny_checkpoint
from shard.transport import MemoryNetwork
from shard.trust.identity import NodeIdentity
from shard.trust.sampler import Accused, AuditSampler

PROMPTS = ([5, 17, 99, 3, 8, 8, 41, 5, 17], [200, 31, 7, 7, 7, 64, 12, 1, 150, 9, 44])


def spec_for(model_dir: Path) -> SwarmSpec:
    return SwarmSpec.from_dict(
        {
            "swarm": {"name": "bench", "model": str(model_dir), "insecure": True},
            "limits": {"max_len": 256, "prefill_chunk": 8},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
            "stage": [
                {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": [2 * i, 2 * i + 2]}
                for i in range(3)
            ],
        },
        source="audit-cost.toml",
    )


async def one_round(spec: SwarmSpec, model_dir: Path, rate: float | None, tokens: int) -> float:
    """tok/s of the prompts run one after the other on a fresh ring (audited when ``rate``)."""
    policy = AuditSpec(rate=rate or 0.0)
    req_send, req_recv = trio.open_memory_channel[AuditRequest](1024)  # audits queue
    ver_send, _verdicts = trio.open_memory_channel[AuditVerdict](1024)  # read by nobody here
    s1 = spec.stages[1]
    wrap = None
    async with trio.open_nursery() as nursery:
        if rate is not None:
            sampler = AuditSampler(
                Accused(NodeName("s1"), "00" * 32, 2, 4, "cpu", "float32"),
                seed=random.Random(1).randbytes(32),
                rate=rate,
            )
            tap = AuditTap(
                sampler, req_send, upstream="s0", accused="s1", accused_address=str(s1.listen)
            )
            wrap = tap.wrap
            auditor = Auditor(
                load_stage(model_dir, 2, 4),
                node=NodeName("auditor"),
                identity=NodeIdentity.from_seed(b"\x05" * 32),
                device_class="cpu",
                requests=req_recv,
                verdicts=ver_send,
                policy=policy,
            )
            await nursery.start(auditor.run)
        handle = await nursery.start(
            partial(run_swarm, spec, model_dir=model_dir, network=MemoryNetwork(), wrap=wrap)
        )
        n, t0 = 0, time.perf_counter()
        for prompt in PROMPTS:
            done = await handle.coordinator.generate(list(prompt), max_tokens=tokens)
            n += len(done.token_ids)
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=AuditSpec().rate)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: tiny random)")
    ap.add_argument("--json", type=Path, default=Path("bench/results/audit_cost.json"))
    args = ap.parse_args()
    model_dir = args.model or make_tiny_checkpoint(
        Path(tempfile.mkdtemp()), seed=11, n_layers=6, hidden_size=256, intermediate_size=512
    )
    spec = spec_for(model_dir)
    runs: dict[str, list[float]] = {"off": [], f"rate_{args.rate:g}": []}
    for _ in range(args.rounds):
        runs["off"].append(trio.run(one_round, spec, model_dir, None, args.max_tokens))
        runs[f"rate_{args.rate:g}"].append(
            trio.run(one_round, spec, model_dir, args.rate, args.max_tokens)
        )
    med = {k: statistics.median(v) for k, v in runs.items()}
    out: dict[str, Any] = {
        "bench": "audit_cost",
        "rate": args.rate,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "model": str(args.model or "tiny random (6 layers, hidden 256)"),
        "tok_s": runs,
        "median_tok_s": med,
        "ratio_audited_to_off": med[f"rate_{args.rate:g}"] / med["off"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_tok_s", "ratio_audited_to_off")}))


if __name__ == "__main__":
    main()
