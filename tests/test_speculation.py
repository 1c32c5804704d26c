"""The speculative loop's pure core: scripted verdicts against one session's stream."""

from __future__ import annotations

import pytest

from shard.decode.speculation import SpeculationStream
from shard.decode.state import DecodeState
from shard.messages import ChunkSeq, Epoch, SessionId, Verdict

PROMPT = [1, 2, 3]
EOS = 0


def stream(max_tokens: int = 20) -> SpeculationStream:
    """A stream whose prefill committed token 10 at position 3."""
    decode = DecodeState.start(len(PROMPT), max_tokens, [EOS], max_len=64)
    decode.commit([10])
    return SpeculationStream(decode=decode, committed=[*PROMPT, 10], max_len=64, feed=3, next_seq=1)


def verdict(chunk_seq: int, epoch: int, start: int, target: list[int], accepted: int) -> Verdict:
    return Verdict(
        session=SessionId(1),
        epoch=Epoch(epoch),
        seq=ChunkSeq(chunk_seq),
        start=start,
        target_ids=tuple(target),
        accepted=accepted,
    )


def test_chunk_starts_at_the_last_committed_token() -> None:
    """Without pipelining a chunk feeds the last committed token then the drafts."""
    s = stream()
    s.add_drafts([11, 12])
    chunk = s.next_chunk(2)
    assert chunk is not None
    assert (chunk.start, chunk.ids, chunk.draft) == (3, (10, 11, 12), (11, 12))


def test_all_accepted_commits_drafts_and_bonus() -> None:
    """Every draft confirmed plus the bonus token: K+1 tokens from one lap."""
    s = stream()
    s.add_drafts([11, 12])
    s.next_chunk(2)
    out = s.on_verdict(verdict(1, 0, 3, [11, 12, 13], accepted=2))
    assert out.emitted == (11, 12, 13)
    assert s.committed == [*PROMPT, 10, 11, 12, 13]
    assert s.feed == 6  # the bonus token (position 6) is not fed yet
    assert not out.rejected


def test_rejection_keeps_the_target_token_and_drops_drafts() -> None:
    """At the first disagreement the target's token is committed and later drafts vanish."""
    s = stream()
    s.add_drafts([11, 12, 13])
    s.next_chunk(3)
    out = s.on_verdict(verdict(1, 0, 3, [11, 99], accepted=1))
    assert out.emitted == (11, 99)
    assert out.rejected and out.bumped_epoch is None  # nothing else was in flight
    assert s.drafts == []
    assert s.feed == 5
    chunk = s.next_chunk(2)
    assert chunk is not None and chunk.ids == (99,)


def test_rejection_mid_pipeline_never_commits_stale_tokens() -> None:
    """Chunks drafted past a rejected one are fenced by the epoch; their verdicts commit nothing."""
    s = stream()
    s.add_drafts([11, 12, 13, 14, 15, 16, 17, 18])
    first = s.next_chunk(2)  # positions 3..5, drafts 11 12
    second = s.next_chunk(2)  # positions 6..8 (13 guesses the bonus), drafts 14 15
    third = s.next_chunk(2)  # positions 9..11
    assert first and second and third
    assert second.ids == (13, 14, 15) and third.start == 9
    out = s.on_verdict(verdict(1, 0, 3, [11, 42], accepted=1))
    assert out.emitted == (11, 42)
    assert out.bumped_epoch == Epoch(1)
    # The stale chunks still answer (the ring computed them): nothing of theirs is committed.
    for chunk in (second, third):
        stale = s.on_verdict(verdict(chunk.seq, 0, chunk.start, [13, 14, 15, 16], accepted=3))
        assert stale.stale and stale.emitted == ()
    assert s.committed == [*PROMPT, 10, 11, 42]
    nxt = s.next_chunk(2)
    assert nxt is not None and nxt.epoch == Epoch(1) and nxt.start == 5 and nxt.ids == (42,)


def test_bonus_must_match_the_next_chunks_first_input() -> None:
    """A bonus token that differs from the pipelined chunk's guess makes that chunk stale."""
    s = stream()
    s.add_drafts([11, 12, 13, 14, 15])
    s.next_chunk(2)
    second = s.next_chunk(2)
    assert second is not None
    out = s.on_verdict(verdict(1, 0, 3, [11, 12, 77], accepted=2))
    assert out.emitted == (11, 12, 77) and out.bumped_epoch == Epoch(1)
    assert s.on_verdict(verdict(second.seq, 0, second.start, [14, 15, 16], accepted=2)).stale


def test_bonus_matching_chains_pipelined_chunks() -> None:
    """When the bonus equals the next chunk's guess, that chunk's verdict counts."""
    s = stream()
    s.add_drafts([11, 12, 13, 14, 15])
    s.next_chunk(2)
    second = s.next_chunk(2)
    assert second is not None
    s.on_verdict(verdict(1, 0, 3, [11, 12, 13], accepted=2))
    out = s.on_verdict(verdict(second.seq, 0, second.start, [14, 15, 16], accepted=2))
    assert out.emitted == (14, 15, 16)
    assert s.committed == [*PROMPT, 10, 11, 12, 13, 14, 15, 16]


def test_eos_inside_accepted_drafts_stops_the_request() -> None:
    """An end-of-sequence token among the verdict's ids ends the request there."""
    s = stream()
    s.add_drafts([11, EOS, 12])
    s.next_chunk(3)
    out = s.on_verdict(verdict(1, 0, 3, [11, EOS, 12, 13], accepted=3))
    assert out.emitted == (11,)
    assert s.decode.finish_reason == "stop"
    assert s.next_chunk(3) is None


def test_chunks_never_feed_past_max_tokens() -> None:
    """No position beyond the last token that could still be committed is fed."""
    s = stream(max_tokens=3)  # positions 3, 4, 5 may be committed; 10 is at 3
    s.add_drafts([11, 12, 13, 14])
    chunk = s.next_chunk(4)
    assert chunk is not None and chunk.ids == (10, 11)  # predicts positions 4 and 5 only


def test_broken_fifo_is_detected() -> None:
    """A verdict for the wrong chunk is a protocol violation, said plainly."""
    s = stream()
    s.add_drafts([11, 12, 13, 14, 15])
    s.next_chunk(2)
    s.next_chunk(2)
    with pytest.raises(ValueError, match="FIFO"):
        s.on_verdict(verdict(2, 0, 6, [1], accepted=0))


def test_sampled_drafts_carry_their_q_into_the_chunk_and_go_with_their_drafts() -> None:
    """A chunk carries the q of each of its drafts (not of its first id, which the previous
    chunk's bonus decides); a chunk mixing sampled and greedy drafts carries none; accepted
    and rejected drafts take their q with them."""
    from shard.messages import DraftQ

    q = [DraftQ((11 + i, 50), (0.75, 0.25)) for i in range(4)]
    s = stream()
    s.add_drafts([11, 12], q[:2])
    chunk = s.next_chunk(2)
    assert chunk is not None and chunk.q == (q[0], q[1])
    s.add_drafts([13, 14], q[2:])  # pipelined: 13 is the next chunk's first id
    behind = s.next_chunk(1)
    assert behind is not None and behind.ids == (13, 14) and behind.q == (q[3],)
    s.on_verdict(verdict(1, 0, 3, [11, 12, 13], accepted=2))
    assert s.qs == [q[3]] and s.drafts == [14]
    s.on_verdict(verdict(2, 0, 6, [77], accepted=0))  # 14 rejected: its q goes too
    assert s.qs == [] and s.drafts == []
    s.add_drafts([1])
    s.add_drafts([2], [q[0]])
    mixed = s.next_chunk(2)
    assert mixed is not None and mixed.draft == (1, 2) and mixed.q == ()
    with pytest.raises(ValueError, match="2 draft distributions for 1"):
        s.add_drafts([3], q[:2])
