"""Scripted faults for ``shard swarm run``: the spec's ``[[faults]]``, acted on real processes.

Each fault waits for its trigger — the run has committed ``at_token`` tokens, or ``at_s``
seconds have passed since the first request started — then: ``kill`` sends SIGKILL to the
node's process, ``stall`` SIGSTOP and, ``seconds`` later, SIGCONT, ``sever`` cuts the
connections at the relay in front of the node's downstream edge. The run's token arrivals are
timed, so the launcher can report the longest pause the client saw after the fault.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable

import attrs
import trio

from shard.nodes.launcher import SwarmError, SwarmHandle
from shard.spec.failover import FaultSpec


@attrs.define
class Progress:
    """Committed tokens seen by the client so far, and when each batch arrived."""

    tokens: int = 0
    started: float | None = None
    arrivals: list[float] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def begin(self) -> None:
        if self.started is None:
            self.started = trio.current_time()
            self._poke()

    def add(self, n: int) -> None:
        self.tokens += n
        self.arrivals.append(trio.current_time())
        self._poke()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def longest_pause_after(self, at: float) -> float:
        """The longest gap between token arrivals that covers or follows ``at``."""
        times = [self.started or at, *self.arrivals]
        gaps = [b - a for a, b in itertools.pairwise(times) if b >= at]
        return max(gaps, default=0.0)


@attrs.frozen
class Fired:
    fault: FaultSpec
    at: float  # trio clock
    tokens: int
    detail: str


async def _trigger(fault: FaultSpec, progress: Progress) -> None:
    while True:
        started = progress.started is not None
        if fault.at_token is not None and started and progress.tokens >= fault.at_token:
            return
        if fault.at_s is not None and progress.started is not None:
            left = progress.started + fault.at_s - trio.current_time()
            if left <= 0:
                return
            with trio.move_on_after(left):
                await progress.changed.wait()
            continue
        await progress.changed.wait()


def _signal(handle: SwarmHandle, node: str, sig: signal.Signals) -> int:
    pid = handle.pids.get(node)
    if pid is None:
        raise SwarmError(f"[[faults]] names {node}, which has no process in this swarm")
    os.kill(pid, sig)
    return pid


async def run_faults(
    handle: SwarmHandle,
    progress: Progress,
    report: Callable[[str], None],
    fired: list[Fired],
) -> None:
    """Carry out every ``[[faults]]`` entry of the swarm's spec, appending to ``fired`` as
    they happen (the run may end, and cancel this, before every fault triggered)."""

    async def one(fault: FaultSpec) -> None:
        await _trigger(fault, progress)
        now, tokens = trio.current_time(), progress.tokens
        if fault.kind == "kill":
            handle.expect_exit(fault.node)
            pid = _signal(handle, fault.node, signal.SIGKILL)
            detail = f"killed {fault.node} (pid {pid}, SIGKILL) after {tokens} tokens"
        elif fault.kind == "stall":
            pid = _signal(handle, fault.node, signal.SIGSTOP)
            detail = (
                f"stalled {fault.node} (pid {pid}) for {fault.seconds:g} s after {tokens} tokens"
            )
        else:
            relay = handle.relay_of.get(fault.node)
            if relay is None:
                raise SwarmError(f"no relay in front of {fault.node}'s downstream edge")
            cut = relay.sever()
            detail = (
                f"severed {fault.node}'s downstream edge ({cut} connection) after {tokens} tokens"
            )
        fired.append(Fired(fault, now, tokens, detail))
        report(detail)
        if fault.kind == "stall":
            try:
                await trio.sleep(fault.seconds)
            finally:
                # Stopped past failover.dead_after_s and replaced by a standby, it exits once
                # it wakes and the scheduler refuses it (NodeReplaced): expected, not a swarm
                # failure. Not replaced, it is taken back into its slot and runs on.
                handle.expect_exit(fault.node)
                _signal(handle, fault.node, signal.SIGCONT)
            report(f"resumed {fault.node} (SIGCONT)")

    async with trio.open_nursery() as nursery:
        for fault in handle.faults:
            nursery.start_soon(one, fault)
