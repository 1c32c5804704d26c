"""``[formation]``: a swarm whose ring forms itself from nodes started with ``--join``.

```toml
[formation]
expect = 3              # form the ring once this many nodes have joined (and hold the model)
wait_s = 120.0          # ... or at this deadline with whoever joined, if they hold the model
probes = 5              # Probe/ProbeReply round trips per pair in the RTT mesh (the median)
pin_boundaries = false  # only `trusted` nodes hold the first block and the last
trusted = ["gpu-a"]     # node names the coordinator trusts (never a node's own word)
```

A spec with ``[formation]`` names no ``[[stage]]`` and no ``[[standby]]``: every stage and
standby joins with ``shard up --role stage --join HOST:PORT`` and the coordinator's scheduler
places it (``shard.failover.formation``; docs/placement.md). A spec without it runs exactly
as written, as before.
"""

from __future__ import annotations

from typing import Final

import attrs

from shard.spec.validate import Table

FORMATION_KEYS: Final = ("expect", "wait_s", "probes", "pin_boundaries", "trusted")


@attrs.frozen
class FormationSpec:
    """Typed ``[formation]``: when to form the ring (``expect`` nodes, or ``wait_s``), how
    many probes measure each RTT, and boundary pinning to ``trusted`` node names."""

    expect: int = 1
    wait_s: float = 120.0
    probes: int = 5
    pin_boundaries: bool = False
    trusted: tuple[str, ...] = ()


def read_formation(table: Table) -> FormationSpec:
    """Validate ``[formation]``. Errors: ``SpecError`` naming the key."""
    trusted = table.raw("trusted", None)
    if trusted is None:
        trusted = []
    if not isinstance(trusted, list) or not all(isinstance(t, str) and t for t in trusted):
        raise table.error(
            "trusted", f'expected a list of node names, e.g. ["gpu-a"]; got {trusted!r:.60}'
        )
    spec = FormationSpec(
        expect=table.integer("expect", default=1, minimum=1),
        wait_s=table.number("wait_s", default=120.0, positive=True),
        probes=table.integer("probes", default=5, minimum=1),
        pin_boundaries=table.boolean("pin_boundaries", default=False),
        trusted=tuple(trusted),
    )
    if spec.pin_boundaries and not spec.trusted:
        raise table.error(
            "pin_boundaries",
            "needs trusted nodes for the first and last blocks; list them in trusted = [...]",
        )
    if spec.probes > 100:
        raise table.error("probes", f"at most 100 probes per pair, got {spec.probes}")
    return spec
