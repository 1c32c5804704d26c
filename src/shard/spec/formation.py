"""``[formation]``: a swarm whose ring forms itself from nodes started with ``--join``.

```toml
[formation]
expect = 3              # form the ring once this many nodes have joined (and hold the model)
stages = 2              # the ring holds exactly this many stages (absent: as many as the
                        # predicted lap favours; nodes that each hold the model make one)
wait_s = 120.0          # ... or at this deadline with whoever joined, if they hold the model
probes = 5              # Probe/ProbeReply round trips per pair in the RTT mesh (the median)
pin_boundaries = false  # only trusted nodes hold the first block and the last
trusted = ["gpu-a"]     # node names the coordinator trusts (never a node's own word); in a
                        # secure swarm, so is a node whose token grants the role `trusted`
remeasure_s = 60.0      # re-measure the mesh this often once the ring formed (0: never)
unreachable = []        # node names taken as accepting no inbound connection (else detected)
```

A spec with ``[formation]`` names no ``[[stage]]`` and no ``[[standby]]``: every stage and
standby joins with ``shard up --role stage --join HOST:PORT`` and the coordinator's scheduler
places it (``shard.formation``; docs/placement.md). A spec without it runs exactly
as written, as before.
"""

from __future__ import annotations

from typing import Final

import attrs

from shard.spec.validate import Table

FORMATION_KEYS: Final = (
    "expect", "stages", "wait_s", "probes", "pin_boundaries", "trusted", "remeasure_s",
    "unreachable",
)  # fmt: skip
#: ``remeasure_s`` is 0 (never) or at least this: a round may take up to 20 s itself.
MIN_REMEASURE_S: Final = 5.0


@attrs.frozen
class FormationSpec:
    """Typed ``[formation]``: when to form the ring (``expect`` nodes, or ``wait_s``), how
    many stages it holds (``stages``; None: the planner's choice by predicted lap, which puts
    the whole model on one node whenever one holds it and the hop costs more than it saves),
    how many probes measure each RTT, boundary pinning to ``trusted`` node names, how often the
    mesh is measured again after forming (``remeasure_s``; 0: never), and the node names the
    operator declares unreachable (``unreachable``: never probed into a ring position,
    whatever detection says)."""

    expect: int = 1
    wait_s: float = 120.0
    probes: int = 5
    pin_boundaries: bool = False
    trusted: tuple[str, ...] = ()
    remeasure_s: float = 60.0
    unreachable: tuple[str, ...] = ()
    stages: int | None = None


def _names(table: Table, key: str) -> tuple[str, ...]:
    names = table.raw(key, None)
    if names is None:
        names = []
    if not isinstance(names, list) or not all(isinstance(t, str) and t for t in names):
        raise table.error(key, f'expected a list of node names, e.g. ["gpu-a"]; got {names!r:.60}')
    return tuple(names)


def read_formation(table: Table, *, secure: bool = True) -> FormationSpec:
    """Validate ``[formation]``; ``secure``: the swarm admits nodes by token, so a token's
    ``trusted`` role may mark boundary nodes too. Errors: ``SpecError`` naming the key."""
    spec = FormationSpec(
        expect=table.integer("expect", default=1, minimum=1),
        stages=table.integer("stages", default=0, minimum=1) or None,
        wait_s=table.number("wait_s", default=120.0, positive=True),
        probes=table.integer("probes", default=5, minimum=1),
        pin_boundaries=table.boolean("pin_boundaries", default=False),
        trusted=_names(table, "trusted"),
        remeasure_s=table.number("remeasure_s", default=60.0),
        unreachable=_names(table, "unreachable"),
    )
    if spec.pin_boundaries and not spec.trusted and not secure:
        raise table.error(
            "pin_boundaries",
            "needs trusted nodes for the first and last blocks; list them in trusted = [...] "
            "(in a secure swarm, a node whose admission token grants the role trusted is one)",
        )
    if spec.stages is not None and spec.stages > spec.expect:
        raise table.error(
            "stages",
            f"a ring of {spec.stages} stages needs expect >= {spec.stages} joined nodes "
            f"(expect = {spec.expect})",
        )
    if spec.probes > 100:
        raise table.error("probes", f"at most 100 probes per pair, got {spec.probes}")
    if 0 < spec.remeasure_s < MIN_REMEASURE_S:
        raise table.error(
            "remeasure_s",
            f"0 (never) or at least {MIN_REMEASURE_S:g} s (a round itself may take 20 s); "
            f"got {spec.remeasure_s:g}",
        )
    return spec
