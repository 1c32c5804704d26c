"""The coordinator against a scripted ring: stalls and faults end requests clearly, in
virtual time (Trio's autojump clock), with the committed tokens kept."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shard.coordinator.config import CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator, RingError
from shard.failover.events import Pause, RingControl, RingLost
from shard.messages import (
    ChunkSeq,
    Epoch,
    Fault,
    Message,
    NodeName,
    OpenSession,
    Prefill,
    SessionId,
    Verdict,
    Verify,
)
from shard.spec.limits import Limits


async def _ring(
    to_ring: trio.MemoryReceiveChannel[Message],
    from_ring: trio.MemorySendChannel[Message],
    *,
    answer: int,
    then: Message | None,
) -> None:
    """Answer the first ``answer`` chunks with token 7, then send ``then`` (or go silent)."""
    answered = 0
    async for msg in to_ring:
        if isinstance(msg, Prefill | Verify) and (not isinstance(msg, Prefill) or msg.final):
            if answered < answer:
                answered += 1
                await from_ring.send(
                    Verdict(msg.session, msg.epoch, msg.seq, msg.start, target_ids=(7,), accepted=0)
                )
            elif then is not None:
                await from_ring.send(then)
                then = None


async def _generate(
    answer: int, then: Message | None, timeout_s: float, *, max_resyncs: int = Limits().max_resyncs
) -> RingError:
    to_send, to_recv = trio.open_memory_channel[Message](16)
    from_send, from_recv = trio.open_memory_channel[Message](16)
    limits = Limits(
        max_len=64, prefill_chunk=4, verdict_timeout_s=timeout_s, max_resyncs=max_resyncs
    )
    coordinator = Coordinator(
        CoordinatorConfig(node=NodeName("coord"), eos_ids=[0], limits=limits),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        nursery.start_soon(lambda: _ring(to_recv, from_send, answer=answer, then=then))
        with pytest.raises(RingError) as caught:
            await coordinator.generate([1, 2, 3, 4, 5], max_tokens=20)
        nursery.cancel_scope.cancel()
    assert coordinator.statistics().requests_failed == 1
    return caught.value


async def test_stalled_ring_ends_the_request_with_committed_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A ring that stops answering fails the request after verdict_timeout_s, keeping what
    was committed, instead of hanging."""
    began = trio.current_time()
    error = await _generate(answer=3, then=None, timeout_s=30.0)
    assert error.committed == (7, 7, 7)
    assert "no answer from the ring for 30 s" in str(error)
    assert trio.current_time() - began >= 30.0


async def test_stage_fault_mid_request_keeps_committed_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stage's fault for the session ends it with that stage's reason and the tokens so far."""
    fault = Fault(NodeName("s1"), "chunk", "out of memory", session=SessionId(1))
    error = await _generate(answer=2, then=fault, timeout_s=30.0)
    assert error.committed == (7, 7)
    assert "s1: chunk: out of memory" in str(error)


async def test_resyncs_are_bounded_by_the_limits(autojump_clock: trio.testing.MockClock) -> None:
    """Past ``limits.max_resyncs`` re-sends the request fails, naming the key, with its tokens."""
    gap = Fault(NodeName("s1"), "gap", "lost frames", session=SessionId(1))
    error = await _generate(answer=2, then=gap, timeout_s=30.0, max_resyncs=0)
    assert error.committed == (7, 7)
    assert "gave up after 0 re-sends" in str(error)
    assert "limits.max_resyncs" in str(error)


async def test_open_session_asks_for_the_kv_its_request_can_reach(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every session opens before its first chunk, asking for the positions its request can
    fill (prompt + max_tokens: 3 + 4), not the whole ``limits.max_len`` (48)."""
    to_send, to_recv = trio.open_memory_channel[Message](16)
    _, from_recv = trio.open_memory_channel[Message](16)
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=[0],
            limits=Limits(max_len=48, prefill_chunk=4, verdict_timeout_s=1.0),
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        with pytest.raises(RingError):
            await coordinator.generate([1, 2, 3], max_tokens=4)
        nursery.cancel_scope.cancel()
    first = to_recv.receive_nowait()
    assert isinstance(first, OpenSession)
    assert first.max_len == 7
    second = to_recv.receive_nowait()
    assert second == Prefill(
        SessionId(1), Epoch(0), ChunkSeq(0), start=0, final=True, ids=(1, 2, 3)
    )


async def test_scheduler_messages_hold_then_fail_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the scheduler's Pause holds, a silent ring does not time the request out; its
    RingLost then ends it with the scheduler's reason and the committed tokens."""
    to_send, to_recv = trio.open_memory_channel[Message](16)
    from_send, from_recv = trio.open_memory_channel[Message](16)
    control_send, control_recv = trio.open_memory_channel[RingControl](0)
    coordinator = Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=[0],
            limits=Limits(max_len=64, prefill_chunk=4, verdict_timeout_s=30.0),
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv, control=control_recv),
    )
    began = trio.current_time()

    async def repair_that_fails() -> None:
        await control_send.send(Pause("s1 lost; splicing a standby"))
        await trio.sleep(90.0)  # the repair takes three verdict timeouts, in virtual time
        await control_send.send(RingLost("s1 lost and no standby joined"))

    async with trio.open_nursery() as nursery:
        await nursery.start(coordinator.run)
        nursery.start_soon(lambda: _ring(to_recv, from_send, answer=2, then=None))
        nursery.start_soon(repair_that_fails)
        with pytest.raises(RingError) as caught:
            await coordinator.generate([1, 2, 3, 4, 5], max_tokens=20)
        nursery.cancel_scope.cancel()
    assert caught.value.committed == (7, 7)
    assert "s1 lost and no standby joined" in str(caught.value)
    assert trio.current_time() - began >= 90.0
    stats = coordinator.statistics()
    assert stats.requests_failed == 1
    details = [e.detail for e in stats.events if e.kind == "fault"]
    assert details[:2] == ["s1 lost; splicing a standby", "s1 lost and no standby joined"]
