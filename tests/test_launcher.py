"""The launcher's supervision (what a node's exit means), its child command line, and the
lifeline that stops a node when its launcher dies (``shard.nodes.lifeline``).

The lifeline tests run small Python processes, no torch; every one is killed by PID on the
way out (``tests/procs.py``), and every wait is bounded.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from procs import (
    LOOPBACK,
    LineReader,
    alive,
    free_ports,
    orphans,
    run_python,
    run_shard,
    started_python,
    wait_gone,
)
from shard.nodes.launcher import (
    EXITED_PREFIX,
    STANDBY_SUFFIX,
    NodeExit,
    Supervisor,
    SwarmError,
    _command,
    _held,
)
from shard.nodes.startup import StartTimeout, cpu_seconds, wait_ready
from shard.spec.swarm import SwarmSpec


class _Recorded(Supervisor):
    """A supervisor whose reports are kept, in order."""

    seen: list[NodeExit]

    def exited(self, name: str, pid: int, code: int) -> NodeExit:
        report = super().exited(name, pid, code)
        self.seen.append(report)
        return report


def _supervisor() -> tuple[Supervisor, list[NodeExit]]:
    supervisor = _Recorded("coord", set())
    supervisor.seen = []
    return supervisor, supervisor.seen


def test_an_exit_before_the_swarm_is_up_ends_it() -> None:
    """A node that exits while the swarm starts is a failed start, naming the node."""
    supervisor, seen = _supervisor()
    with pytest.raises(SwarmError, match=r"node s1 \(pid 42\) exited with code 1 before"):
        supervisor.exited("s1", 42, 1)
    assert seen == []


def test_a_stage_that_dies_once_up_is_reported_and_left_to_failover() -> None:
    """Up, a stage's or standby's exit is reported (no error): the swarm serves on."""
    supervisor, seen = _supervisor()
    supervisor.up = True
    supervisor.exited("s1", 42, -9)
    supervisor.exited("spare", 43, 0)
    assert seen == [NodeExit("s1", 42, -9), NodeExit("spare", 43, 0)]


def test_a_scripted_death_is_marked_as_such() -> None:
    """A node a [[faults]] entry kills (``expect_exit``) is reported as scripted."""
    supervisor, seen = _supervisor()
    supervisor.up = True
    supervisor.expected.add("s1")
    supervisor.exited("s1", 42, -9)
    assert seen == [NodeExit("s1", 42, -9, scripted=True)]


def test_the_coordinators_death_ends_the_swarm() -> None:
    """Nothing replaces a coordinator: its exit stops the swarm, and says so."""
    supervisor, seen = _supervisor()
    supervisor.up = True
    with pytest.raises(SwarmError, match=r"coordinator coord \(pid 7\) exited .* cannot replace"):
        supervisor.exited("coord", 7, -9)
    assert seen == []


def test_with_a_standby_coordinator_the_primarys_death_is_reported_not_the_end() -> None:
    """A standby coordinator takes over: the primary's exit is one report; the last
    coordinator's exit ends the swarm."""
    supervisor, seen = _supervisor()
    supervisor.coordinators.add("coord" + STANDBY_SUFFIX)
    supervisor.up = True
    supervisor.exited("coord", 7, -9)
    assert seen == [NodeExit("coord", 7, -9)]
    with pytest.raises(SwarmError, match=r"coordinator coord/standby \(pid 8\) exited"):
        supervisor.exited("coord/standby", 8, 1)


def test_a_standby_coordinator_is_started_following_the_primary() -> None:
    """The standby coordinator runs under the coordinator's name with ``--standby-of``."""
    cmd = _command(Path("s.toml"), "coord", "coordinator", Path("m"), None, 1, None, None, "a:1")
    assert cmd[cmd.index("--node") + 1] == "coord"
    assert cmd[cmd.index("--standby-of") + 1] == "a:1"


def test_exit_line_is_machine_readable() -> None:
    """``SHARD NODE EXITED node= pid= code=``: the fields parse back."""
    line = NodeExit("s1", 42, -9).line()
    assert line.startswith(EXITED_PREFIX)
    fields = dict(part.split("=", 1) for part in line[len(EXITED_PREFIX) :].split())
    assert fields == {"node": "s1", "pid": "42", "code": "-9"}


def test_every_node_is_told_to_die_with_the_launcher() -> None:
    """Each child's command line names this process as the parent it dies with."""
    cmd = _command(Path("s.toml"), "s0", "stage", Path("m"), None, 1)
    i = cmd.index("--die-with-parent")
    assert cmd[i + 1] == str(os.getpid())


#: A node stand-in: dies with the parent named in argv[1], prints its PID, then waits forever.
_NODE = """
import os, signal, sys
from shard.nodes.lifeline import die_with_parent
die_with_parent(int(sys.argv[1]), "n")
print(os.getpid(), flush=True)
signal.pause()
"""
#: A launcher stand-in: starts a _NODE from a short-lived thread (as Trio does), prints the
#: node's PID, then waits forever.
_PARENT = """
import os, signal, subprocess, sys, threading
started = []
def spawn():
    started.append(subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())]))
thread = threading.Thread(target=spawn)
thread.start()
thread.join()  # the forking thread is gone: a PR_SET_PDEATHSIG node would die here
print(started[0].pid, flush=True)
signal.pause()
"""


async def test_a_node_outlives_its_forking_thread_but_not_its_launcher() -> None:
    """A node started from a thread that then ends runs on; SIGKILL its launcher and the
    node stops too, within seconds, without anyone signalling it."""
    async with started_python(_PARENT, _NODE) as parent:
        with trio.fail_after(30):
            node = int(await LineReader(parent.stdout).line_starting(""))
        assert alive(node)
        os.kill(parent.pid, signal.SIGKILL)
        assert await wait_gone([node], timeout_s=30) == []
    assert orphans() == []


async def test_a_node_whose_launcher_is_already_gone_stops_at_once() -> None:
    """``die_with_parent`` of a PID that is not this process's parent stops it at once."""
    done = await run_python(_NODE, "1", timeout_s=30)
    assert done.returncode == -signal.SIGKILL, done.describe()
    assert "launcher (pid 1) exited; stopping" in done.stderr
    assert done.stdout == ""


async def test_shard_up_dies_with_parent_before_reading_its_spec(tmp_path: Path) -> None:
    """``shard up --die-with-parent PID`` acts first: with its parent gone it stops, even
    with a spec that does not exist."""
    missing = tmp_path / "none.toml"
    args = ("up", "--role", "stage", "--spec", str(missing), "--die-with-parent", "1")
    done = await run_shard(*args, timeout_s=60)
    assert done.returncode == -signal.SIGKILL, done.describe()
    assert "launcher (pid 1) exited; stopping" in done.stderr


# --- how long a start is waited for (shard.nodes.startup) ------------------------------------


def _cpu_clock(rate: float) -> Callable[[Sequence[str]], float]:
    """The starting nodes' CPU time as if each used ``rate`` s of CPU per second (virtual)."""
    return lambda nodes: rate * len(nodes) * trio.current_time()


async def _ready_after(send: trio.MemorySendChannel[dict[str, str]], at_s: float) -> None:
    async with send:
        await trio.sleep_until(at_s)
        for node in ("coord", "s0"):
            await send.send({"node": node, "pid": "1", "address": "127.0.0.1:1"})


async def test_a_slow_start_that_works_is_waited_for(autojump_clock: MockClock) -> None:
    """Nodes that use CPU (10% of a core each: a loaded host) and are ready at 400 s are
    waited for past the 180 s deadline: it failed a swarm that was only slow to start."""
    send, recv = trio.open_memory_channel[dict[str, str]](0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ready_after, send, 400.0)
        seen = await wait_ready(recv, ["coord", "s0"], 180.0, _cpu_clock(0.1))
    assert sorted(seen) == ["coord", "s0"]
    assert trio.current_time() == pytest.approx(400.0)


@pytest.mark.parametrize(
    ("rate", "ends_at", "says"),
    [
        (0.001, 180.0, "stuck"),  # a retry loop's milliseconds: not progress
        (0.1, 5 * 180.0, "the most a start is waited for"),
    ],
)
async def test_a_start_that_is_stuck_or_too_long_fails_naming_the_nodes(
    autojump_clock: MockClock, rate: float, ends_at: float, says: str
) -> None:
    """Nodes that use (almost) no CPU fail at the deadline; working ones at 5x it, each
    naming the nodes not ready and why the wait ended."""
    send, recv = trio.open_memory_channel[dict[str, str]](0)
    async with send:
        with pytest.raises(StartTimeout) as caught:
            await wait_ready(recv, ["coord", "s0"], 180.0, _cpu_clock(rate))
    assert trio.current_time() == pytest.approx(ends_at)
    assert str(caught.value).startswith(f"nodes not ready after {ends_at:.0f} s: ['coord', 's0']")
    assert says in str(caught.value)


async def test_without_cpu_readings_the_deadline_is_plain(autojump_clock: MockClock) -> None:
    """Where CPU time cannot be read, the start fails at ``timeout_s``, as before."""
    send, recv = trio.open_memory_channel[dict[str, str]](0)
    async with send:
        with pytest.raises(StartTimeout, match=r"^nodes not ready after 180 s: \['s0'\]$"):
            await wait_ready(recv, ["s0"], 180.0, lambda nodes: None)


def test_cpu_seconds_reads_this_process() -> None:
    """``/proc/PID/stat`` gives this process's CPU time (it has used some), None for no PID."""
    used = cpu_seconds(os.getpid())
    assert used is not None and used > 0
    assert cpu_seconds(2**22 + 1) is None  # above the kernel's pid_max default


async def test_the_swarms_own_ports_are_held_while_relays_bind_any_free_port(
    tmp_path: Path,
) -> None:
    """While the relays bind "any free port", the launcher holds every fixed port its nodes
    and APIs will bind (CI once lost a launcher within seconds of its start with no log; a
    relay given a node's port is one way that happens): each is then taken to anyone else,
    one taken already is skipped, and closing the holds frees them all."""
    ports = free_ports(6)
    taken = trio.socket.socket()
    await taken.bind((LOOPBACK, ports[5]))  # another program's, before the launcher
    taken.listen()
    at = [f"{LOOPBACK}:{p}" for p in ports]
    spec = SwarmSpec.from_dict(
        {
            "swarm": {"name": "held", "model": str(tmp_path), "insecure": True},
            "coordinator": {"name": "c", "listen": at[0], "standby": at[1]},
            "stage": [{"name": "s0", "listen": at[2]}, {"name": "s1", "listen": at[5]}],
            "api": {"listen": at[3]},
            "standby": [{"name": "b", "listen": at[4], "layers_of": "s0"}],
        },
        source="held.toml",
    )
    held = await _held(spec)
    try:
        assert sorted(h.socket.getsockname()[1] for h in held) == sorted(ports[:5])
        for port in ports:
            probe = trio.socket.socket()
            with pytest.raises(OSError), probe:
                await probe.bind((LOOPBACK, port))
    finally:
        for listener in held:
            await listener.aclose()
        taken.close()
    for port in ports:
        with trio.socket.socket() as probe:
            await probe.bind((LOOPBACK, port))
