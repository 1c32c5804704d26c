"""The tiny target and draft head that the head tests share (``tests/test_head_ring.py`` in
process, ``tests/test_spec_swarm_cli.py`` through processes): one target whose first two
layers and head draft it well, and one head trained on it for seconds from fixed data and
steps. Built once per session (``conftest.agreeable_head``): training it took ~20 s, and each
module used to train its own."""

from __future__ import annotations

from pathlib import Path

import torch

from shard.testing import make_tiny_checkpoint, scale_upper_layers
from shard.training.head.build import HeadRecipe, train_head
from shard.training.head.trainer import TrainSettings

# A fixed count of feature chunks and of steps, with a time budget that never binds: the
# same head on any machine, however loaded (a 12 s data budget made 214 chunks here and far
# fewer on a busy CI box, whose head then guessed nothing).
RECIPE = HeadRecipe(
    minutes=60.0,
    shortlist=0,
    seq_len=96,
    rows_per_chunk=8,
    data_chunks=64,
    train=TrainSettings(batch=4, max_steps=800, checkpoint_every=1000, ce_positions=64),
)


def agreeable_target(root: Path) -> Path:
    """A 4-layer tiny model (seed 11) whose layers >= 1 are scaled down, so that its first
    layers and head agree with it often (a ``model`` draft of 2 layers, and the head)."""
    base = make_tiny_checkpoint(root / "tiny", seed=11, n_layers=4)
    return scale_upper_layers(base, root / "agree", from_layer=1, factor=0.05)


def train_tiny_head(model_dir: Path, root: Path) -> Path:
    """``RECIPE``'s head for ``model_dir`` under ``root``: fixed data and steps, on one
    thread, so that the same target always gives the same head (and the same guesses)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_head(model_dir, root / "h", root / "features", RECIPE, progress=False)
    finally:
        torch.set_num_threads(before)
    return root / "h"
