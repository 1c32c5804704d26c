"""Request checkpoint files: a round trip, and a hostile file refused as ``CheckpointError``."""

from __future__ import annotations

import pytest

from shard.coordinator.checkpoint import CheckpointError, RequestCheckpoint


def test_a_checkpoint_reads_back_as_written() -> None:
    """``from_json(to_json())`` is the same checkpoint."""
    checkpoint = RequestCheckpoint("r1", (1, 2), (3,), 8)
    assert RequestCheckpoint.from_json(checkpoint.to_json(), source="r1.json") == checkpoint


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"request": ' + "[" * 65 + "]" * 65 + "}"],
    ids=["past-the-parser", "past-64"],
)
def test_deep_nesting_is_a_checkpoint_error(text: str) -> None:
    """A deeply nested file is a ``CheckpointError`` naming it, never a ``RecursionError``."""
    with pytest.raises(CheckpointError, match=r"bad\.json: not a request checkpoint.*nested"):
        RequestCheckpoint.from_json(text, source="bad.json")
