"""The throughput cost of spot checks with the real wiring, side by side: decode tok/s of a ring
of stage processes with ``[audit] enabled = false`` and of the same ring with it on, in one run.

Both rings are up at once (``shard.nodes.launcher.launch`` of a generated spec, as
``bench/plain_ring.py`` and ``bench/batch_streams.py`` start theirs: free loopback ports,
``layers = "auto"``, plain decoding, no emulated latency), each with the same nodes: a
coordinator, ``--stages`` stages and one dedicated auditor (``[[standby]] role = "auditor"``)
holding each audited stage's block (every stage but the tail). Only ``[audit] enabled``
differs: with it, every node copies the ring chunks it sends and receives up its control link,
the scheduler samples each chunk at ``--rate`` (default: the spec default, 0.05) and the
auditor holding the block re-runs each chosen one. Repetitions are interleaved (off, audited,
off, audited, ...), each running every prompt of ``--prompts`` once, so a drift in the
machine's load hits both alike; the load average is recorded after each repetition.

Every process runs on this machine: the auditors share the CPU with the ring they audit (on a
real swarm an auditor is another machine), so the audited figure includes their recomputation.

Writes JSON (``--json``): per request decode tok/s (1 / mean lap) and end-to-end tok/s, their
medians per mode and the ratio audited / off, the audits each coordinator counted (its status
feed), the load, machine, git and config; it is rewritten after every round, so a run cut
short keeps its rounds. Benchmarks are not tests: nothing here asserts a speed.

    .venv/bin/python bench/audit_cost.py --rounds 3 --max-tokens 24      # SmolLM2, ~6 min
    .venv/bin/python bench/audit_cost.py --model tiny --rounds 2          # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from plain_ring import REPO, Prompt, Ring, ask, free_ports, git_info, machine_info, ring_spec_toml
from shard.messages import AuditCounts, GenerateDone, Hello, NodeName, StatusSnapshot
from shard.model.config import ModelConfig
from shard.spec.audit import AuditSpec
from shard.spec.swarm import load_spec
from shard.transport import Network

Record = dict[str, Any]
MODES = ("off", "audited")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, checkpoint dir, or tiny")
    p.add_argument("--rate", type=float, default=AuditSpec().rate, help="[audit] rate")
    p.add_argument("--rounds", type=int, default=5, help="repetitions per mode (interleaved)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--prompts", type=Path, default=REPO / "bench" / "prompts")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "audit_cost.json")
    return p.parse_args(argv)


def spec_toml(
    name: str, stages: int, model: str, *, audited: bool, rate: float, max_len: int | None
) -> str:
    """``plain_ring.ring_spec_toml`` plus an auditor per audited stage and ``[audit]``."""
    ports = free_ports(stages + 1 + (stages - 1))
    text = ring_spec_toml(name, ports[: stages + 1], 0.0).replace('"smollm2"', json.dumps(model))
    if max_len is not None:
        text = text.replace("max_len = 2048", f"max_len = {max_len}")
    for i, port in enumerate(ports[stages + 1 :]):
        text += f'\n[[standby]]\nname = "auditor{i}"\nlisten = "127.0.0.1:{port}"\n'
        text += f'layers_of = "s{i}"\nrole = "auditor"\n'
    return text + f"\n[audit]\nenabled = {str(audited).lower()}\nrate = {rate!r}\n"


async def start(
    nursery: trio.Nursery, model_dir: Path, args: argparse.Namespace, mode: str
) -> Ring:
    from shard.nodes.launcher import launch

    path = Path(args.workdir) / f"{mode}.toml"
    model = str(model_dir)
    max_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    text = spec_toml(f"audit-{mode}", args.stages, model, audited=mode == "audited",
                     rate=args.rate, max_len=min(max_len, 2048))  # fmt: skip
    path.write_text(text)
    spec = load_spec(path)
    began = trio.current_time()
    handle = await nursery.start(
        lambda task_status: launch(path, spec, model_dir=model_dir, task_status=task_status)
    )
    up = trio.current_time() - began
    _progress(f"{mode} ring up in {up:.1f} s")
    text = path.read_text()
    return Ring(mode, 0.0, spec.name, spec.hops(), text, handle.coordinator, handle.relays, up)


async def audit_counts(network: Network, ring: Ring) -> AuditCounts:
    """What the coordinator's status feed says about spot checks so far (one snapshot)."""
    from shard.transport.links import dial_peer

    hello = Hello(node=NodeName("bench-monitor"), role="monitor", swarm=ring.swarm)
    conn = await dial_peer(network, ring.coordinator, hello, timeout_s=10.0)
    try:
        while not isinstance(msg := await conn.receive(), StatusSnapshot):
            pass
        return msg.audit
    finally:
        await conn.aclose()


async def run_all(
    model_dir: Path, prompts: list[Prompt], args: argparse.Namespace, save: Callable[[Record], None]
) -> Record:
    """Both rings up, then the interleaved rounds; ``save`` gets the run so far after each
    round (a run cut short still leaves its rounds on disk)."""
    from shard.transport import WebSocketNetwork

    run: Record = {"rounds_done": 0, "requests": [], "load": []}
    async with trio.open_nursery() as nursery:
        rings = {mode: await start(nursery, model_dir, args, mode) for mode in MODES}
        run["specs"] = {m: ring.spec_text for m, ring in rings.items()}
        run["startup_s"] = {m: ring.startup_s for m, ring in rings.items()}
        async with WebSocketNetwork() as network:
            for ring in rings.values():  # warm-up, discarded
                await ask(network, ring, prompts[0], 4, timeout_s=args.request_timeout, rid=0)
            for r in range(args.rounds):
                for mode, ring in rings.items():
                    for j, prompt in enumerate(prompts):
                        done = await ask(network, ring, prompt, args.max_tokens,
                                         timeout_s=args.request_timeout, rid=1 + j)  # fmt: skip
                        run["requests"].append(_request_record(mode, r, prompt, done))
                run["load"].append({"round": r, "loadavg": os.getloadavg()})
                run["audit_counts"] = {
                    m: attrs.asdict(await audit_counts(network, ring)) for m, ring in rings.items()
                }
                run["rounds_done"] = r + 1
                save(run)
                _progress(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}")
        nursery.cancel_scope.cancel()
    return run


def _request_record(mode: str, r: int, prompt: Prompt, done: GenerateDone) -> Record:
    lap = done.stats.mean_lap_s
    return {
        "mode": mode, "round": r, "prompt": prompt.name,
        "tokens": done.stats.tokens, "laps": done.stats.laps,
        "decode_tok_s": 1.0 / lap if lap > 0 else None,
        "tok_s": done.stats.tok_s, "token_ids": list(done.token_ids),
    }  # fmt: skip


def summarize(requests: list[Record]) -> Record:
    """Medians per mode, the ratios audited / off (of the medians, and round by round), and
    whether both gave the same tokens."""
    med: Record = {}
    for key in ("decode_tok_s", "tok_s"):
        for m in MODES:
            med.setdefault(key, {})[m] = statistics.median(
                q[key] for q in requests if q["mode"] == m and q[key]
            )
    ids = {m: [q["token_ids"] for q in requests if q["mode"] == m] for m in MODES}
    by_round = []  # paired: each round's two modes ran back to back, under about the same load
    for r in sorted({q["round"] for q in requests}):
        rm = {m: [q["decode_tok_s"] for q in requests if (q["round"], q["mode"]) == (r, m)]
              for m in MODES}  # fmt: skip
        if all(rm.values()):
            by_round.append(statistics.median(rm["audited"]) / statistics.median(rm["off"]))
    return {
        "ratio_decode_per_round": by_round,
        "median_decode_tok_s": med["decode_tok_s"],
        "median_tok_s": med["tok_s"],
        "ratio_decode_audited_to_off": med["decode_tok_s"]["audited"] / med["decode_tok_s"]["off"],
        "ratio_tok_s_audited_to_off": med["tok_s"]["audited"] / med["tok_s"]["off"],
        "identical_tokens": ids["off"] == ids["audited"],
    }


def _progress(line: str) -> None:
    print(f"[audit_cost] {line}", file=sys.stderr, flush=True)


def _model_dir(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from shard.testing import make_tiny_checkpoint

        return make_tiny_checkpoint(workdir / "tiny", seed=11, n_layers=6, hidden_size=256,
                                    intermediate_size=512)  # fmt: skip
    from shard.convert.bundled import resolve_model

    return resolve_model(name)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [Prompt.from_file(p) for p in sorted(args.prompts.glob("*.txt"))]
    began, load_start = time.perf_counter(), os.getloadavg()
    config = {k: str(v) for k, v in vars(args).items()}
    machine, git = machine_info(), git_info()

    def save(run: Record) -> None:
        result = {
            "benchmark": "audit_cost",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
            "wall_s": time.perf_counter() - began,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "git": git,
            "machine": machine,
            "config": config,
            "summary": summarize(run["requests"]),
            **run,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")

    with tempfile.TemporaryDirectory(prefix="shard-audit-") as tmp:
        args.workdir = tmp
        model_dir = _model_dir(args.model, Path(tmp))
        run = trio.run(run_all, model_dir, prompts, args, save)
    print(json.dumps({**summarize(run["requests"]), "audit_counts": run["audit_counts"]}))
    _progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
