"""Entry points of the monitor: ``shard monitor`` and ``shard swarm up --monitor``.

Each builds the Trio side (a ``FeedWatcher``, and for ``swarm up`` the launcher of the
swarm's processes), hands it to a ``TrioGuest`` and runs ``MonitorApp`` on asyncio until the
operator quits; then the guest is stopped, which closes the feed and, for ``swarm up``, stops
every node the launcher started, before the process exits.

While the app owns the terminal nothing may write to it: this process's log records go to
the app's event log, and a launched swarm's nodes write their stderr to a log file whose path
is shown in the event log and printed when the monitor quits.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, Any, Protocol

import trio

from shard.observe.tui.app import MonitorApp
from shard.observe.tui.feed import FeedWatcher
from shard.observe.tui.guest import TrioGuest
from shard.observe.tui.state import FeedNote
from shard.transport import Network


class AppLogHandler(logging.Handler):
    """Log records as notes in the app's event log (from any thread)."""

    def __init__(self, app: MonitorApp, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(logging.INFO)
        self._app = app
        self._loop = loop

    def emit(self, record: logging.LogRecord) -> None:
        note = FeedNote(f"{record.levelname.lower()}: {record.name}: {record.getMessage()}")
        self._loop.call_soon_threadsafe(self._app.show, note)


@contextmanager
def _logs_into(app: MonitorApp, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = [AppLogHandler(app, loop)]
    try:
        yield
    finally:
        root.handlers[:] = saved


async def _run(app: MonitorApp, guest: TrioGuest) -> None:
    """Run ``app`` with ``guest`` beside it; stop the guest before returning."""
    with _logs_into(app, asyncio.get_running_loop()):
        guest.start(on_done=app.exit)
        try:
            await app.run_async()
        finally:
            await guest.stop()


def monitor(address: str, *, swarm: str, network: Network, connect_timeout_s: float = 10.0) -> None:
    """``shard monitor``: watch the coordinator at ``address`` until the operator quits.

    ``network`` (not yet open) is how the monitor reaches it: the one clients use.
    """
    app = MonitorApp(address=address)
    watcher = FeedWatcher(network, swarm=swarm, post=app.show, dial_timeout_s=connect_timeout_s)

    async def main() -> None:
        async with network:
            await watcher.run(address)

    guest = TrioGuest(main)
    app.on_reset = partial(guest.call_soon, watcher.request_reset)
    asyncio.run(_run(app, guest))


class Launched(Protocol):
    """What ``monitor_swarm`` reads of a started swarm (``shard.nodes.launcher.SwarmHandle``)."""

    @property
    def coordinator(self) -> str: ...

    @property
    def pids(self) -> dict[str, int]: ...


class Start(Protocol):
    """Starts every node with their stderr into ``stderr``, reports the swarm through
    ``task_status`` once it is up, and stops every node when cancelled (the CLI passes
    ``shard.nodes.launcher.launch`` with the spec bound)."""

    async def __call__(self, *, stderr: IO[bytes], task_status: trio.TaskStatus[Any]) -> None: ...


def monitor_swarm(
    spec_path: Path,
    *,
    swarm: str,
    start: Start,
    address: str,
    network: Network,
    connect_timeout_s: float = 10.0,
) -> None:
    """``shard swarm up --monitor``: ``start`` every node of the swarm named ``swarm``, whose
    spec is at ``spec_path`` (as ``swarm up`` does), and watch its coordinator over
    ``network``; quitting the monitor stops the swarm."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"shard-{swarm}-"))
    log_path = log_dir / "nodes.log"
    app = MonitorApp(address=address)
    watcher = FeedWatcher(network, swarm=swarm, post=app.show, dial_timeout_s=connect_timeout_s)

    async def main() -> None:
        app.show(FeedNote(f"starting swarm {swarm} from {spec_path}; node logs: {log_path}"))
        with log_path.open("wb") as log_file:
            async with trio.open_nursery() as nursery:
                handle: Launched = await nursery.start(partial(start, stderr=log_file))
                pids = " ".join(f"{n}={p}" for n, p in handle.pids.items())
                app.show(FeedNote(f"swarm up: coordinator {handle.coordinator} {pids}"))
                async with network:
                    await watcher.run(handle.coordinator)

    guest = TrioGuest(main)
    app.on_reset = partial(guest.call_soon, watcher.request_reset)
    try:
        asyncio.run(_run(app, guest))
    finally:
        print(f"swarm {swarm} stopped; node logs: {log_path}", file=sys.stderr)
