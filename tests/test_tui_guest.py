"""``TrioGuest``: Trio code as a guest of an asyncio loop, started, called into and stopped
from asyncio code, with its errors and cleanup delivered (no Textual involved).

Each test is a plain function running its scenario with ``asyncio.run`` (pytest-trio's
``trio_mode`` only takes ``async def`` tests); every wait is on an event, bounded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
import trio

from shard.observe.tui.guest import TrioGuest

DEADLINE_S = 10.0


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(DEADLINE_S):
            await scenario()

    asyncio.run(bounded())


def test_trio_runs_on_the_loop_thread_and_stop_waits_for_cleanup() -> None:
    """The Trio side runs on the asyncio thread; ``stop`` cancels it and returns only after
    its cleanup ran; ``on_done`` is called."""
    seen: list[object] = []

    async def scenario() -> None:
        started, done = asyncio.Event(), asyncio.Event()

        async def trio_main() -> None:
            seen.append(threading.get_ident())
            started.set()  # same thread: an asyncio object may be touched directly
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.lowlevel.checkpoint()
                seen.append("cleaned up")

        guest = TrioGuest(trio_main)
        guest.start(on_done=done.set)
        await started.wait()
        assert guest.running
        await guest.stop()
        assert not guest.running
        assert done.is_set()

    run(scenario)
    assert seen == [threading.get_ident(), "cleaned up"]


def test_call_soon_runs_in_trio_context() -> None:
    """``call_soon`` runs a function where Trio objects may be used (setting a trio.Event)."""

    async def scenario() -> None:
        poked = trio.Event()
        started, woke = asyncio.Event(), asyncio.Event()

        async def trio_main() -> None:
            started.set()
            await poked.wait()
            woke.set()
            await trio.sleep_forever()

        guest = TrioGuest(trio_main)
        assert not guest.call_soon(poked.set)  # not started: refused, nothing done
        guest.start()
        await started.wait()
        assert guest.call_soon(poked.set)
        await woke.wait()
        await guest.stop()

    run(scenario)


def test_error_reaches_on_done_and_stop() -> None:
    """A Trio-side error calls ``on_done`` (the app would exit) and ``stop`` re-raises it."""

    async def scenario() -> None:
        done = asyncio.Event()

        async def trio_main() -> None:
            raise LookupError("the swarm did not start")

        guest = TrioGuest(trio_main)
        guest.start(on_done=done.set)
        await done.wait()
        with pytest.raises(LookupError, match="did not start"):
            await guest.stop()

    run(scenario)


def test_stop_before_the_first_tick() -> None:
    """Stopping right after ``start`` (before Trio ran at all) runs the Trio side already
    cancelled: it stops at its first checkpoint, and ``stop`` returns."""
    ran: list[str] = []

    async def scenario() -> None:
        async def trio_main() -> None:
            ran.append("started")
            await trio.sleep_forever()

        guest = TrioGuest(trio_main)
        guest.start()
        await guest.stop()

    run(scenario)
    assert ran == ["started"]


def test_start_twice_is_refused() -> None:
    """A guest runs once."""

    async def scenario() -> None:
        guest = TrioGuest(trio.sleep_forever)
        guest.start()
        with pytest.raises(RuntimeError, match="twice"):
            guest.start()
        await guest.stop()

    run(scenario)
