"""What a swarm's spec leaves to its checkpoint: ``[swarm] weights``.

``with_checkpoint_weights(spec, model_dir)`` gives a spec that says no ``weights`` the
checkpoint's default (``shard.model.weights.checkpoint_weights``: ``"stored"`` for a checkpoint
that keeps quantized tensors; a float checkpoint's default, each node's own ``dtype``, is what no
choice already means). Every composition root (coordinator, stage, standby, joining node) and
the CLI's plan apply it where they first meet the model's files, so every node prices, loads,
declares and audits its block in the one format the local reference
(``shard generate --local``, ``load_stage``) resolves to.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from shard.model.weights import checkpoint_weights
from shard.spec.swarm import SwarmSpec

__all__ = ["with_checkpoint_weights"]


def with_checkpoint_weights(spec: SwarmSpec, model_dir: Path) -> SwarmSpec:
    """``spec`` with ``weights`` defaulted from the checkpoint in ``model_dir`` (its
    safetensors headers: a fetched block's, or only the headers a joining node fetched first,
    answer alike); a spec that names ``weights`` is returned as it is."""
    if spec.weights is not None:
        return spec
    found = checkpoint_weights(model_dir)
    return spec if found is None else attrs.evolve(spec, weights=found)
