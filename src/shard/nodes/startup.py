"""How long the launcher waits for a swarm's nodes to start: while they make progress.

A node's start (importing torch, loading its block, dialling its successor) costs seconds of
CPU; on a loaded host those seconds stretch: five nodes beside ten CPU hogs on 2 cores took
80-165 s to start (``docs/failover.md``, loaded hosts), against the launcher's 180 s deadline
— a swarm that was only slow failed to start. So the deadline is not a wall-clock verdict
alone. At ``timeout_s`` the launcher looks at the CPU time the nodes still starting used
since it last looked: at least ``PROGRESS_CPU_S`` and they are working, slowly — the deadline
moves ``EXTEND_S`` on (up to ``MAX_FACTOR`` x ``timeout_s`` in all); less and they are stuck
(waiting on a peer that never comes, deadlocked): the start fails, naming them.

CPU time is read from ``/proc/PID/stat`` (Linux); where it cannot be read, the deadline is
the plain ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import trio

log = logging.getLogger(__name__)

#: CPU seconds the starting nodes must have used since the last look to be waited for longer
#: (a retry loop dialling a missing peer uses a few milliseconds a second).
PROGRESS_CPU_S: Final = 1.0
#: How far the deadline moves each time the starting nodes were seen working.
EXTEND_S: Final = 30.0
#: The most a start is waited for, in multiples of its ``timeout_s``.
MAX_FACTOR: Final = 5.0


class StartTimeout(Exception):
    """Nodes not ready by the deadline, and not working towards it (or past the cap)."""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time process ``pid`` has used (None: not readable here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after "pid (comm)": comm may hold spaces
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    except (IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: dict[str, int]) -> Callable[[Sequence[str]], float | None]:
    """A reader of the CPU time the nodes named (of ``pids``) used, together."""

    def used(nodes: Sequence[str]) -> float | None:
        total = 0.0
        for node in nodes:
            seconds = cpu_seconds(pids[node])
            if seconds is None:
                return None
            total += seconds
        return total

    return used


async def wait_ready(
    ready: trio.MemoryReceiveChannel[dict[str, str]],
    nodes: list[str],
    timeout_s: float,
    cpu_used: Callable[[Sequence[str]], float | None],
) -> dict[str, dict[str, str]]:
    """Every node's READY fields (from ``ready``), by node, waiting while the nodes not yet
    ready make progress (module docstring).

    Errors: ``StartTimeout`` naming the nodes not ready and why the wait ended."""
    seen: dict[str, dict[str, str]] = {}
    start = looked = trio.current_time()
    deadline, cap = start + timeout_s, start + MAX_FACTOR * timeout_s
    before = cpu_used(nodes)
    while True:
        with trio.move_on_at(deadline) as waited:
            async for fields in ready:
                seen[fields["node"]] = fields
                if len(seen) == len(nodes):
                    return seen
        now = trio.current_time()
        waiting = [n for n in nodes if n not in seen]
        if not waited.cancelled_caught:  # every watcher ended: the supervisor says why
            raise StartTimeout(f"nodes not ready: {waiting}")
        used = cpu_used(waiting)
        worked = None if used is None or before is None else used - before
        if worked is None or worked < PROGRESS_CPU_S or deadline >= cap:
            why = "" if worked is None else (
                f"; they used {worked:.1f} s of CPU in the last {now - looked:.0f} s"
                + (" (the most a start is waited for)" if deadline >= cap else ": stuck")
            )  # fmt: skip
            raise StartTimeout(f"nodes not ready after {now - start:.0f} s: {waiting}{why}")
        log.info(
            "nodes %s still starting after %.0f s, working (%.1f s of CPU in the last %.0f s: "
            "a loaded host); waiting up to %.0f s more",
            waiting, now - start, worked, now - looked, EXTEND_S,
        )  # fmt: skip
        before, looked, deadline = used, now, min(deadline + EXTEND_S, cap)
