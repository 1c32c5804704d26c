"""Spot checks in a swarm spec: the ``[audit]`` table.

```toml
[audit]
enabled = true            # audit in a real swarm (absent or false: in-process taps only)
rate = 0.05               # each chunk a stage sends is audited with this probability
strikes = 2               # failed audits after which the scheduler evicts the stage
sketch_dims = 256         # random-projection sketch size (mixed hardware or dtypes)
# cosine_threshold = 0.999 # a sketch's smallest per-row cosine must reach this (absent:
                          # calibrated to the two ends' dtypes, shard.audit.compare)
token_margin = 1.0        # the tail: a differing token within this many logits is a tie
mode = "sample"           # "hold": a chunk's tokens reach the client only once audited
hold_timeout_s = 60.0     # hold: a verdict not confirmed this long ends its request
evidence_dir = "evidence" # each strike's signed evidence is written here (absent: the cache)
```

An absent table reads as these defaults. A relative ``evidence_dir`` resolves against the
spec's directory; absent, the coordinator writes evidence to
``$XDG_CACHE_HOME/shard/evidence`` (else ``~/.cache/shard/evidence``;
``shard.audit.evidence_files``). What the keys mean, and how the threshold was
calibrated, is in ``docs/security.md`` (spot checks) and ``shard.audit.compare``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from shard.spec.validate import Table

AUDIT_KEYS: Final = (
    "enabled",
    "rate",
    "strikes",
    "sketch_dims",
    "cosine_threshold",
    "token_margin",
    "mode",
    "hold_timeout_s",
    "evidence_dir",
)
AUDIT_MODES: Final = ("sample", "hold")


@attrs.frozen
class AuditSpec:
    """Typed ``[audit]``: how often chunks are audited, how they are compared, and how many
    failed audits evict a stage."""

    rate: float = 0.05
    #: nodes copy ring chunks to the scheduler, which has standbys audit them (nodes/audits)
    enabled: bool = False
    strikes: int = 2
    sketch_dims: int = 256
    #: None: calibrated from measured honest noise for the two ends' dtypes
    #: (``shard.audit.compare.calibrated_threshold``); a number overrides it
    cosine_threshold: float | None = None
    #: the tail's verdicts where replay is not bit-exact: a token that differs from the
    #: auditor's is a strike only if raising its logit by this much would not make it chosen
    token_margin: float = 1.0
    #: "sample": audit at ``rate``, tokens reach the client as committed; "hold": audit every
    #: chunk of every stage and release a chunk's tokens only once an independent replica
    #: confirmed every stage's part of it (``shard.audit.hold``, docs/security.md)
    mode: str = "sample"
    #: hold: how long a verdict may wait for its confirmations before its request ends
    hold_timeout_s: float = 60.0
    #: where the coordinator writes each strike's signed evidence (absolute; None: the
    #: default under shard's cache, ``shard.audit.evidence_files.default_evidence_dir``)
    evidence_dir: str | None = None


def _evidence_dir(table: Table, base_dir: Path | None) -> str | None:
    if table.raw("evidence_dir", None) is None:
        return None
    path = Path(table.string("evidence_dir", example='"evidence"')).expanduser()
    return str(path if path.is_absolute() else (base_dir or Path.cwd()) / path)


def read_audit(table: Table, base_dir: Path | None = None) -> AuditSpec:
    """Validate ``[audit]`` (absent: the defaults). A relative ``evidence_dir`` resolves
    against ``base_dir`` (the spec's directory), else the cwd. Errors: ``SpecError`` naming
    the key."""
    d = AuditSpec()
    spec = AuditSpec(
        rate=table.number("rate", default=d.rate),
        enabled=table.boolean("enabled", default=d.enabled),
        strikes=table.integer("strikes", default=d.strikes, minimum=1),
        sketch_dims=table.integer("sketch_dims", default=d.sketch_dims, minimum=1),
        cosine_threshold=(
            table.number("cosine_threshold", default=1.0)
            if table.raw("cosine_threshold", None) is not None
            else None
        ),
        token_margin=table.number("token_margin", default=d.token_margin),
        mode=table.string("mode", default=d.mode),
        hold_timeout_s=table.number("hold_timeout_s", default=d.hold_timeout_s, positive=True),
        evidence_dir=_evidence_dir(table, base_dir),
    )
    if spec.mode not in AUDIT_MODES:
        raise table.error("mode", f"must be one of {', '.join(AUDIT_MODES)}, not {spec.mode!r}")
    if not 0.0 <= spec.rate <= 1.0:
        raise table.error("rate", f"must be in [0, 1] (a probability), not {spec.rate}")
    if spec.sketch_dims > 65536:
        raise table.error("sketch_dims", f"must be at most 65536, not {spec.sketch_dims}")
    if spec.cosine_threshold is not None and not 0.0 < spec.cosine_threshold <= 1.0:
        raise table.error("cosine_threshold", f"must be in (0, 1], not {spec.cosine_threshold}")
    if not 0.0 <= spec.token_margin <= 100.0:
        raise table.error("token_margin", f"must be in [0, 100] logits, not {spec.token_margin}")
    return spec
