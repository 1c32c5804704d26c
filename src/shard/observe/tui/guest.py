"""Where Trio meets asyncio: the monitor's Trio code runs as a *guest* of Textual's loop.

Textual runs on asyncio; shard's network stack (``WebSocketNetwork``, the handshake, the
wire) is Trio. Two honest ways to join them were on the table:

- run the feed client in a worker thread under its own ``trio.run`` and hand snapshots over
  with ``App.call_from_thread``: two threads, a blocking hand-off in each direction, and a
  shutdown order to get right (the app's loop must outlive the thread's last call);
- **Trio guest mode** (``trio.lowlevel.start_guest_run``): Trio's scheduler runs inside the
  asyncio loop, its ticks scheduled with ``loop.call_soon``; only the wait for I/O happens in
  a helper thread of Trio's own, invisible to us.

We use guest mode. Every line of the monitor — Trio tasks and Textual handlers alike — runs on
one thread, so the feed client posts events straight into the app (no ``call_from_thread``,
no locks, nothing to marshal), and the one cross-runtime call left, asking Trio to do
something, goes through Trio's own thread-safe ``TrioToken.run_sync_soon``. Lifetimes nest:
``TrioGuest.start`` inside the asyncio loop, ``await guest.stop()`` before the loop ends,
which cancels the Trio run and waits for it, so whatever the Trio side owns (a connection, a
whole launched swarm) is cleaned up before the process exits. No asyncio code exists outside
``shard.observe.tui`` (house rule 5), and no Trio code there knows it is a guest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import outcome
import trio


class TrioGuest:
    """Runs ``main()`` as a Trio guest of the running asyncio loop.

    ``start`` begins the run (from asyncio code); ``on_done`` is called when ``main`` ends on
    its own (an error, or a finished job) so the host can stop; ``stop`` cancels ``main`` and
    waits for the run to end.

    Cancellation: ``stop`` cancels ``main`` (via Trio's token; before ``main`` started, the
    run begins already cancelled). Cancelling ``stop`` itself still waits for the Trio run to
    finish (shielded), so nothing Trio owns outlives the host loop.

    Errors: whatever ``main`` raised (other than its cancellation) is re-raised by ``stop``.
    """

    def __init__(self, main: Callable[[], Awaitable[None]]) -> None:
        self._main = main
        self._scope = trio.CancelScope()
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: asyncio.Future[outcome.Outcome[None]] | None = None
        self._on_done: Callable[[], None] = lambda: None

    @property
    def running(self) -> bool:
        return self._done is not None and not self._done.done()

    def start(self, *, on_done: Callable[[], None] = lambda: None) -> None:
        """Start the Trio run in the current asyncio loop. Call once."""
        if self._done is not None:
            raise RuntimeError("TrioGuest.start() called twice")
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._on_done = on_done
        trio.lowlevel.start_guest_run(
            self._run,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=self._finished,
            # asyncio owns signal.set_wakeup_fd on the main thread; Trio must not take it.
            host_uses_signal_set_wakeup_fd=True,
        )

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with self._scope:
            await self._main()

    def _finished(self, result: outcome.Outcome[None]) -> None:
        assert self._done is not None
        if not self._done.done():
            self._done.set_result(result)
        self._on_done()

    def call_soon(self, fn: Callable[[], object]) -> bool:
        """Run ``fn()`` in Trio's context soon; False (and nothing done) if not running."""
        if self._token is None or not self.running:
            return False
        self._token.run_sync_soon(fn)
        return True

    async def stop(self) -> None:
        """Cancel ``main`` and wait for the Trio run to end; re-raise its error, if any."""
        if self._done is None:
            return
        if self._token is None:
            self._scope.cancel()  # not entered yet: the run starts cancelled
        elif self.running:
            self._token.run_sync_soon(self._scope.cancel)
        cancelled = False
        while not self._done.done():
            try:
                await asyncio.shield(self._done)
            except asyncio.CancelledError:
                cancelled = True  # Trio is already being cancelled: wait for it to finish
        if cancelled:
            raise asyncio.CancelledError
        self._done.result().unwrap()
