"""``generate_watching``: one request on a ``Coordinator`` with a test watching its tokens as
they commit (to cut a link or kill a node part-way through a request).

The coordinator sends each batch of committed ids on a channel (``Committed``); this reads
them in a task of its own and hands each batch to ``watch``, as a test would by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio

from shard.coordinator.coordinator import Completion, Coordinator
from shard.coordinator.events import Committed


async def generate_watching(
    coordinator: Coordinator,
    prompt_ids: Sequence[int],
    watch: Callable[[tuple[int, ...]], None],
    **kwargs: Any,
) -> Completion:
    """``coordinator.generate(prompt_ids, **kwargs)``, calling ``watch`` with each batch of
    committed ids (in order, in the reading task). Errors: ``generate``'s."""
    send, receive = trio.open_memory_channel[Committed](0)

    async def read() -> None:
        async with receive:
            async for batch in receive:
                watch(batch.token_ids)

    done: Completion | None = None
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        with send:  # closed when the request ends, however it ends: the reader stops
            try:
                done = await coordinator.generate(prompt_ids, tokens=send, **kwargs)
            except Exception as exc:  # raised as it was, not inside the nursery's group
                failure = exc
    if failure is not None:
        raise failure
    assert done is not None
    return done
