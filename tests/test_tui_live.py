"""The monitor against a real swarm: an in-process ring over WebSockets on loopback, generating
text with n-gram drafts, watched by ``MonitorApp`` through the real feed client running as a
Trio guest of Textual's asyncio loop. tok/s and α must move, and show what the feed said.

The swarm runs under its own ``trio.run`` in a thread (the app's loop owns the test's main
thread); the two meet only over sockets, as a monitor and a coordinator do in production.
Charter: 127.0.0.1 only, free ports found by binding port 0; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from textual.widgets import Static

from procs import free_ports
from shard.messages import StatusSnapshot
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.inprocess import run_swarm
from shard.observe.tui import state as st
from shard.observe.tui.app import MonitorApp
from shard.observe.tui.feed import FeedWatcher
from shard.observe.tui.guest import TrioGuest
from shard.observe.tui.state import FeedEvent, MonitorState
from shard.spec.swarm import SwarmSpec
from shard.transport import WebSocketNetwork

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0
#: Repetitive, so the n-gram proposer finds drafts and α is measured.
PROMPTS = ([5, 17, 99, 3, 5, 17, 99, 3, 5, 17], [40, 41, 42, 43, 44, 40, 41, 42])


def live_spec(model_dir: Path) -> SwarmSpec:
    ports = free_ports(3)
    data: dict[str, Any] = {
        "swarm": {"name": "live", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 160, "prefill_chunk": 8, "max_sessions": 4},
        "coordinator": {"name": "coord", "listen": f"127.0.0.1:{ports[0]}"},
        "stage": [
            {"name": "s0", "listen": f"127.0.0.1:{ports[1]}", "layers": [0, 2]},
            {"name": "s1", "listen": f"127.0.0.1:{ports[2]}", "layers": [2, 4]},
        ],
        "speculation": {"draft": "ngram"},
    }
    return SwarmSpec.from_dict(data, source="live.toml")


@contextmanager
def swarm_generating(spec: SwarmSpec, model_dir: Path) -> Iterator[str]:
    """Run ``spec`` in a thread, generating text over and over; yield the coordinator's
    address. On the way out, let the request in flight finish, stop the swarm and join the
    thread (bounded)."""
    ready = threading.Event()
    found: dict[str, Any] = {}
    stop = trio.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            found["token"] = trio.lowlevel.current_trio_token()
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(
                    spec,
                    model_dir=model_dir,
                    network=WebSocketNetwork(),
                    task_status=task_status,
                )
            )
            found["address"] = handle.address
            ready.set()
            # Stop between requests: cancelling one mid-flight while the whole ring is torn
            # down is a different test (the coordinator's), not this one.
            while not stop.is_set():
                for prompt in PROMPTS:
                    await handle.coordinator.generate(prompt, max_tokens=48)
            nursery.cancel_scope.cancel()

    def thread_main() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported by the test thread below
            found["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=thread_main, name="swarm", daemon=True)
    thread.start()
    try:
        assert ready.wait(DEADLINE_S), "swarm not ready in time"
        if "error" in found:
            raise found["error"]
        yield found["address"]
    finally:
        if "token" in found:
            found["token"].run_sync_soon(stop.set)
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), "swarm thread did not stop"
    if "error" in found:
        raise found["error"]


SHOWN = ("#link", "#tok-s-label", "#alpha-label", "#summary")


async def watch(
    address: str, swarm: str, until: Callable[[list[StatusSnapshot]], bool]
) -> tuple[list[StatusSnapshot], dict[str, str], MonitorState]:
    """Run the monitor on ``address`` until ``until(snapshots)`` holds (bounded); return the
    snapshots, what the app showed then (``SHOWN``) and its state."""
    events: asyncio.Queue[FeedEvent] = asyncio.Queue()
    app = MonitorApp(address=address)

    def post(event: FeedEvent) -> None:
        app.show(event)
        events.put_nowait(event)

    network = WebSocketNetwork()
    watcher = FeedWatcher(network, swarm=swarm, post=post)

    async def trio_main() -> None:
        async with network:
            await watcher.run(address)

    guest = TrioGuest(trio_main)
    snapshots: list[StatusSnapshot] = []
    async with app.run_test(size=(80, 24)) as pilot:
        guest.start(on_done=app.exit)
        try:
            async with asyncio.timeout(DEADLINE_S):
                while not until(snapshots):
                    event = await events.get()
                    if isinstance(event, StatusSnapshot):
                        snapshots.append(event)
            await pilot.pause()
            # Read together, with no await between: the screen and the state it was drawn from.
            shown = {s: str(app.query_one(s, Static).content) for s in SHOWN}
            state = app.state
        finally:
            await guest.stop()
    return snapshots, shown, state


def test_monitor_sees_a_live_swarm_move(tiny_checkpoint: Callable[..., Path]) -> None:
    """On a swarm generating text, tok/s and α take several different values, and what the
    app shows is the latest snapshot's."""
    model_dir = tiny_checkpoint(seed=3, n_layers=4)
    spec = live_spec(model_dir)

    def moved(snaps: list[StatusSnapshot]) -> bool:
        rates = {s.tok_s for s in snaps if s.tok_s > 0}
        alphas = {s.alpha for s in snaps if s.alpha is not None}
        return len(rates) >= 3 and len(alphas) >= 2

    with swarm_generating(spec, model_dir) as address:
        snaps, shown, state = asyncio.run(watch(address, spec.name, moved))
    last = state.snapshot
    assert last is not None
    assert last.seq >= snaps[-1].seq
    assert shown["#tok-s-label"] == f"tok/s {st.rate(last.tok_s)}"
    assert shown["#alpha-label"] == f"α {st.ratio(last.alpha)}"
    assert f"tok/s {st.rate(last.tok_s)}  α {st.ratio(last.alpha)}" in shown["#summary"]
    assert shown["#link"].startswith("● live  swarm live · coord @ ")
    assert state.tok_s[: len(snaps)] == tuple(s.tok_s for s in snaps)
    assert last.ring == ("coord", "s0", "s1")
    assert last.drafted > 0
    assert all(s.chunks > 0 for s in last.stages)
