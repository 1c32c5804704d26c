"""Launch a whole swarm from a spec as local processes (``shard swarm up`` / ``swarm run``).

One ``shard up`` child process per node, plus — when the spec gives edge latencies — one
delaying TCP relay per ring edge, run inside this launcher process, so the children see real
latency without root or kernel modules. Each child prints one machine-readable line when it is
ready (``SHARD READY node=NAME pid=PID address=HOST:PORT``); the launcher waits for every node.

Once the swarm is up the launcher supervises as the scheduler does: a stage or standby that
exits is reported (``SHARD NODE EXITED node=NAME pid=PID code=CODE``, sent on ``exits``) and
left to failover — the coordinator's scheduler splices a standby in its place — and the rest
serve on. A spec whose ``[coordinator]`` names a ``standby`` address gets a standby coordinator
process too (``shard up --role coordinator --standby-of PRIMARY``, launched as
``COORD/standby``); then the primary's exit is reported like a stage's and the standby takes
over. Only the last coordinator's exit, or any exit before the swarm is up, ends the swarm
(``SwarmError``).

No child outlives the launcher. Each runs in a session of its own (so a terminal's Ctrl-C or
hang-up reaches the launcher, which stops the nodes in order, not every node at once), and on
every way out (cancellation, an error, the end of ``swarm run``) the launcher terminates each
child's process group by PID: SIGTERM, then SIGKILL after a grace period. For the ways out it
does not live through (SIGKILL, a crash) each child watches the launcher's PID and stops
itself (``shard up --die-with-parent``, ``shard.nodes.lifeline``).
"""

from __future__ import annotations

import errno
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

from shard.nodes.startup import StartTimeout, cpu_of, wait_ready
from shard.spec.api import parse_api_address
from shard.spec.failover import FaultSpec
from shard.spec.layout import Layout
from shard.spec.swarm import SwarmSpec
from shard.transport.base import ListenError, split_address
from shard.transport.relay import DelayRelay

log = logging.getLogger(__name__)

READY_PREFIX = "SHARD READY"
EXITED_PREFIX = "SHARD NODE EXITED"
_GRACE_S = 5.0
#: A node's exit code when the swarm replaced it (declared dead after a freeze, or evicted by
#: an audit; ``NodeReplaced``): not an error of the run, which a standby carries on.
REPLACED_EXIT = 3
#: The launcher's name for the standby coordinator process of coordinator ``COORD``: not a
#: valid node name, so it never collides with one (``SHARD NODE EXITED node=coord/standby``)
STANDBY_SUFFIX = "/standby"


class SwarmError(Exception):
    """The swarm did not come up (a node exited first, or was not ready in time), or its
    coordinator died."""


@attrs.frozen
class SwarmHandle:
    """A running local swarm: its name, where clients reach the coordinator, and every
    child's PID.

    ``faults``: the spec's ``[[faults]]`` (``shard.nodes.script`` carries them out);
    ``relay_of`` maps a node to the relay in front of its downstream edge (``sever`` cuts
    there); ``expect_exit(name)`` tells the launcher a node is about to be killed on purpose
    (a scripted fault), so its exit is reported as scripted.
    """

    swarm: str
    faults: tuple[FaultSpec, ...]
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


@attrs.frozen
class NodeExit:
    """A stage or standby that exited while the swarm ran (``scripted``: by a ``[[faults]]``
    entry); the swarm serves on, failover replacing it."""

    node: str
    pid: int
    code: int  # negative: killed by that signal
    scripted: bool = False

    def line(self) -> str:
        """The machine-readable form ``swarm up`` prints on stdout."""
        return f"{EXITED_PREFIX} node={self.node} pid={self.pid} code={self.code}"


@attrs.define
class Supervisor:
    """What a child's exit means: ``exited`` raises ``SwarmError`` when it ends the swarm
    (before every node was ready, or the last of its coordinators), else returns its
    ``NodeExit`` report.

    ``coordinators``: the coordinator processes still running — the primary, and the standby
    coordinator (``COORD/standby``) when the spec names one."""

    coordinator: str
    expected: set[str]
    up: bool = False
    coordinators: set[str] = attrs.field(
        default=attrs.Factory(lambda self: {self.coordinator}, takes_self=True)
    )

    def exited(self, name: str, pid: int, code: int) -> NodeExit:
        if not self.up:
            raise SwarmError(
                f"node {name} (pid {pid}) exited with code {code} before the swarm was up; "
                "see its log above"
            )
        scripted = name in self.expected
        if name in self.coordinators:
            self.coordinators.discard(name)
            if not self.coordinators:
                raise SwarmError(
                    f"coordinator {name} (pid {pid}) exited with code {code}; no other "
                    "coordinator runs and a swarm cannot replace its last one, so every node "
                    "is stopped; see its log above ([coordinator] standby adds a standby "
                    "coordinator: docs/failover.md)"
                )
            if not scripted:
                log.warning(
                    "coordinator %s (pid %d) exited with code %d; %s serves on "
                    "(docs/failover.md, 'Standby coordinator')",
                    name,
                    pid,
                    code,
                    ", ".join(sorted(self.coordinators)),
                )
        elif scripted:
            log.info("node %s (pid %d) exited with code %d, as scripted", name, pid, code)
        elif code == REPLACED_EXIT:
            log.info("node %s (pid %d) was replaced by a standby and stopped", name, pid)
        else:
            log.warning(
                "node %s (pid %d) exited with code %d; the swarm serves on if a standby "
                "replaces it (docs/failover.md)",
                name,
                pid,
                code,
            )
        return NodeExit(name, pid, code, scripted)


def api_listen_error(listen: str, exc: OSError) -> ListenError:
    """The one line for an HTTP API address (``--api``, ``[api] listen``) that cannot be
    bound, as a ring port's ``ListenError`` says it."""
    port = listen.rpartition(":")[2]
    if exc.errno == errno.EADDRINUSE:
        why = (
            f"port {port} is already in use (another program, or another swarm's API, is "
            "listening there); stop it, or give --api (or [api] listen) another port"
        )
    else:
        why = exc.strerror or str(exc)
    return ListenError(f"cannot serve the HTTP API on {listen}: {why}")


async def check_api_free(listen: str) -> None:
    """Bind the API's address and let it go: a busy port fails here, in one line, before any
    node starts (the coordinator would find out only once its ring is up).

    Errors: ``ListenError`` (``api_listen_error``)."""
    host, port = split_address(listen)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise api_listen_error(listen, exc) from None
    for listener in listeners:
        await listener.aclose()


def _parse_ready(line: str) -> dict[str, str] | None:
    if not line.startswith(READY_PREFIX):
        return None
    fields = dict(part.split("=", 1) for part in line[len(READY_PREFIX) :].split() if "=" in part)
    return fields if {"node", "pid", "address"} <= fields.keys() else None


async def _start_relays(
    spec: SwarmSpec, nursery: trio.Nursery
) -> tuple[dict[str, str], tuple[str, ...], dict[str, DelayRelay]]:
    """A relay per ring edge with latency or a bandwidth cap, or a scripted ``sever``;
    returns node -> dial override, descriptions, node -> relay. A relay listens on any free
    port, never one of the swarm's own: those are held while the relays bind (``_held``)."""
    listen = {spec.coordinator.name: str(spec.coordinator.listen)}
    listen.update({s.name: str(s.listen) for s in spec.stages})
    overrides: dict[str, str] = {}
    relays: list[str] = []
    relay_of: dict[str, DelayRelay] = {}
    severed = {f.node for f in spec.faults if f.kind == "sever"}
    ring = spec.ring()
    held = await _held(spec)
    try:
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
    finally:
        for listener in held:
            await listener.aclose()
    return overrides, tuple(relays), relay_of


async def _held(spec: SwarmSpec) -> list[trio.SocketListener]:
    """Listeners on every fixed port the swarm's nodes and APIs will bind that is free now:
    while held, no "any free port" bind (a relay's) can be given one of them. A port taken
    already is skipped: its node reports it."""
    me = spec.coordinator
    addresses = [me.listen, me.standby, me.standby_api, spec.api.listen]
    addresses += [s.listen for s in spec.stages] + [s.listen for s in spec.standbys]
    held: list[trio.SocketListener] = []
    for address in addresses:
        host, port = split_address(str(address)) if address is not None else ("", 0)
        if port == 0:
            continue
        try:
            held += await trio.open_tcp_listeners(port, host=host)
        except OSError:
            continue
    return held


def _command(
    spec_path: Path,
    node: str,
    role: str,
    model_dir: Path,
    via: str | None,
    threads: int,
    api: str | None = None,
    layout: Layout | None = None,
    standby_of: str | None = None,
) -> list[str]:
    """``shard up`` for one node; ``standby_of``: a standby coordinator of the primary at
    that address (``node`` is the coordinator's name: the same role, at another address)."""
    cmd = [sys.executable, "-m", "shard", "up", "--role", role, "--spec", str(spec_path)]
    cmd += ["--node", node, "--model", str(model_dir), "--threads", str(threads)]
    cmd += ["--die-with-parent", str(os.getpid())]
    if layout is not None:
        cmd += ["--layout", str(layout)]
    if via is not None:
        cmd += ["--successor", via]
    if api is not None and role == "coordinator":
        cmd += ["--api", api]
    if standby_of is not None:
        cmd += ["--standby-of", standby_of]
    return cmd


async def _watch(
    name: str,
    proc: trio.Process,
    ready: trio.MemorySendChannel[dict[str, str]],
    supervisor: Supervisor,
    exits: trio.MemorySendChannel[NodeExit] | None,
) -> None:
    """Read a child's stdout for its READY line, then keep draining; when the child exits,
    ``supervisor`` decides whether that ends the swarm, and else its report goes to
    ``exits``."""
    assert proc.stdout is not None
    buffer = b""
    async with ready:
        async for chunk in proc.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                fields = _parse_ready(raw.decode(errors="replace").strip())
                if fields is not None:  # by the launcher's name (a standby coordinator's
                    await ready.send({**fields, "node": name})  # line names the coordinator)
    report = supervisor.exited(name, proc.pid, await proc.wait())
    if exits is not None:
        await exits.send(report)


def _signal_group(proc: trio.Process, sig: signal.Signals) -> None:
    """``sig`` to the child's process group (its PID: it leads its own session), while the
    child is unreaped, so that PID cannot belong to anyone else yet."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # exited since; reaped below
            pass


async def _terminate(procs: list[trio.Process]) -> None:
    """SIGTERM every child (and SIGCONT, for one a ``stall`` fault stopped), wait up to the
    grace period, SIGKILL what is left."""
    with trio.CancelScope(shield=True):
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
            _signal_group(proc, signal.SIGCONT)
        with trio.move_on_after(_GRACE_S):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()


async def launch(
    spec_path: Path,
    spec: SwarmSpec,
    *,
    model_dir: Path,
    startup_timeout_s: float = 180.0,
    stderr: int | IO[bytes] | None = None,
    exits: trio.MemorySendChannel[NodeExit] | None = None,
    api: str | None = None,
    layout: Layout | None = None,
    task_status: trio.TaskStatus[SwarmHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start every node of ``spec`` and keep them running until cancelled; a stage or standby
    that exits once the swarm is up is reported on ``exits`` and left to failover.

    ``api`` (``HOST:PORT``) makes the coordinator serve the HTTP API there (``--api``).
    ``layout``: the planned ring ``spec`` already runs (``shard.spec.layout.apply_layout``);
    each node reads the file at ``spec_path`` and is given it (``shard up --layout``).

    The children's stderr is ours unless ``stderr`` (a file, ``subprocess.DEVNULL``) is given:
    ``swarm up --monitor`` sends it to a log file, away from the monitor's screen.

    Cancellation: stops every child (``_terminate``), shielded, before returning.

    A spec whose ``[coordinator]`` names a ``standby`` address gets its standby coordinator
    (``COORD/standby``) too: the primary's exit is then one report and the standby takes
    over (docs/failover.md, "Standby coordinator").

    Errors: ``SwarmError`` when a node exits before the swarm is up, the last coordinator
    exits, or the swarm is not ready by ``startup_timeout_s`` and not working towards it (a
    start that uses CPU is waited for longer, ``shard.nodes.startup``); ``ListenError`` when
    an API's address is taken (checked before any node starts).
    """
    listen = parse_api_address(api) if api is not None else spec.api.listen
    if listen is not None:
        await check_api_free(str(listen))
    standby_api = spec.coordinator.standby_api  # bound at takeover: free now, at least
    if standby_api is not None and standby_api != listen:
        await check_api_free(str(standby_api))
    procs: list[trio.Process] = []
    coordinator = spec.coordinator.name
    standby = None if spec.coordinator.standby is None else coordinator + STANDBY_SUFFIX
    supervisor = Supervisor(coordinator, set())
    if standby is not None:
        supervisor.coordinators.add(standby)
    try:
        async with trio.open_nursery() as nursery:
            overrides, relays, relay_of = await _start_relays(spec, nursery)
            ready_send, ready_recv = trio.open_memory_channel[dict[str, str]](0)
            nodes = [(s.name, "stage") for s in spec.stages]
            nodes.append((coordinator, "coordinator"))
            if standby is not None:  # follows the primary, so started after it
                nodes.append((standby, "coordinator"))
            nodes += [(s.name, s.role) for s in spec.standbys]  # standby | auditor
            # Every node computes on this machine: give each its share of the cores, since
            # torch's default (all cores per process) thrashes when processes compete.
            threads = max(1, (os.cpu_count() or 1) // len(nodes))
            async with ready_send:
                for name, role in nodes:
                    via = overrides.get(name)
                    node, of = name, None
                    if name == standby:
                        node, of = coordinator, str(spec.coordinator.listen)
                    cmd = _command(spec_path, node, role, model_dir, via, threads, api, layout, of)
                    proc = await trio.lowlevel.open_process(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        start_new_session=True,
                    )
                    procs.append(proc)
                    nursery.start_soon(_watch, name, proc, ready_send.clone(), supervisor, exits)
            names = [n for n, _ in nodes]
            cpu = cpu_of(dict(zip(names, (p.pid for p in procs), strict=True)))
            try:  # a slow start (a loaded host) is waited for while it works (.startup)
                seen = await wait_ready(ready_recv, names, startup_timeout_s, cpu)
            except StartTimeout as exc:
                raise SwarmError(str(exc)) from None
            supervisor.up = True
            pids = {name: int(f["pid"]) for name, f in seen.items()}
            address = seen[spec.coordinator.name]["address"]
            api_address = seen[spec.coordinator.name].get("api")
            handle = SwarmHandle(
                spec.name,
                spec.faults,
                address,
                pids,
                relays,
                relay_of,
                supervisor.expected,
                api_address,
            )
            task_status.started(handle)
    finally:
        await _terminate(procs)
