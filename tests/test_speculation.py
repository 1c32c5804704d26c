"""The speculative loop's pure core: scripted verdicts against one session's stream."""

from __future__ import annotations

import random

import attrs
import pytest

from shard.decoding import DecodeState
from shard.messages import ChunkSeq, Epoch, SessionId, Verdict
from shard.speculation import (
    RunLengths,
    SpecConfig,
    SpecController,
    SpecStream,
    expected_tokens,
    pipeline_rate,
)

PROMPT = [1, 2, 3]
EOS = 0


def stream(max_tokens: int = 20) -> SpecStream:
    """A stream whose prefill committed token 10 at position 3."""
    decode = DecodeState.start(len(PROMPT), max_tokens, [EOS], max_len=64)
    decode.commit([10])
    return SpecStream(decode=decode, committed=[*PROMPT, 10], max_len=64, feed=3, next_seq=1)


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


def test_expected_tokens_formula() -> None:
    """(1 - a^(k+1)) / (1 - a), and k + 1 at a = 1."""
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_controller_speculates_deeper_when_drafts_hold() -> None:
    """High α with a long lap picks long chunks and a deep pipeline; low α stays shallow."""
    good = SpecController(SpecConfig(), alpha=0.95, lap_s=0.1, draft_s=0.001, stage_s=0.01)
    k, d = good.choose()
    assert k >= 3 and d >= 3
    poor = SpecController(SpecConfig(), alpha=0.05, lap_s=0.1, draft_s=0.001, stage_s=0.01)
    k, d = poor.choose()
    assert d == 1 and k <= 2
    fixed = SpecController(SpecConfig(k=3, depth=2), alpha=0.05)
    assert fixed.choose() == (3, 2)


def test_pipeline_rate_only_pays_with_high_alpha() -> None:
    """The α law: extra chunks in flight add throughput only when α^K is high."""
    kw = {"lap_s": 0.1, "draft_s": 0.0, "stage_s": 0.005}
    assert pipeline_rate(0.9, 4, 4, **kw) > 2 * pipeline_rate(0.9, 4, 1, **kw)
    assert pipeline_rate(0.3, 4, 4, **kw) < 1.05 * pipeline_rate(0.3, 4, 1, **kw)


def _runs_source(
    seed: int, chunks: int, k: int, first: float = 0.6
) -> tuple[RunLengths, SpecController]:
    """Feed a controller chunks from a source whose guesses come in runs: the first guess
    after a miss holds ``first`` of the time (60 %), later ones 97 %."""
    rng = random.Random(seed)
    control = SpecController(SpecConfig(), runs=RunLengths())
    for _ in range(chunks):
        accepted = 0
        for j in range(k):
            p = first if control.run + j == 0 else 0.97
            if rng.random() >= p:
                break
            accepted += 1
        control.observe_chunk(k, accepted, rejected=accepted < k)
    assert control.runs is not None
    return control.runs, control


def test_run_lengths_learn_that_acceptance_comes_in_runs() -> None:
    runs, control = _runs_source(0, 400, 6)
    assert runs.p(0) == pytest.approx(0.6, abs=0.12)
    assert runs.p(6) > 0.9 and runs.p(20) > 0.9
    # Inside a run the expected tokens per chunk far exceed what the overall α predicts.
    assert runs.expected(10, 6) > expected_tokens(control.alpha, 6) + 1.0


def test_controller_pipelines_long_chunks_inside_a_run() -> None:
    """Inside a long run the run model goes long and deep where the i.i.d. model at the same
    overall α stays at one chunk; where misses come in bursts (the first guess after a miss
    holds 20 % of the time), the stale-chunk cost keeps it shallower right after a miss."""
    runs, control = _runs_source(1, 400, 6)
    timing = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.05}
    inside = SpecController(SpecConfig(), runs=runs, run=12, **timing)
    k_in, d_in = inside.choose()
    assert d_in >= 3 and k_in >= 5, (k_in, d_in)
    slower = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.1}
    iid = SpecController(SpecConfig(), alpha=control.alpha, **slower)
    inside = SpecController(SpecConfig(), runs=runs, run=12, **slower)
    assert iid.choose()[1] < inside.choose()[1], (iid.choose(), inside.choose())
    bursts, _ = _runs_source(1, 400, 6, first=0.2)
    slow = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.2}
    inside = SpecController(SpecConfig(), runs=bursts, run=12, **slow)
    after_miss = SpecController(SpecConfig(), runs=bursts, run=0, **slow)
    assert after_miss.choose()[1] < inside.choose()[1], (after_miss.choose(), inside.choose())


def test_stale_chunks_cost_stage_time() -> None:
    """Same acceptance, same lap: the slower the stages (the longer a stale chunk holds up
    the re-drafted one), the shallower the pipeline; with free stages it goes to depth_max."""
    depths = [
        SpecController(SpecConfig(), alpha=0.8, lap_s=0.3, stage_s=stage).choose()[1]
        for stage in (0.0, 0.05, 0.1, 0.2)
    ]
    assert depths[0] == SpecConfig().depth_max
    assert depths == sorted(depths, reverse=True) and depths[-1] == 1, depths


def test_carry_keeps_measurements_and_resets_the_run() -> None:
    runs, control = _runs_source(2, 50, 4)
    control.observe_lap(0.4, 0.05)
    nxt = control.carry(SpecConfig(k=2))
    assert nxt.shared is runs and nxt.runs is not runs
    assert nxt.lap_s == control.lap_s and nxt.run == 0
    assert nxt.choose()[0] == 2
    assert nxt.carry(SpecConfig()).shared is runs  # every request seeds from the same one


def test_a_session_follows_its_own_text_and_the_shared_model_keeps_the_history() -> None:
    """After long copy-like evidence, a request whose drafts almost never hold stops
    pipelining within a few chunks; the shared model still knows copied runs."""
    runs, control = _runs_source(3, 400, 6)
    timing = {"lap_s": 0.3, "draft_s": 0.0, "stage_s": 0.05}
    prose = attrs.evolve(control, **timing).carry(SpecConfig())
    assert prose.choose()[1] > 1  # from the shared history alone: pipeline
    for _ in range(4):
        k, _ = prose.choose()
        prose.observe_chunk(k, 0, rejected=True)
    assert prose.choose()[1] == 1, prose.choose()
    assert prose.runs is not None and prose.runs.p(0) < 0.3
    assert runs.p(12) > 0.9  # the shared model saw those 4 chunks too
    assert sum(runs.tried) > sum(prose.runs.tried)


def test_sessions_sharing_the_stages_keep_pipelines_shallow() -> None:
    """One session alone pipelines deep; eight in flight make the stages the limit, where a
    chunk that may go stale takes compute from the others: one chunk each."""
    control = SpecController(SpecConfig(), alpha=0.9, lap_s=0.3, draft_s=0.0, stage_s=0.07)
    assert control.choose(sessions=1)[1] == SpecConfig().depth_max
    assert control.choose(sessions=8)[1] == 1
    depths = [control.choose(sessions=n)[1] for n in (1, 2, 4, 8)]
    assert depths == sorted(depths, reverse=True), depths
    fixed = SpecController(SpecConfig(k=4, depth=3), alpha=0.9, lap_s=0.3, stage_s=0.07)
    assert fixed.choose(sessions=8) == (4, 3)  # fixed values still win
