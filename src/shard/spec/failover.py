"""Failover in a swarm spec: ``[failover]`` timings, ``[[standby]]`` nodes, scripted ``[[faults]]``.

```toml
[failover]
heartbeat_s = 0.25       # idle ring edges and control links send a heartbeat this often
dead_after_s = 4.0       # silence alone never convicts a node sooner than this
suspect_phi = 3.0        # phi (shard.failover.detector) at which a silent node is suspected
dead_phi = 8.0           # ... and at which, past dead_after_s, it is dead
min_std_s = 0.1          # floor on the heartbeat gaps' measured standard deviation
send_timeout_s = 2.0     # a ring send that takes longer fails the link
join_deadline_s = 30.0   # no standby: wait this long for a spare to register, else fail
splice_timeout_s = 30.0  # activating a standby and rewiring its predecessor, within this
replay_max_mib = 1024    # bound on each edge's log of sent activations (host memory)
register_timeout_s = 10.0  # a control connection must send its Register within this
probe_s = 1.0            # the scheduler probes each control link's RTT this often
checkpoint_dir = "ckpt"  # the coordinator saves each request's committed tokens here (optional)

[[standby]]              # `shard up --role standby --spec SPEC --node s1-standby`
name = "s1-standby"
listen = "127.0.0.1:7711"
layers_of = "s1"         # hot: loads s1's block at start; omit for a spare (loads when assigned)
# role = "auditor"       # a dedicated auditor: holds layers_of's block, answers audits, is
                         # never spliced in (`shard up --role auditor`); default "standby"
key = "keys/s1-standby.key"      # key / token as on [[stage]] (secure swarms)
token = "keys/s1-standby.token"

[[faults]]               # scripted faults, acted on by `shard swarm run` only
kind = "kill"            # kill | stall | sever
node = "s1"              # kill/stall: that stage's process; sever: its edge to its successor
at_token = 12            # when the run has committed this many tokens, or
# at_s = 2.0             # this many seconds after the first request starts (exactly one)
# seconds = 3.0          # stall only (required there): how long the process stays stopped
```

The standby record, ``StandbySpec``, lives in ``shard.spec.nodes`` beside ``StageSpec`` (it holds an
``Address``); its ``layers_of`` is read here. Every rule is checked when the spec loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from shard.spec.device import STAGE_DEVICE_KEYS
from shard.spec.trust import CREDENTIAL_KEYS
from shard.spec.validate import Table

FAILOVER_KEYS: Final = (
    "heartbeat_s",
    "dead_after_s",
    "send_timeout_s",
    "join_deadline_s",
    "splice_timeout_s",
    "replay_max_mib",
    "checkpoint_dir",
    "register_timeout_s",
    "probe_s",
    "suspect_phi",
    "dead_phi",
    "min_std_s",
)
STANDBY_KEYS: Final = (
    "name", "listen", "reachable", "layers_of", "role", *CREDENTIAL_KEYS, *STAGE_DEVICE_KEYS
)  # fmt: skip
#: ``standby``: spliced in for a dead stage (and audits while it waits); ``auditor``: only
#: audits (``[audit] enabled``), never spliced in, so it must hold a block (``layers_of``).
STANDBY_ROLES: Final = ("standby", "auditor")
FAULT_KEYS: Final = ("kind", "node", "at_token", "at_s", "seconds")
#: ``kill``: SIGKILL a stage's process; ``stall``: SIGSTOP it for ``seconds``, then SIGCONT;
#: ``sever``: cut the ring edge from ``node`` to its successor (at its relay).
FAULT_KINDS: Final = ("kill", "stall", "sever")


@attrs.frozen
class FailoverSpec:
    """Typed ``[failover]``: detection and recovery timings, and the replay log bound.

    The scheduler (``shard.failover.scheduler``), its failure detector
    (``shard.failover.detector``) and the ring links take this record as is.

    The detector's defaults are for a WAN: ``dead_after_s`` outlasts a TCP stream stalled by
    two lost segments in a row (retransmission timeouts of 1 s, then 2 s) plus jitter, so a
    frozen node costs 4 s before it is replaced, a killed one (its sockets close) nothing."""

    heartbeat_s: float = 0.25
    dead_after_s: float = 4.0
    send_timeout_s: float = 2.0
    join_deadline_s: float = 30.0
    splice_timeout_s: float = 30.0
    replay_max_mib: int = 1024
    checkpoint_dir: str | None = None  # absolute; None: no checkpoints
    register_timeout_s: float = 10.0  # a new control connection's Register, within this
    probe_s: float = 1.0  # control-link RTT probes (shard.membership.rtt)
    suspect_phi: float = 3.0  # a silent node is suspected at this phi
    dead_phi: float = 8.0  # ... and dead at this one, once silent for dead_after_s
    min_std_s: float = 0.1  # floor on the measured heartbeat gaps' standard deviation

    @property
    def replay_max_bytes(self) -> int:
        return self.replay_max_mib << 20


@attrs.frozen
class FaultSpec:
    """One scripted fault: ``kind`` on ``node`` at ``at_token`` committed tokens or ``at_s``
    seconds after the first request starts (exactly one is set). ``seconds``: a stall's
    length (0.0 for kill and sever)."""

    kind: str
    node: str
    at_token: int | None = None
    at_s: float | None = None
    seconds: float = 0.0


def read_failover(table: Table, base_dir: Path | None = None) -> FailoverSpec:
    """Validate ``[failover]`` (an absent table reads as the defaults). A relative
    ``checkpoint_dir`` resolves against ``base_dir`` (the spec's directory), else the cwd."""
    d = FailoverSpec()
    checkpoint_dir = None
    if table.raw("checkpoint_dir", None) is not None:
        path = Path(table.string("checkpoint_dir", example='"ckpt"')).expanduser()
        if not path.is_absolute():
            path = (base_dir if base_dir is not None else Path.cwd()) / path
        checkpoint_dir = str(path)
    spec = FailoverSpec(
        heartbeat_s=table.number("heartbeat_s", default=d.heartbeat_s, positive=True),
        dead_after_s=table.number("dead_after_s", default=d.dead_after_s, positive=True),
        send_timeout_s=table.number("send_timeout_s", default=d.send_timeout_s, positive=True),
        join_deadline_s=table.number("join_deadline_s", default=d.join_deadline_s, positive=True),
        splice_timeout_s=table.number(
            "splice_timeout_s", default=d.splice_timeout_s, positive=True
        ),
        replay_max_mib=table.integer("replay_max_mib", default=d.replay_max_mib, minimum=1),
        checkpoint_dir=checkpoint_dir,
        register_timeout_s=table.number(
            "register_timeout_s", default=d.register_timeout_s, positive=True
        ),
        probe_s=table.number("probe_s", default=d.probe_s, positive=True),
        suspect_phi=table.number("suspect_phi", default=d.suspect_phi, positive=True),
        dead_phi=table.number("dead_phi", default=d.dead_phi, positive=True),
        min_std_s=table.number("min_std_s", default=d.min_std_s, positive=True),
    )
    if spec.dead_after_s < 2 * spec.heartbeat_s:
        raise table.error(
            "dead_after_s",
            f"{spec.dead_after_s} is under two heartbeats (heartbeat_s = {spec.heartbeat_s}); "
            f"set dead_after_s >= {2 * spec.heartbeat_s} or lower heartbeat_s",
        )
    if spec.dead_phi < spec.suspect_phi:
        raise table.error(
            "dead_phi",
            f"{spec.dead_phi} is under suspect_phi = {spec.suspect_phi} (a node must be "
            f"suspected before it is dead); set dead_phi >= {spec.suspect_phi}",
        )
    return spec


def read_layers_of(table: Table, stages: Sequence[str]) -> str | None:
    """A ``[[standby]]``'s ``layers_of``: the stage whose block it holds hot, or None (a spare)."""
    if table.raw("layers_of", None) is None:
        return None
    name = table.string("layers_of", example=f'"{stages[0]}"')
    if name not in stages:
        raise table.error(
            "layers_of",
            f"no stage named {name!r}; name the stage whose block this standby loads "
            f"({', '.join(stages)}), or omit layers_of for a spare",
        )
    return name


def read_standby_role(table: Table, layers_of: str | None) -> str:
    """A ``[[standby]]``'s ``role``: ``standby`` (the default) or ``auditor``."""
    role = table.string("role", default="standby", example='"auditor"')
    if role not in STANDBY_ROLES:
        raise table.error("role", f"unknown role {role!r}; use one of {', '.join(STANDBY_ROLES)}")
    if role == "auditor" and layers_of is None:
        raise table.error(
            "layers_of",
            "an auditor re-runs a stage's block, so it must hold one: add layers_of = "
            '"<stage name>" (or make it a spare: role = "standby")',
        )
    return role


def read_faults(top: Table, stages: Sequence[str], coordinator: str) -> tuple[FaultSpec, ...]:
    """Validate the ``[[faults]]`` of the spec ``top``; ``stages`` are its stage names."""
    return tuple(_read_fault(t, stages, coordinator) for t in top.tables("faults", FAULT_KEYS))


def _read_fault(table: Table, stages: Sequence[str], coordinator: str) -> FaultSpec:
    kind = table.string("kind", example='"kill"')
    if kind not in FAULT_KINDS:
        raise table.error("kind", f"unknown fault {kind!r}; use one of {', '.join(FAULT_KINDS)}")
    node = table.string("node", example=f'"{stages[0]}"')
    allowed = [*stages, coordinator] if kind == "sever" else list(stages)
    if node not in allowed:
        what = "a stage or the coordinator" if kind == "sever" else "a stage"
        raise table.error(
            "node",
            f"no node named {node!r} here; a {kind} fault names {what}: {', '.join(allowed)}",
        )
    has_token, has_s = table.raw("at_token", None) is not None, table.raw("at_s", None) is not None
    if has_token == has_s:
        problem = "both given; keep one" if has_token else "neither given; add one"
        raise table.error(
            "at_token",
            f"a fault needs exactly one of at_token (committed tokens) or at_s (seconds): "
            f"{problem}, e.g. at_token = 12",
        )
    at_token = table.integer("at_token", default=0, minimum=0) if has_token else None
    at_s = table.number("at_s", default=0.0, positive=True) if has_s else None
    if kind != "stall":
        if table.raw("seconds", None) is not None:
            raise table.error("seconds", f"only a stall has a length; remove it from this {kind}")
        return FaultSpec(kind, node, at_token, at_s)
    if table.raw("seconds", None) is None:
        raise table.error("seconds", "missing required key for a stall; add seconds = 3.0")
    return FaultSpec(
        kind, node, at_token, at_s, table.number("seconds", default=0.0, positive=True)
    )
