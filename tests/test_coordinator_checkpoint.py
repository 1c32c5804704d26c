"""Request checkpoint files: a round trip, and a hostile file refused as ``CheckpointError``."""

from __future__ import annotations

import itertools

import pytest

from shard.coordinator.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointStore,
    RequestCheckpoint,
)
from shard.coordinator.follow import Followed, _opening
from shard.messages import FollowCommit, Sampling
from shard.model.attention import ROWWISE_MAX_ROWS


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_checkpoint_reads_back_as_written(ignore_eos: bool) -> None:
    """``from_json(to_json())`` is the same checkpoint (``ignore_eos`` too)."""
    checkpoint = RequestCheckpoint("r1", (1, 2), (3,), 8, ignore_eos=ignore_eos)
    assert RequestCheckpoint.from_json(checkpoint.to_json(), source="r1.json") == checkpoint


def test_a_non_boolean_ignore_eos_is_a_checkpoint_error() -> None:
    """``"ignore_eos": 1`` is refused, naming the file."""
    text = RequestCheckpoint("r1", (1,), (), 4).to_json()[:-1] + ', "ignore_eos": 1}'
    with pytest.raises(CheckpointError, match=r"bad\.json: .*ignore_eos"):
        RequestCheckpoint.from_json(text, source="bad.json")


def test_a_followed_request_keeps_ignore_eos() -> None:
    """The follow link's opening carries ``ignore_eos``: the standby resumes the request
    with EOS ignored, as its first run had it."""
    checkpoint = RequestCheckpoint("r1", (1, 2), (3,), 8, ignore_eos=True)
    followed = Followed()
    followed.apply(_opening(checkpoint, 1))
    followed.apply(FollowCommit("r1", 1, (4,), generation=1))
    assert followed.requests["r1"] == RequestCheckpoint("r1", (1, 2), (3, 4), 8, ignore_eos=True)


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"request": ' + "[" * 65 + "]" * 65 + "}"],
    ids=["past-the-parser", "past-64"],
)
def test_deep_nesting_is_a_checkpoint_error(text: str) -> None:
    """A deeply nested file is a ``CheckpointError`` naming it, never a ``RecursionError``."""
    with pytest.raises(CheckpointError, match=r"bad\.json: not a request checkpoint.*nested"):
        RequestCheckpoint.from_json(text, source="bad.json")


def test_a_checkpoint_left_without_an_end_is_dropped_after_keep_s() -> None:
    """A live checkpoint not saved for ``keep_s`` is dropped at the next save; one saved
    since stays; a request that commits again gets its entry back."""
    now = [0.0]
    store = CheckpointStore(None, keep_s=10.0, clock=lambda: now[0])
    left = RequestCheckpoint("left", (1,), (2,), 8)
    store.save(left)
    now[0] = 5.0
    store.save(RequestCheckpoint("running", (1,), (), 8))
    now[0] = 10.5
    store.save(RequestCheckpoint("running", (1,), (3,), 8))
    assert store.get("left") is None and store.get("running") is not None
    store.save(left)
    assert store.get("left") == left


def test_at_most_max_live_checkpoints_are_kept() -> None:
    """Beyond ``max_live`` the least recently saved go first."""
    store = CheckpointStore(None, max_live=2, clock=lambda: 0.0)
    for name in ("a", "b", "c"):
        store.save(RequestCheckpoint(name, (1,), (), 4))
    store.save(RequestCheckpoint("b", (1,), (5,), 4))
    store.save(RequestCheckpoint("d", (1,), (), 4))
    assert sorted(store.live) == ["b", "d"]


def test_a_resumed_run_prefills_its_output_in_chunks_its_decode_steps_give_bit_for_bit() -> None:
    """A resumed request re-sends prompt + committed output: the prompt in ``prefill_chunk``
    pieces from 0 (as its first run), then the output in pieces of at most
    ``ROWWISE_MAX_ROWS`` rows, which a quantized block attends row by row: the bits of the
    decode steps that made them. One 33-row chunk of SmolLM2 stored was up to 0.30 off in
    the logits and flipped a 0.07 tie: the soak's one wrong resumed stream (issue 40)."""
    store = CheckpointStore(None)
    resumed = Checkpointer(store, RequestCheckpoint("r1", tuple(range(1, 6)), tuple(range(40)), 64))
    pieces = resumed.pieces(45, 4)
    assert pieces[:2] == [(0, 4), (4, 5)]  # the prompt as its first run chunked it
    rest = pieces[2:]
    assert rest[0][0] == 5 and rest[-1][1] == 45
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(rest))
    assert max(b - a for a, b in rest) == ROWWISE_MAX_ROWS
    fresh = Checkpointer.fresh(store, "r2", range(300), 8, Sampling())
    assert fresh.pieces(300, 128) == [(0, 128), (128, 256), (256, 300)]  # a first run: unchanged
