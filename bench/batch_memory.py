"""Memory per stage with many long sessions: 32 sessions of 2,048 positions on each block of a
3-stage SmolLM2 split, and what a KV budget does past it.

For each block (``layers = "auto"``'s even split), in a fresh process so the resident memory
is that stage's alone: load the block (fp32, CPU) and read VmRSS; then drive a real
``StageExecutor`` (the stage process's executor, batching on) with ``OpenSession`` at
``max_len = 2048`` for ``--sessions`` sessions, a short prompt chunk for each, and one decode
step of all of them together — and read VmRSS again. A session's KV cache is preallocated for
its whole ``max_len`` at ``OpenSession`` and zero-filled (``KVCache.empty``), so every page of
it is resident from then on: its memory at 2,048 written positions is the figure measured here
(``cache_touched``: the bench then writes every position of every cache and reads VmRSS a
third time, to show nothing grows). Then, with ``[limits] kv_budget_mib`` set to exactly
``--sessions`` sessions' worth, one more ``OpenSession`` is refused with a ``capacity`` fault
before anything is allocated (the fault's text is recorded).

Writes JSON (``--json``): per stage the RSS after loading, with the sessions, after touching
every position, the KV bytes the executor counts, the arithmetic (sessions x per-session
bytes) and the refusal. Not a test: nothing here asserts.

    .venv/bin/python bench/batch_memory.py            # SmolLM2, 32 x 2,048; ~1 minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from plain_ring import REPO, git_info, machine_info

Record = dict[str, Any]
MIB = 1024 * 1024


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled model name or a checkpoint dir")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "batch_memory.json")
    p.add_argument("--block", default=None, help=argparse.SUPPRESS)  # "first,last": the child
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


async def measure_block(model_dir: Path, first: int, last: int, n: int, max_len: int) -> Record:
    import torch

    from shard.compute.tensors import to_wire
    from shard.messages import (
        ChunkSeq,
        Epoch,
        Fault,
        Message,
        NodeName,
        OpenSession,
        Prefill,
        SessionId,
        Verify,
    )
    from shard.model.loader import load_stage
    from shard.stage.config import ExecutorConfig
    from shard.stage.executor import StageExecutor

    torch.set_num_threads(1)
    model = load_stage(model_dir, first, last)
    loaded = rss_mib()
    probe = model.new_cache(max_len)
    per_session = probe.k.nbytes + probe.v.nbytes
    del probe
    d = model.config.hidden_size
    msgs: list[Message] = []
    for i in range(n + 1):  # the last one is past the budget
        msgs.append(OpenSession(SessionId(i + 1), max_len=max_len))
    for i in range(n):
        sid = SessionId(i + 1)
        if model.is_first:
            ids: tuple[int, ...] | None = tuple(range(10 + i, 18 + i))
            msgs.append(Prefill(sid, Epoch(0), ChunkSeq(0), 0, True, ids=ids))
        else:
            hid = to_wire(torch.randn(1, 8, d))
            msgs.append(Prefill(sid, Epoch(0), ChunkSeq(0), 0, True, hidden=hid))
    for i in range(n):
        sid = SessionId(i + 1)
        if model.is_first:
            msgs.append(Verify(sid, Epoch(0), ChunkSeq(1), 8, ids=(5,)))
        else:
            msgs.append(Verify(sid, Epoch(0), ChunkSeq(1), 8, hidden=to_wire(torch.randn(1, 1, d))))
    inbox_send, inbox_recv = trio.open_memory_channel[Message](len(msgs))
    outbox_send, outbox_recv = trio.open_memory_channel[Message](len(msgs) + 1)
    config = ExecutorConfig(
        NodeName(f"s{first}"), max_sessions=n + 1, max_len=max_len, kv_budget_bytes=n * per_session
    )
    executor = StageExecutor(model, config, inbox_recv, outbox_send)
    for msg in msgs:
        inbox_send.send_nowait(msg)
    inbox_send.close()
    await executor.run()
    async with outbox_recv:
        out = [m async for m in outbox_recv]
    with_sessions = rss_mib()
    stats = executor.statistics()
    for sess in executor._sessions.values():  # write every position of every cache
        sess.cache.k.fill_(1.0)
        sess.cache.v.fill_(1.0)
    touched = rss_mib()
    faults = [m for m in out if isinstance(m, Fault)]
    return {
        "layers": [first, last],
        "rss_loaded_mib": loaded,
        "rss_with_sessions_mib": with_sessions,
        "rss_cache_touched_mib": touched,
        "kv_mib_counted": stats.kv_bytes / MIB,
        "kv_mib_arithmetic": n * per_session / MIB,
        "per_session_mib": per_session / MIB,
        "sessions_open": stats.sessions,
        "max_rows_in_one_forward": stats.max_batch_rows,
        "refused": [{"session": f.session, "kind": f.kind, "detail": f.detail} for f in faults],
    }


def child(args: argparse.Namespace) -> int:
    from shard.convert.bundled import resolve_model

    first, last = (int(x) for x in args.block.split(","))
    model_dir = resolve_model(args.model, progress=False)
    rec = trio.run(measure_block, model_dir, first, last, args.sessions, args.max_len)
    print(json.dumps(rec))
    return 0


def blocks(n_layers: int, stages: int) -> list[tuple[int, int]]:
    from shard.spec.validate import even_split

    return list(even_split("bench", stages, n_layers))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.block is not None:
        return child(args)
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig

    model_dir = resolve_model(args.model)
    config = ModelConfig.from_dir(model_dir)
    stages = []
    for first, last in blocks(config.n_layers, args.stages):
        cmd = [sys.executable, __file__, "--block", f"{first},{last}", "--model", args.model]
        cmd += ["--sessions", str(args.sessions), "--max-len", str(args.max_len)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        rec = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"[batch_memory] layers {first}-{last}: {rec['rss_loaded_mib']:.0f} MiB loaded, "
            f"{rec['rss_with_sessions_mib']:.0f} MiB with {rec['sessions_open']} sessions, "
            f"{rec['rss_cache_touched_mib']:.0f} MiB with every position written",
            file=sys.stderr,
        )
        stages.append(rec)
    out = {
        "benchmark": "batch_memory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "bench/batch_memory.py", *(argv or sys.argv[1:])]),
        "git": git_info(),
        "machine": machine_info(),
        "loadavg": list(os.getloadavg()),
        "config": {
            "model": args.model,
            "sessions": args.sessions,
            "max_len": args.max_len,
            "stages": args.stages,
            "dtype": "float32",
        },
        "stages": stages,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"[batch_memory] wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
