"""Test-only entry point: ``python -m shard.testing.cheat_node KIND NODE [shard args...]`` runs
``shard ARGS`` with node NODE's block replaced by a cheating one (``shard.testing.cheating``).

``cheat_node KIND NODE swarm run SPEC ...`` runs a whole swarm whose node NODE is started by
this same script (``up --role stage --node NODE``); every other node is an ordinary
``python -m shard up`` (the coordinator's with ``-v``, so every audit it hears of is logged).
There is no production flag for this: the seams are the stage's ``wrap_block``
(``shard.nodes.stage.run_stage``) and the launcher's command, patched here only. The cheating
block lies in batched forwards too (``shard.testing.cheats.batched_lies``, entered for the
whole process).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import shard.nodes.coordinator as nodes_coordinator
import shard.nodes.launcher as launcher
from shard.cli import main
from shard.model.llama import StageModel
from shard.testing import cheating
from shard.testing.cheats import batched_lies

NOISE = 1e-4  # caught bit-exactly, far too small to change a greedy token
SEED = 18


def _run(kind: str, node: str, argv: Sequence[str]) -> int:
    def wrap_block(name: str, model: StageModel) -> StageModel:
        return cheating(model, kind, noise=NOISE, seed=SEED) if name == node else model

    nodes_coordinator.run_stage = partial(nodes_coordinator.run_stage, wrap_block=wrap_block)
    command = launcher._command

    def cheat_command(spec_path: Path, name: str, role: str, *rest: object) -> list[str]:
        cmd = command(spec_path, name, role, *rest)  # type: ignore[arg-type]
        if role == "coordinator":  # -v: the scheduler logs every audit, passed ones too
            return [*cmd[:3], "-v", *cmd[3:]]
        if name != node:
            return cmd
        # "python -m shard" becomes this module
        return [sys.executable, "-m", "shard.testing.cheat_node", kind, node, *cmd[3:]]

    launcher._command = cheat_command  # type: ignore[assignment]
    with batched_lies():
        return main(list(argv))


if __name__ == "__main__":
    raise SystemExit(_run(sys.argv[1], sys.argv[2], sys.argv[3:]))
