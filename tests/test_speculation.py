"""The speculative loop's pure core: scripted verdicts against one session's stream."""

from __future__ import annotations

import pytest

from shard.decode.speculation import SpeculationStream
from shard.decode.state import DecodeState
from shard.messages import ChunkSeq, DraftQ, Epoch, SessionId, Verdict

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


# --- branches ----------------------------------------------------------------------------------


def test_a_branch_rides_before_its_chunk_at_the_same_start() -> None:
    """A branch is a chunk at the same start with the other continuation (as long as it is,
    within the session's bounds), sent first (a lower seq) and not counted in the depth."""
    s = stream(max_tokens=5)  # the output ends at position 7: positions 3..6 are fed at most
    s.add_drafts([11, 12])
    chunk = s.next_chunk(2, branch=[21, 22, 23, 24, 25, 26])
    assert chunk is not None and chunk.branch is not None
    branch = chunk.branch
    assert (branch.start, branch.ids, branch.is_branch) == (3, (10, 21, 22, 23), True)
    assert chunk.branch.seq < chunk.seq and chunk.ids == (10, 11, 12)
    assert list(s.inflight) == [chunk.branch, chunk] and s.depth == 1


@pytest.mark.parametrize(
    ("why", "drafts", "branch", "inflight"),
    [
        ("the same first guess", [11, 12], [11, 30], False),
        ("nothing drafted", [], [21], False),
        ("a chunk already in flight", [11, 12, 13, 14, 15, 16], [21], True),
    ],
)
def test_no_branch_where_it_could_not_differ_or_follow_the_committed_text(
    why: str, drafts: list[int], branch: list[int], inflight: bool
) -> None:
    s = stream()
    s.add_drafts(drafts)
    if inflight:
        s.next_chunk(2)
    chunk = s.next_chunk(2, branch=branch)
    assert chunk is not None and chunk.branch is None, why
    assert all(not c.is_branch for c in s.inflight)


def test_no_branch_for_sampled_drafts() -> None:
    """A chunk whose drafts carry the distributions they were drawn from is judged by the
    general rule, not by one draw per position: it gets no branch."""
    s = stream()
    q = (DraftQ(ids=(11,), probs=(1.0,)), DraftQ(ids=(12,), probs=(1.0,)))
    s.add_drafts([11, 12], q)
    chunk = s.next_chunk(2, branch=[21])
    assert chunk is not None and chunk.q and chunk.branch is None


def test_a_branch_the_target_chose_is_committed_and_its_tokens_fed_again() -> None:
    """The target's first answer is the branch's guess: the branch is walked as the chunk
    (its guesses, its bonus), the main chunk goes stale, and the stages' KV past the start is
    the main chunk's, so the next chunk feeds the branch's committed tokens again, answers
    for them commit nothing twice, and only its own drafts count as drafted."""
    s = stream()
    s.add_drafts([11, 12, 13])
    chunk = s.next_chunk(3, branch=[21, 22, 23])
    assert chunk is not None and chunk.branch is not None
    out = s.on_verdict(verdict(1, 0, 3, [21, 22, 24], accepted=2))
    assert out.branch and not out.lost and not out.stale
    assert out.emitted == (21, 22, 24)
    assert (out.drafted, out.accepted) == (3, 2)
    assert out.bumped_epoch == Epoch(1)  # the main chunk (seq 2) is stale
    assert s.committed == [*PROMPT, 10, 21, 22, 24] and s.drafts == []
    assert s.feed == 4  # position 3 (10) is in every stage's KV, 4.. is not the branch's
    assert s.on_verdict(verdict(2, 0, 3, [11, 12, 13, 14], accepted=3)).stale
    assert s.drafts_wanted(2) == 2
    s.add_drafts([25, 26])
    again = s.next_chunk(2, branch=[31])
    assert again is not None and again.branch is None  # no branch over fed-again tokens
    assert (again.start, again.ids, again.known) == (4, (21, 22, 24, 25, 26), 2)
    out = s.on_verdict(verdict(3, 1, 4, [22, 24, 25, 27], accepted=3))
    assert out.emitted == (25, 27) and out.rejected
    assert (out.drafted, out.accepted, out.known) == (2, 1, 2)
    assert s.committed == [*PROMPT, 10, 21, 22, 24, 25, 27] and s.feed == 8


def test_a_branch_the_target_did_not_choose_changes_nothing() -> None:
    """The branch's first guess is not the target's answer: its verdict commits nothing and
    the main chunk's verdict is folded in as if the branch had never been sent."""
    s = stream()
    s.add_drafts([11, 12])
    s.next_chunk(2, branch=[21, 22])
    out = s.on_verdict(verdict(1, 0, 3, [11], accepted=0))
    assert out.branch and out.lost and out.emitted == () and not out.stale
    assert s.committed == [*PROMPT, 10] and s.epoch == Epoch(0) and s.depth == 1
    out = s.on_verdict(verdict(2, 0, 3, [11, 12, 13], accepted=2))
    assert out.emitted == (11, 12, 13) and not out.branch
    assert s.committed == [*PROMPT, 10, 11, 12, 13] and s.feed == 6


def test_an_answer_that_disagrees_with_a_committed_token_fed_again_commits_nothing() -> None:
    """Two answers for one position (a ring that is not deterministic): the committed token
    stands, nothing after it is committed, and the next chunk starts at the last committed
    token (the KV before it came from committed tokens)."""
    s = stream()
    s.add_drafts([11, 12])
    s.next_chunk(2, branch=[21, 22])
    s.on_verdict(verdict(1, 0, 3, [21, 30], accepted=1))
    assert s.committed == [*PROMPT, 10, 21, 30] and s.feed == 4
    s.add_drafts([31, 32])
    chunk = s.next_chunk(2)
    assert chunk is not None and (chunk.ids, chunk.known) == ((21, 30, 31, 32), 1)
    out = s.on_verdict(verdict(3, 1, 4, [33, 31, 32], accepted=2))
    assert out.emitted == () and out.rejected
    assert s.committed == [*PROMPT, 10, 21, 30] and s.drafts == [] and s.feed == 5
    s.add_drafts([31])
    chunk = s.next_chunk(2)
    assert chunk is not None and (chunk.start, chunk.ids, chunk.known) == (5, (30, 31), 0)


def test_a_chunk_that_feeds_tokens_again_keeps_to_the_rows_a_stage_attends_exactly() -> None:
    """A branch of 8 that held whole, then K = 8: its 9 committed tokens and 8 drafts would
    be 17 rows; the chunk keeps to REFEED_MAX_ROWS (the rows a stage attends as their decode
    steps), dropping a draft, never a committed token."""
    from shard.decode.speculation import REFEED_MAX_ROWS
    from shard.model.attention import ROWWISE_MAX_ROWS

    assert REFEED_MAX_ROWS == ROWWISE_MAX_ROWS
    s = stream()
    s.add_drafts([11])
    s.next_chunk(8, branch=list(range(21, 29)))
    s.on_verdict(verdict(1, 0, 3, [*range(21, 29), 29], accepted=8))
    assert s.committed[-9:] == list(range(21, 30)) and s.feed == 4
    s.add_drafts(list(range(30, 38)))
    chunk = s.next_chunk(8)
    assert chunk is not None and chunk.known == 8
    assert len(chunk.ids) == REFEED_MAX_ROWS and chunk.ids[:9] == tuple(range(21, 30))
