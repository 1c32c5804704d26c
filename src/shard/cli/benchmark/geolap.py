"""A plan's lap, measured: its ring run as local processes behind the plan's latencies
(``shard.placement.emulate``), plain decoding (one lap, one token), against the lap the
latency model predicts. ``bench/lap_geography.py`` and ``tests/test_lap_geography.py``.

The measured lap is the client's view: the interval between consecutive ``TokensOut`` of one
request (each is one committed token, so one lap of the ring), the first (prefill) left out;
the client dials the coordinator directly, so no emulated latency sits on that path. The
prediction is the plan's one-way latency summed over the hops (times the emulation's scale)
plus the compute the ring itself reported for the same request (each stage's compute per
chunk, ``GenerateDone.stats.nodes``; the prefill chunk is in that mean, a 1/laps share): the
geography's GPU speeds are not emulated, so the prediction uses the local compute.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import attrs
import trio

from shard.messages import GenerateDone, GenerateRequest
from shard.nodes.launcher import SwarmHandle, launch
from shard.placement import Plan
from shard.placement.emulate import emulated_spec
from shard.spec.swarm import SwarmSpec, load_spec
from shard.transport import Network

__all__ = ["LapRun", "Tolerance", "measure", "quantile", "start_plan", "write_plan_spec"]


@attrs.frozen
class Tolerance:
    """How far a measured lap may sit from the predicted one: ``rel`` of the prediction plus
    ``per_hop_ms`` for each hop of the ring, for what the lap model leaves out (framing,
    sockets, the nodes' event loops and the delaying relay's own pass). Measured on a shared
    2-core box (``docs/placement.md``, "Measured vs predicted lap"): ~1.8 ms a hop with direct
    links and ~3 ms through the relays at load ~2, 6-8 ms through them at load 5-8; 8 ms a
    hop and 20 % cover the worst of those."""

    rel: float = 0.20
    per_hop_ms: float = 8.0

    def allowed_ms(self, predicted_ms: float, hops: int) -> float:
        """The largest ``|measured - predicted|`` accepted, in ms."""
        return self.rel * predicted_ms + self.per_hop_ms * hops

    def holds(self, measured_ms: float, predicted_ms: float, hops: int) -> bool:
        return abs(measured_ms - predicted_ms) <= self.allowed_ms(predicted_ms, hops)


@attrs.frozen
class LapRun:
    """One plain request through a plan's emulated ring: the laps the client saw (ms, prefill
    left out), the ring's own mean lap, its compute per lap summed over the stages and its
    edges' transit summed over the ring (wall-clock hop stamps; one host), in ms, and the
    prediction (emulated latency + that compute). Transit minus latency is what the wire and
    the relays add; the rest of the gap is time in the nodes off the forward pass."""

    laps_ms: tuple[float, ...]
    ring_mean_lap_ms: float
    compute_ms: float
    latency_ms: float
    transit_ms: float = 0.0  # the ring's mean one-way transit, summed over its edges

    @property
    def predicted_ms(self) -> float:
        return self.latency_ms + self.compute_ms

    @property
    def median_ms(self) -> float:
        return statistics.median(self.laps_ms)

    def as_json(self) -> dict[str, float | int]:
        return {
            "laps": len(self.laps_ms),
            "median_ms": self.median_ms,
            "p10_ms": quantile(self.laps_ms, 0.10),
            "p90_ms": quantile(self.laps_ms, 0.90),
            "ring_mean_lap_ms": self.ring_mean_lap_ms,
            "latency_ms": self.latency_ms,
            "compute_ms": self.compute_ms,
            "predicted_ms": self.predicted_ms,
            "ratio": self.median_ms / self.predicted_ms,
            "transit_ms": self.transit_ms,
            "edge_overhead_ms": self.transit_ms - self.latency_ms,
        }


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def write_plan_spec(
    plan: Plan,
    path: Path,
    *,
    name: str,
    model_dir: Path,
    n_layers: int,
    ports: Sequence[int],
    scale: float,
) -> SwarmSpec:
    """Write the emulation's spec for ``plan`` to ``path`` and load it back."""
    text = emulated_spec(
        plan, name=name, model=str(model_dir), n_layers=n_layers, ports=ports, scale=scale
    )
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


async def start_plan(
    nursery: trio.Nursery,
    spec_path: Path,
    spec: SwarmSpec,
    model_dir: Path,
    *,
    stderr: int | IO[bytes] | None = None,
) -> SwarmHandle:
    """Launch ``spec`` (``shard.nodes.launcher.launch``) in ``nursery``; returns once every
    node serves. Cancelling ``nursery`` stops every process, by PID (the launcher's way out)."""

    async def run(task_status: trio.TaskStatus[SwarmHandle]) -> None:
        await launch(spec_path, spec, model_dir=model_dir, stderr=stderr, task_status=task_status)

    handle: SwarmHandle = await nursery.start(run)
    return handle


async def measure(
    network: Network,
    coordinator: str,
    spec: SwarmSpec,
    *,
    prompt: str,
    tokens: int,
    rid: int,
    timeout_s: float,
) -> LapRun:
    """One plain request of ``tokens`` tokens (EOS ignored); its laps and prediction.

    Errors: ``RuntimeError`` for a request the ring fails; ``trio.TooSlowError`` after
    ``timeout_s``."""
    from shard.coordinator.client import stream

    arrivals: list[float] = []  # one per commit: one token per lap when plain
    req = GenerateRequest(rid, prompt, tokens, k=0, ignore_eos=True)
    with trio.fail_after(timeout_s):
        async with stream(network, coordinator, req, swarm=spec.name) as pieces:
            async for piece in pieces:
                if isinstance(piece, GenerateDone):
                    done = piece
                elif piece.token_ids:
                    arrivals.append(trio.current_time())
    if done.finish_reason == "error":
        raise RuntimeError(f"{spec.name}: {done.error}")
    latency_ms = sum(e.latency_ms for e in spec.hops())
    laps = tuple(1000.0 * (b - a) for a, b in itertools.pairwise(arrivals))
    transit = 1000.0 * sum(e.mean_s for e in done.stats.edges)
    return LapRun(laps, 1000.0 * done.stats.mean_lap_s, compute_ms(done), latency_ms, transit)


def compute_ms(done: GenerateDone) -> float:
    """Each stage's mean compute per chunk, summed over the stages (ms)."""
    return 1000.0 * sum(n.compute_s / n.chunks for n in done.stats.nodes if n.chunks)
