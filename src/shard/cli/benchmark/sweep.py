"""The sweep: per latency, one ring per draft, every prompt through every mode, interleaved.

Per latency the rings start together (the ring of the first draft also serves plain
decoding, with k = 0), each (ring, mode) gets one discarded warm-up request, then per prompt:
a 1-token probe on every ring, plain, and spec and pipelined on each draft's ring. The rings
stop before the next latency's start, so at most one latency's rings hold memory at a time.

Cancellation: cancelling the sweep stops every ring (``shard.nodes.launcher.launch`` kills its
nodes).
Errors: a failed request or ring raises; a benchmark with a hole in it is not a result.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import trio

from shard.cli.benchmark.bound import Measured, bound
from shard.cli.benchmark.drafts import Reference
from shard.cli.benchmark.options import Options, Prompt
from shard.cli.benchmark.rings import (
    Record,
    Reply,
    Ring,
    ask,
    decode_parts,
    prefill_compute,
    start_ring,
)
from shard.cli.benchmark.ringspec import RingBase, Speculation
from shard.transport import Network


@attrs.frozen
class Plan:
    """What the sweep needs besides the options."""

    opts: Options
    base: RingBase  # what each ring keeps of the base spec
    model_dir: Path
    references: Mapping[str, Reference]  # by prompt name
    speculation: Mapping[str, Speculation]  # each draft's [speculation] table
    draft_token_s: Mapping[str, float]  # each draft's seconds per drafted token
    cores: int  # the cores the rings' processes share (the bound's P)
    workdir: Path
    log: IO[bytes]


async def sweep(plan: Plan) -> tuple[list[Record], list[Record]]:
    """Every latency in turn; returns (run records, ring records)."""
    from shard.transport import WebSocketNetwork

    runs: list[Record] = []
    rings: list[Record] = []
    rids = itertools.count(1)
    async with WebSocketNetwork() as network:
        for latency in plan.opts.latencies_ms:
            got, up = await _one_latency(plan, network, latency, rids)
            runs += got
            rings += up
    return runs, rings


async def _one_latency(
    plan: Plan, network: Network, latency_ms: float, rids: itertools.count[int]
) -> tuple[list[Record], list[Record]]:
    opts = plan.opts
    runs: list[Record] = []
    async with trio.open_nursery() as nursery:
        rings = await _start_rings(plan, nursery, latency_ms)

        async def one(ring: Ring, prompt: Prompt, mode: str, n: int) -> Reply:
            return await ask(
                network,
                ring,
                prompt,
                mode=mode,
                max_tokens=n,
                rid=next(rids),
                timeout_s=opts.request_timeout_s,
                ignore_eos=opts.ignore_eos,
            )

        for ring in rings:
            for mode in _modes(opts, ring is rings[0]):
                await one(ring, opts.prompts[0], mode, 8)  # warm-up, discarded
        for prompt in opts.prompts:
            probes = {ring.draft: await one(ring, prompt, "plain", 1) for ring in rings}
            prefill = prefill_compute(list(probes.values()))
            done: list[Record] = []
            for ring in rings:
                for mode in _modes(opts, ring is rings[0]):
                    reply = await one(ring, prompt, mode, opts.max_tokens)
                    ref = plan.references[prompt.name]
                    record = _record(ring, prompt, mode, reply, ref)
                    record.update(decode_parts(reply, probes[ring.draft], prefill, ring))
                    done.append(record)
            _bounds(done, plan, rings[0].latency_s)
            runs += done
            progress(_line(latency_ms, prompt, done))
        nursery.cancel_scope.cancel()
    return runs, [_ring_record(r) for r in rings]


async def _start_rings(plan: Plan, nursery: trio.Nursery, latency_ms: float) -> list[Ring]:
    """One ring per draft, started together (most of a start is nodes dialling each other,
    so starts overlap well); they run in ``nursery``."""
    started: dict[str, Ring] = {}

    async def start(draft: str) -> None:
        started[draft] = await start_ring(
            nursery,
            plan.base,
            plan.model_dir,
            draft=draft,
            speculation=plan.speculation[draft],
            latency_ms=latency_ms,
            workdir=plan.workdir,
            log=plan.log,
        )
        progress(f"{started[draft].swarm} up in {started[draft].startup_s:.1f} s")

    async with trio.open_nursery() as starting:
        for draft in plan.opts.drafts:
            starting.start_soon(start, draft)
    return [started[d] for d in plan.opts.drafts]


def _modes(opts: Options, first: bool) -> list[str]:
    return [m for m in opts.modes if m != "plain" or first]


def _record(ring: Ring, prompt: Prompt, mode: str, reply: Reply, ref: Reference) -> Record:
    done, stats = reply.done, reply.done.stats
    ids, want = list(done.token_ids), list(ref.output_ids)
    diverge = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), None)
    if diverge is None and len(ids) != len(want):
        diverge = min(len(ids), len(want))
    return {
        "latency_ms": ring.latency_ms,
        "mode": mode,
        "draft": None if mode == "plain" else ring.draft,
        "prompt": prompt.name,
        "set": prompt.set,
        "ring": ring.swarm,
        "tokens": len(ids),
        "finish_reason": done.finish_reason,
        "identical": diverge is None,
        "first_divergence": diverge,
        "seconds": stats.seconds,
        "tok_s": stats.tok_s,
        "prefill_s": stats.prefill_s,
        "laps": stats.laps,
        "mean_lap_s": stats.mean_lap_s,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "alpha": stats.accepted / stats.drafted if stats.drafted else None,
        "tokens_per_lap": stats.tokens_per_lap,
        "max_depth": stats.max_depth,
        "stale_dropped": stats.stale_dropped,
        "branches": stats.branches,
        "branches_won": stats.branches_won,
        "client_arrivals": [list(a) for a in reply.arrivals],
        "token_ids": ids,
    }


def _bounds(done: Sequence[Record], plan: Plan, latency_s: float) -> None:
    """Each record's bound. A pipelined run takes its wire overhead from the same ring's
    D = 1 run of the prompt (its own edge transit includes queueing behind other chunks), and
    its compute alone from there too when that run sent the same chunks (``alone_from``)."""
    alone = {r["draft"]: r for r in done if r["mode"] == "spec"}
    plain = next((r for r in done if r["mode"] == "plain"), None)
    for r in done:
        wire, source = r["wire_s"], r
        if r["mode"] == "pipelined":
            sibling = alone.get(r["draft"]) or plain
            wire = sibling["wire_s"] if sibling and sibling["wire_s"] is not None else wire
            if sibling and (sibling["chunks"], sibling["drafted"]) == (r["chunks"], r["drafted"]):
                source = sibling
        own = [n["decode_chunk_s"] for n in r["nodes"]]
        by_itself = [n["decode_chunk_s"] for n in source["nodes"]]
        r["tokens_per_chunk"] = r["decode_tokens"] / r["chunks"] if r["chunks"] > 0 else None
        r["alone_from"] = "own" if source is r else f"{source['mode']} run"
        r["bound"] = None
        if None in own or None in by_itself or wire is None:
            continue
        measured = Measured(
            tokens=r["decode_tokens"],
            chunks=r["chunks"],
            drafted=r["drafted"],
            accepted=r["accepted"],
            stage_chunk_s=tuple(own),
            latency_s=latency_s,
            wire_s=wire,
            draft_token_s=plan.draft_token_s.get(r["draft"], 0.0) if r["draft"] else 0.0,
            depth=max(r["max_depth"], 1) if r["mode"] == "pipelined" else 1,
            cores=plan.cores,
            alone_chunk_s=tuple(by_itself),
        )
        b = bound(measured)
        r["bound"] = None if b is None else {**attrs.asdict(b), "wire_s": wire}
        if b is not None and r["decode_tok_s"] is not None:
            r["vs_bound"] = r["decode_tok_s"] / b.steady_tok_s
            r["vs_request_bound"] = r["decode_tok_s"] / b.request_tok_s


def _ring_record(ring: Ring) -> Record:
    return {
        "name": ring.swarm,
        "draft": ring.draft,
        "latency_ms": ring.latency_ms,
        "startup_s": ring.startup_s,
        "relays": list(ring.relays),
        "spec": ring.spec_text,
    }


def _line(latency_ms: float, prompt: Prompt, done: Sequence[Record]) -> str:
    parts = []
    for r in done:
        label = r["mode"] if r["draft"] is None else f"{r['mode']}/{r['draft']}"
        rate: Any = r["decode_tok_s"]
        parts.append(f"{label} {rate:.1f}" if rate is not None else f"{label} -")
    return f"{latency_ms:g} ms {prompt.name}: decode tok/s " + "  ".join(parts)


def progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)
