"""Launch a whole swarm from a spec as local processes (``shard swarm up`` / ``swarm run``).

One ``shard up`` child process per node, plus — when the spec gives edge latencies — one
delaying TCP relay per ring edge, run inside this launcher process, so the children see real
latency without root or kernel modules. Each child prints one machine-readable line when it is
ready (``SHARD READY node=NAME pid=PID address=HOST:PORT``); the launcher waits for every node,
and on exit (Ctrl-C, an error, the end of ``swarm run``) terminates every child by PID:
SIGTERM, then SIGKILL after a grace period. No orphans.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import attrs
import trio

from shard.spec.swarm import SwarmSpec
from shard.transport.relay import DelayRelay

log = logging.getLogger(__name__)

READY_PREFIX = "SHARD READY"
_GRACE_S = 5.0


class SwarmError(Exception):
    """A node of the swarm failed to start or died."""


@attrs.frozen
class SwarmHandle:
    """A running local swarm: where clients reach the coordinator, and every child's PID.

    ``relay_of`` maps a node to the relay in front of its downstream edge (``sever`` cuts
    there); ``expect_exit(name)`` tells the launcher a node is about to be killed on purpose
    (a scripted fault), so its exit does not end the swarm.
    """

    spec: SwarmSpec
    coordinator: str
    pids: dict[str, int]
    relays: tuple[str, ...] = ()
    relay_of: dict[str, DelayRelay] = attrs.field(factory=dict)
    expected: set[str] = attrs.field(factory=set)
    api: str | None = None  # the coordinator's HTTP API (http://HOST:PORT), when served

    def expect_exit(self, name: str) -> None:
        self.expected.add(name)


def ready_line(node: str, address: str, api: str | None = None) -> str:
    """The line a node prints on stdout once it serves (parsed by ``launch``); a coordinator
    serving the HTTP API adds ``api=http://HOST:PORT``."""
    line = f"{READY_PREFIX} node={node} pid={os.getpid()} address={address}"
    return line if api is None else f"{line} api={api}"


def _parse_ready(line: str) -> dict[str, str] | None:
    if not line.startswith(READY_PREFIX):
        return None
    fields = dict(part.split("=", 1) for part in line[len(READY_PREFIX) :].split() if "=" in part)
    return fields if {"node", "pid", "address"} <= fields.keys() else None


async def _start_relays(
    spec: SwarmSpec, nursery: trio.Nursery
) -> tuple[dict[str, str], tuple[str, ...], dict[str, DelayRelay]]:
    """A relay per ring edge with latency or a bandwidth cap, or a scripted ``sever``;
    returns node -> dial override, descriptions, node -> relay."""
    listen = {spec.coordinator.name: str(spec.coordinator.listen)}
    listen.update({s.name: str(s.listen) for s in spec.stages})
    overrides: dict[str, str] = {}
    relays: list[str] = []
    relay_of: dict[str, DelayRelay] = {}
    severed = {f.node for f in spec.faults if f.kind == "sever"}
    ring = spec.ring()
    for src, dst in itertools.pairwise(ring):
        edge = spec.edge(src, dst)
        if edge.latency_ms <= 0 and edge.bandwidth_mbps <= 0 and src not in severed:
            continue
        relay = DelayRelay(
            "127.0.0.1:0",
            listen[dst],
            latency_s=edge.latency_ms / 1000.0,
            bandwidth_bps=edge.bandwidth_mbps * 1e6,
        )
        bound: str = await nursery.start(relay.run)
        overrides[src] = bound
        relay_of[src] = relay
        relays.append(f"{src}->{dst} via {bound} ({edge.latency_ms:g} ms)")
    return overrides, tuple(relays), relay_of


def _command(
    spec_path: Path,
    node: str,
    role: str,
    model_dir: Path,
    via: str | None,
    threads: int,
    api: str | None = None,
) -> list[str]:
    cmd = [sys.executable, "-m", "shard", "up", "--role", role, "--spec", str(spec_path)]
    cmd += ["--node", node, "--model", str(model_dir), "--threads", str(threads)]
    if via is not None:
        cmd += ["--successor", via]
    if api is not None and role == "coordinator":
        cmd += ["--api", api]
    return cmd


async def _watch(
    name: str,
    proc: trio.Process,
    ready: trio.MemorySendChannel[dict[str, str]],
    expected: set[str],
) -> None:
    """Read a child's stdout for its READY line, then keep draining; a child that exits
    while the swarm runs is an error, unless a scripted fault killed it (``expected``)."""
    assert proc.stdout is not None
    buffer = b""
    async with ready:
        async for chunk in proc.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                fields = _parse_ready(raw.decode(errors="replace").strip())
                if fields is not None:
                    await ready.send(fields)
    code = await proc.wait()
    if name in expected:
        log.info("node %s (pid %d) exited with code %d, as scripted", name, proc.pid, code)
        return
    raise SwarmError(f"node {name} (pid {proc.pid}) exited with code {code}; see its log above")


async def _terminate(procs: list[trio.Process]) -> None:
    """SIGTERM every child, wait up to the grace period, SIGKILL what is left."""
    with trio.CancelScope(shield=True):
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(_GRACE_S):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def launch(
    spec_path: Path,
    spec: SwarmSpec,
    *,
    model_dir: Path,
    startup_timeout_s: float = 180.0,
    stderr: int | IO[bytes] | None = None,
    api: str | None = None,
    task_status: trio.TaskStatus[SwarmHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start every node of ``spec`` and keep them running until cancelled.

    ``api`` (``HOST:PORT``) makes the coordinator serve the HTTP API there (``--api``).

    The children's stderr is ours unless ``stderr`` (a file, ``subprocess.DEVNULL``) is given:
    ``swarm up --monitor`` sends it to a log file, away from the monitor's screen.

    Errors: ``SwarmError`` when a node exits or the swarm is not ready in time.
    """
    procs: list[trio.Process] = []
    try:
        async with trio.open_nursery() as nursery:
            overrides, relays, relay_of = await _start_relays(spec, nursery)
            expected: set[str] = set()
            ready_send, ready_recv = trio.open_memory_channel[dict[str, str]](0)
            nodes = [(s.name, "stage") for s in spec.stages]
            nodes.append((spec.coordinator.name, "coordinator"))
            nodes += [(s.name, "standby") for s in spec.standbys]
            # Every node computes on this machine: give each its share of the cores, since
            # torch's default (all cores per process) thrashes when processes compete.
            threads = max(1, (os.cpu_count() or 1) // len(nodes))
            async with ready_send:
                for name, role in nodes:
                    via = overrides.get(name)
                    cmd = _command(spec_path, name, role, model_dir, via, threads, api)
                    proc = await trio.lowlevel.open_process(
                        cmd, stdout=subprocess.PIPE, stderr=stderr
                    )
                    procs.append(proc)
                    nursery.start_soon(_watch, name, proc, ready_send.clone(), expected)
            seen: dict[str, dict[str, str]] = {}
            with trio.move_on_after(startup_timeout_s) as waited:
                async for fields in ready_recv:
                    seen[fields["node"]] = fields
                    if len(seen) == len(nodes):
                        break
            if waited.cancelled_caught:
                missing = sorted({n for n, _ in nodes} - seen.keys())
                raise SwarmError(f"nodes not ready after {startup_timeout_s:g} s: {missing}")
            pids = {name: int(f["pid"]) for name, f in seen.items()}
            address = seen[spec.coordinator.name]["address"]
            api_address = seen[spec.coordinator.name].get("api")
            task_status.started(
                SwarmHandle(spec, address, pids, relays, relay_of, expected, api_address)
            )
    finally:
        await _terminate(procs)
