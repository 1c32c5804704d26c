"""``ExecutorConfig``: a stage executor's record, built once by its node's root from the
spec's ``[limits]`` (``shard.nodes.stage_config``); ``StageAides``: what it works with beside
its block and channels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from shard.messages import NodeName
from shard.stage.batch import DEFAULT_MAX_BATCH_ROWS

if TYPE_CHECKING:
    from shard.stage.graphs import ChunkGraphs
    from shard.stage.tail_drafts import TailDrafts
    from shard.trust.receipts import ReceiptSigner

__all__ = ["ExecutorConfig", "StageAides"]


def _check(config: ExecutorConfig) -> None:
    if config.max_sessions < 1 or config.max_batch_rows < 1 or not config.gather_window_s >= 0:
        raise ValueError(
            f"max_sessions {config.max_sessions} and max_batch_rows {config.max_batch_rows} "
            f"must be >= 1 and gather_window_s {config.gather_window_s} >= 0"
        )


@attrs.frozen
class ExecutorConfig:
    """The node it runs in; how many sessions it holds at once and how long each may be
    (``max_len``: the swarm's ``limits.max_len``, capped by the model's context; None: the
    context); how many rows one batched forward takes and how long it waits to gather them;
    and its KV budget (None: no cap but sessions × length)."""

    node: NodeName
    max_sessions: int = 16
    max_len: int | None = None
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    gather_window_s: float = 0.0
    kv_budget_bytes: int | None = None

    def __attrs_post_init__(self) -> None:
        _check(self)


@attrs.frozen
class StageAides:
    """What a stage executor works with beside its block and channels (each None: not used):
    ``receipts`` signs what it computed; ``graphs``, its CUDA graphs per chunk shape (None:
    every chunk eager); ``drafts``, the checkpoint's MTP block at a tail that drafts with it
    (``shard.stage.tail_drafts``)."""

    receipts: ReceiptSigner | None = None
    graphs: ChunkGraphs | None = None
    drafts: TailDrafts | None = None
