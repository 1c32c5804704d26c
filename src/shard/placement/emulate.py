"""A plan as a swarm on one machine: the spec that runs its ring on loopback, every hop
delayed by the plan's one-way latency (``docs/placement.md``, "Measured vs predicted lap").

What is emulated and what is not:

- **Latency**: each hop of the ring gets a ``[[links.edge]]`` override of
  ``scale`` x ``Hop.ms``, the planner's one-way latency (half the round trip; a relayed hop
  already holds its detour). ``[links]`` latencies are one way on the hop ``from -> to`` (the
  launcher's delaying relay in front of ``to``), which is exactly what the lap model sums.
- **Reachability**: not emulated. Every node listens on loopback; a relayed hop is one
  delayed link of the detour's latency.
- **Compute**: not emulated. Each stage is a real process computing its block on this
  machine's CPU; the geography's per-layer speeds (GPUs) are not imitated. A lap measured on
  the emulation is compared with the plan's latency (scaled) plus the compute the same run
  measured, so what is checked is the latency model, not the speeds.
- **Blocks**: the plan's split of the geography's model is mapped onto the local model's
  ``n_layers`` in proportion (every stage keeps at least one layer).

Pure: text in, text out; the caller picks the ports and writes the file.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

from shard.placement.lap import Plan
from shard.placement.problem import PlanError

__all__ = ["emulated_latency_ms", "emulated_spec", "scaled_blocks"]

LOOPBACK = "127.0.0.1"


def scaled_blocks(plan: Plan, n_layers: int) -> tuple[tuple[int, int], ...]:
    """The plan's blocks mapped onto a model of ``n_layers`` layers: each boundary scaled in
    proportion and rounded, then nudged so every stage keeps at least one layer.

    Errors: ``PlanError`` when the model has fewer layers than the plan has stages."""
    stages = len(plan.stages)
    if n_layers < stages:
        raise PlanError(
            f"a model of {n_layers} layers cannot hold a ring of {stages} stages; use a model "
            "with at least one layer per stage"
        )
    total = plan.stages[-1].last
    bounds = [0]
    for i, stage in enumerate(plan.stages[:-1], start=1):
        want = round(stage.last * n_layers / total)
        bounds.append(min(max(want, bounds[-1] + 1), n_layers - (stages - i)))
    bounds.append(n_layers)
    return tuple((a, b) for a, b in itertools.pairwise(bounds))


def emulated_latency_ms(plan: Plan, scale: float = 1.0) -> float:
    """The one-way latency summed over the ring's hops, as emulated: ``scale`` x the plan's."""
    return scale * plan.latency_ms


def emulated_spec(
    plan: Plan,
    *,
    name: str,
    model: str,
    n_layers: int,
    ports: Sequence[int],
    scale: float = 1.0,
    max_len: int = 512,
) -> str:
    """The TOML of a loopback swarm running ``plan``'s ring: the coordinator and stages named
    as in the plan, on ``ports`` (coordinator first), the blocks of ``scaled_blocks``, every
    hop delayed ``scale`` x its one-way latency, plain decoding (``draft = "none"``: one lap,
    one token). ``model`` is the spec's ``[swarm] model`` (a bundled name or a directory).

    Errors: ``PlanError`` for a wrong number of ports, a negative scale, or a model with
    fewer layers than stages."""
    if len(ports) != len(plan.stages) + 1:
        raise PlanError(f"give {len(plan.stages) + 1} ports (coordinator first), not {len(ports)}")
    if not scale >= 0:
        raise PlanError(f"the latency scale must be >= 0, got {scale!r}")
    blocks = scaled_blocks(plan, n_layers)
    lines = [
        f"# The plan {' -> '.join(plan.ring())}, emulated on loopback (shard.placement.emulate):",
        f"# one-way latency per hop = {scale:g} x the plan's; compute is this machine's.",
        "[swarm]",
        f"name = {json.dumps(name)}",
        f"model = {json.dumps(model)}",
        'dtype = "float32"',
        "insecure = true",
        "",
        "[limits]",
        f"max_sessions = 4\nmax_len = {max_len}\nprefill_chunk = 128",
        "max_message_mib = 64\nconnect_timeout_s = 10.0",
        "",
        "[coordinator]",
        f"name = {json.dumps(plan.coordinator)}",
        f'listen = "{LOOPBACK}:{ports[0]}"',
    ]
    for stage, (first, last), port in zip(plan.stages, blocks, ports[1:], strict=True):
        lines += ["", "[[stage]]", f"name = {json.dumps(stage.node)}"]
        lines += [f'listen = "{LOOPBACK}:{port}"', f"layers = [{first}, {last}]"]
    lines += ["", "[links]", "latency_ms = 0.0", "bandwidth_mbps = 0"]
    for hop in plan.hops:
        via = f"  # relayed via {hop.via} in the plan" if hop.via else ""
        lines += ["", "[[links.edge]]", f"from = {json.dumps(hop.src)}"]
        lines += [f"to = {json.dumps(hop.dst)}", f"latency_ms = {scale * hop.ms!r}{via}"]
    lines += ["", "[speculation]", 'draft = "none"  # plain decoding: one lap per token', ""]
    return "\n".join(lines)
