"""What a swarm's spec leaves to its checkpoint: ``[swarm] weights`` and, for a checkpoint
that holds an MTP block, the draft.

``with_checkpoint_weights(spec, model_dir)`` gives a spec that says no ``weights`` the
checkpoint's default (``shard.model.weights.checkpoint_weights``: ``"stored"`` for a checkpoint
that keeps quantized tensors; a float checkpoint's default, each node's own ``dtype``, is what no
choice already means). Every composition root (coordinator, stage, standby, joining node) and
the CLI's plan apply it where they first meet the model's files, so every node prices, loads,
declares and audits its block in the one format the local reference
(``shard generate --local``, ``load_stage``) resolves to.

``with_checkpoint_defaults`` adds the draft: a spec whose ``[speculation]`` names no draft,
over a checkpoint that holds an MTP block (``has_mtp_block``: DeepSeek-V3, GLM-4.5), drafts
with that block at the tail (``draft = "mtp"``, ``k`` and ``depth`` "auto"). The coordinator
and the stage and standby roots apply it, so the tail loads the block the coordinator's
sessions ask it to run; a tail that does not (a joining node, a fetched block without it)
answers without drafts.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from shard.decode.control import SpeculationConfig
from shard.decode.head.mtp import has_mtp_block
from shard.model.weights import checkpoint_weights
from shard.spec.swarm import SwarmSpec

__all__ = ["with_checkpoint_defaults", "with_checkpoint_weights"]


def with_checkpoint_weights(spec: SwarmSpec, model_dir: Path) -> SwarmSpec:
    """``spec`` with ``weights`` defaulted from the checkpoint in ``model_dir`` (its
    safetensors headers: a fetched block's, or only the headers a joining node fetched first,
    answer alike); a spec that names ``weights`` is returned as it is."""
    if spec.weights is not None:
        return spec
    found = checkpoint_weights(model_dir)
    return spec if found is None else attrs.evolve(spec, weights=found)


def with_checkpoint_defaults(spec: SwarmSpec, model_dir: Path) -> SwarmSpec:
    """``with_checkpoint_weights``, and a spec that names no draft set to draft with the
    checkpoint's MTP block at the tail when it holds one (the module's docstring). A draft
    other than "none" is kept however the spec was made (a spec built in code, not read from
    a table, has ``given`` False)."""
    spec = with_checkpoint_weights(spec, model_dir)
    plan = spec.speculation
    if plan.given or plan.draft != "none" or not has_mtp_block(model_dir):
        return spec
    policy = SpeculationConfig(k_max=plan.policy.k_max, depth_max=plan.policy.depth_max)
    return attrs.evolve(spec, speculation=attrs.evolve(plan, draft="mtp", policy=policy))
