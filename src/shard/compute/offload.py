"""Where blocking work (a forward pass, loading a block, drafting) runs.

By default in a worker thread, so the node keeps serving its links meanwhile. Tests that run
a swarm in virtual time (``trio.testing.MockClock(autojump_threshold=0)``) cannot allow that:
while the event loop waits on a thread it looks idle, and the mock clock would jump past
heartbeats and timeouts. ``inline_compute()`` makes the work run in the event loop's thread
for the current task and the tasks it starts (a context variable), so virtual time only moves
when the whole swarm is really waiting.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TypeVar, TypeVarTuple

import trio

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_INLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("shard_inline", default=False)


@contextlib.contextmanager
def inline_compute() -> Iterator[None]:
    """Run ``run_sync`` work inline in this context (virtual-time tests only)."""
    token = _INLINE.set(True)
    try:
        yield
    finally:
        _INLINE.reset(token)


async def run_sync(
    fn: Callable[[*Ts], T], *args: *Ts, limiter: trio.CapacityLimiter | None = None
) -> T:
    """``fn(*args)`` in a worker thread (or inline, see ``inline_compute``)."""
    if _INLINE.get():
        await trio.lowlevel.checkpoint()
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
