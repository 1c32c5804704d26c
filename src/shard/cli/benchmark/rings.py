"""The benchmark's rings and requests: one ring of processes per draft and latency, requests
one at a time, interleaved prompt by prompt so a drift in the machine's load hits every mode.

A request's record keeps the ring's own statistics (``GenerateDone.stats``) and the client's
timeline (when each ``TokensOut`` arrived), from which decode-only numbers are derived: the
first ``TokensOut`` ends the prefill lap, and per-stage compute and per-edge transit of the
prefill lap are taken from a 1-token probe of the same prompt (``decode_parts``).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import trio

from shard.cli.benchmark.options import Prompt
from shard.cli.benchmark.ringspec import RingBase, Speculation, base_ring_toml, free_ports
from shard.messages import GenerateDone, GenerateRequest
from shard.spec.nodes import EdgeSpec
from shard.spec.swarm import load_spec
from shard.transport import Network

Record = dict[str, Any]
MODE_REQUEST: dict[str, tuple[int, int]] = {
    "plain": (0, 0),  # k = 0: plain decoding
    "spec": (-1, 1),  # the ring's K policy, one chunk in flight
    "pipelined": (-1, 0),  # the ring's K and depth policy
}


@attrs.frozen
class Ring:
    """A running ring of processes and what it was started from: its swarm name, its hops
    (each edge's emulated latency) and its spec's text."""

    draft: str
    latency_ms: float
    swarm: str
    hops: tuple[EdgeSpec, ...]
    spec_text: str
    coordinator: str
    relays: tuple[str, ...]
    startup_s: float

    @property
    def latency_s(self) -> float:
        """Λ: the emulated latency summed over the ring's edges."""
        return sum(e.latency_ms for e in self.hops) / 1000.0


@attrs.frozen
class Reply:
    """A finished request and its client-side timeline: (seconds after sending, tokens)."""

    done: GenerateDone
    arrivals: tuple[tuple[float, int], ...]


async def start_ring(
    nursery: trio.Nursery,
    base: RingBase,
    model_dir: Path,
    *,
    draft: str,
    speculation: Speculation,
    latency_ms: float,
    workdir: Path,
    log: IO[bytes],
) -> Ring:
    """Launch one ring in ``nursery`` (its nodes' stderr goes to ``log``); returns once ready."""
    from shard.nodes.launcher import launch

    name = f"bench-{draft}-{latency_ms:g}ms".replace(".", "_")
    path = workdir / f"{name}.toml"
    ports = free_ports(len(base.stages) + 1)
    path.write_text(
        base_ring_toml(base, name=name, ports=ports, latency_ms=latency_ms, speculation=speculation)
    )
    spec = load_spec(path)
    began = trio.current_time()
    handle = await nursery.start(
        lambda task_status: launch(
            path, spec, model_dir=model_dir, stderr=log, task_status=task_status
        )
    )
    startup = trio.current_time() - began
    return Ring(
        draft,
        latency_ms,
        spec.name,
        spec.hops(),
        path.read_text(),
        handle.coordinator,
        handle.relays,
        startup,
    )


async def ask(
    network: Network,
    ring: Ring,
    prompt: Prompt,
    *,
    mode: str,
    max_tokens: int,
    rid: int,
    timeout_s: float,
    ignore_eos: bool = False,
) -> Reply:
    """One request; a request the ring fails is an error, not a data point."""
    from shard.coordinator.client import stream

    k, depth = MODE_REQUEST[mode]
    req = GenerateRequest(
        rid, prompt.text, max_tokens, chat=prompt.chat, k=k, depth=depth, ignore_eos=ignore_eos
    )
    arrivals: list[tuple[float, int]] = []
    began = trio.current_time()

    with trio.fail_after(timeout_s):
        async with stream(network, ring.coordinator, req, swarm=ring.swarm) as pieces:
            async for piece in pieces:
                if isinstance(piece, GenerateDone):
                    done = piece
                else:
                    arrivals.append((trio.current_time() - began, len(piece.token_ids)))
    if done.finish_reason == "error":
        raise RuntimeError(f"{ring.swarm}: {mode}: {prompt.name}: {done.error}")
    return Reply(done, tuple(arrivals))


def prefill_compute(probes: Sequence[Reply]) -> dict[str, tuple[float, int]]:
    """Per node, (compute seconds, chunks) of a prompt's prefill: the median over probes of
    the same prompt on the rings of one latency (same stages, same code: one estimate)."""
    by_node: dict[str, list[tuple[float, int]]] = {}
    for probe in probes:
        for n in probe.done.stats.nodes:
            by_node.setdefault(n.node, []).append((n.compute_s, n.chunks))
    return {
        node: (statistics.median(c for c, _ in v), round(statistics.median(k for _, k in v)))
        for node, v in by_node.items()
    }


def decode_parts(
    reply: Reply, probe: Reply, prefill: Mapping[str, tuple[float, int]], ring: Ring
) -> Record:
    """Decode-only numbers of ``reply``: the run minus its prefill lap (from the probes)."""
    stats, done = reply.done.stats, reply.done
    first_t, first_n = reply.arrivals[0] if reply.arrivals else (0.0, 0)
    last_t = reply.arrivals[-1][0] if reply.arrivals else 0.0
    decode_tokens = len(done.token_ids) - first_n
    decode_s = last_t - first_t
    chunks = stats.laps - probe.done.stats.laps
    nodes = []
    for n in stats.nodes:
        pre_s, pre_chunks = prefill.get(n.node, (0.0, 0))
        count = n.chunks - pre_chunks
        per_chunk = (n.compute_s - pre_s) / count if count > 0 else None
        nodes.append({**attrs.asdict(n), "decode_chunks": count, "decode_chunk_s": per_chunk})
    probe_edges = {(e.src, e.dst): e for e in probe.done.stats.edges}
    latency = {(e.src, e.dst): e.latency_ms / 1000.0 for e in ring.hops}
    edges = []
    for e in stats.edges:
        pe = probe_edges.get((e.src, e.dst))
        total = e.mean_s * stats.laps - (pe.mean_s * probe.done.stats.laps if pe else 0.0)
        decode = total / chunks if chunks > 0 else None
        lat = latency.get((e.src, e.dst), 0.0)
        edges.append({**attrs.asdict(e), "decode_mean_s": decode, "latency_s": lat})
    transit = [e["decode_mean_s"] for e in edges]
    return {
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "chunks": chunks,
        "nodes": nodes,
        "edges": edges,
        "wire_s": None if None in transit else sum(transit) - ring.latency_s,
        "loadavg_1min": os.getloadavg()[0],
    }
