"""Composition root of a seeder node: one ``Seeder`` serving a spec's weight chunks.

A stage named like a seeder serves its own copy instead (``shard.nodes.stage``).
"""

from __future__ import annotations

from pathlib import Path

import trio

from shard.nodes.fetching import make_seeder
from shard.spec.swarm import SwarmSpec


async def run_seeder(
    spec: SwarmSpec,
    name: str,
    model_dir: Path,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve seeder ``name`` of ``spec`` until cancelled; reports its bound address.

    Errors: ``ValueError`` when ``spec`` names no seeder ``name``.
    """
    seeder = make_seeder(spec, name, model_dir)
    if seeder is None:
        raise ValueError(f"no seeder {name!r} in the spec")
    async with trio.open_nursery() as nursery:
        task_status.started(await nursery.start(seeder.run))


__all__ = ["run_seeder"]
