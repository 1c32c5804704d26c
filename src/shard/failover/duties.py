"""What a control link asks of the node that owns it, on channels: each question travels with
the one-shot channel its answer comes back on (``Asked``).

The control link (``shard.failover.control.ControlClient``) reads orders, audit requests and
RTT measurements from the scheduler and must answer each with how it went (``Ready``, an
``AuditVerdict``, an ``RttReport``): a request with its answer, not a message sent and
forgotten. It ``ask``s on the node's ``Duties`` channels; the node's root serves each channel
with ``answer`` in its own nursery. An exception the node raises travels back as the answer
and is raised again at the asker, so the link decides, as before, which failures become a
``Ready(ok=False)`` and which end it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import attrs
import trio

from shard.messages import Activate, MeasureRtt, Rewire, RttReport
from shard.messages.audit import AuditRequest, AuditVerdict

__all__ = ["Asked", "Duties", "Order", "answer", "ask", "duties"]

Q = TypeVar("Q")
A = TypeVar("A")

Order = Activate | Rewire


@attrs.frozen
class Asked(Generic[Q, A]):
    """A question and the channel its answer (or the exception it raised) goes back on."""

    question: Q
    reply: trio.MemorySendChannel[A | Exception]


async def ask(channel: trio.MemorySendChannel[Asked[Q, A]], question: Q) -> A:
    """Send ``question`` on ``channel`` and wait for its answer; an exception the answerer
    raised is raised here."""
    send, receive = trio.open_memory_channel[A | Exception](1)
    async with receive:
        await channel.send(Asked(question, send))
        got = await receive.receive()
    if isinstance(got, Exception):
        raise got
    return got


async def answer(
    channel: trio.MemoryReceiveChannel[Asked[Q, A]], work: Callable[[Q], Awaitable[A]]
) -> None:
    """Answer each question on ``channel`` with ``work``, one at a time, until it closes. An
    answer nobody waits for any more (the asker's link ended) is dropped."""
    async with channel:
        async for asked in channel:
            result: A | Exception
            try:
                result = await work(asked.question)
            except Exception as exc:  # the asker decides what it means
                result = exc
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                asked.reply.send_nowait(result)


@attrs.frozen
class Duties:
    """The channels a control link asks its node on: orders always; audits for a node that
    audits (a standby with a block); measurements for a node that measures (a joiner)."""

    orders: trio.MemorySendChannel[Asked[Order, None]]
    audits: trio.MemorySendChannel[Asked[AuditRequest, AuditVerdict]] | None = None
    measures: trio.MemorySendChannel[Asked[MeasureRtt, RttReport]] | None = None


def duties(
    nursery: trio.Nursery,
    obey: Callable[[Order], Awaitable[None]],
    audit: Callable[[AuditRequest], Awaitable[AuditVerdict]] | None = None,
    measure: Callable[[MeasureRtt], Awaitable[RttReport]] | None = None,
) -> Duties:
    """``Duties`` whose questions ``nursery``'s tasks answer with the node's own ``obey``,
    ``audit`` and ``measure`` (a node's root wires them, as it wires every actor)."""
    orders_send, orders = trio.open_memory_channel[Asked[Order, None]](0)
    nursery.start_soon(answer, orders, obey)
    audits_send = measures_send = None
    if audit is not None:
        audits_send, audits = trio.open_memory_channel[Asked[AuditRequest, AuditVerdict]](0)
        nursery.start_soon(answer, audits, audit)
    if measure is not None:
        measures_send, measures = trio.open_memory_channel[Asked[MeasureRtt, RttReport]](0)
        nursery.start_soon(answer, measures, measure)
    return Duties(orders_send, audits_send, measures_send)
