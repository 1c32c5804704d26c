"""Status feed messages: the coordinator's live snapshot of the ring for monitors."""

from __future__ import annotations

import attrs

from shard.messages.ids import NodeName


@attrs.frozen
class EdgeStatus:
    """One ring edge's one-way transit over the recent window, in seconds: the last sample and
    the median; None before the first sample. Taken from the wall-clock stamps in ``Hop``, so
    only meaningful when the nodes share a clock (one host, or NTP-synced hosts)."""

    src: NodeName
    dst: NodeName
    last_s: float | None = None
    median_s: float | None = None


@attrs.frozen
class StageStatus:
    """One stage's compute per chunk over the recent window (seconds; None before a sample).

    ``chunks`` counts the samples in the window; ``queue`` is the stage's inbox depth, None
    while stages do not report it (a monitor shows it as unknown, never as 0);
    ``queued_median_s`` is a chunk's median wait at the stage before its forward,
    ``batch_rows_median`` the median rows of those forwards, all sessions together, and
    ``forwards_per_s`` the stage's forward passes per second over the window (None: unknown).
    """

    node: NodeName
    compute_last_s: float | None = None
    compute_median_s: float | None = None
    chunks: int = 0
    queue: int | None = None
    queued_median_s: float | None = None
    batch_rows_median: float | None = None
    forwards_per_s: float | None = None


@attrs.frozen
class DeviceStatus:
    """One GPU of a node, read through NVML: which (``index``, ``name``), its memory in bytes
    and its utilisation in percent over NVML's last sample (None where NVML gives none)."""

    node: NodeName
    index: int
    name: str
    memory_used: int
    memory_total: int
    utilization: int | None = None


@attrs.frozen
class EventRecord:
    """Something that happened to the ring (join, fault, splice, epoch, reset); ``at`` is the
    coordinator's wall clock."""

    at: float
    kind: str
    detail: str


@attrs.frozen
class AuditCounts:
    """Spot checks so far (``shard.audit.strikes``): audits answered, failed audits
    (strikes) and stages evicted for them; ``evicted`` names them (a monitor drops them from
    the ring line), ``evidence`` is the paths of the latest evidence files the coordinator
    wrote (``[audit] evidence_dir``; newest last; ``shard receipt verify --evidence``)."""

    audits: int = 0
    strikes: int = 0
    evictions: int = 0
    evicted: tuple[NodeName, ...] = ()
    evidence: tuple[str, ...] = ()


@attrs.frozen
class StatusSnapshot:
    """The coordinator's view of the ring, published to monitors a few times a second.

    ``seq`` counts snapshots since the coordinator started at ``started`` (wall clock; a new
    value means the coordinator restarted). ``ring`` is the node order from the coordinator
    round to the last stage; ``edges`` follow it, closing back at the coordinator. Rolling
    values cover the last laps of every request: ``lap_*`` are full laps (the ring's round
    trip), ``alpha`` is accepted / drafted (None before a draft was verified), ``tok_s``
    counts committed tokens over the last seconds. ``tokens``, ``requests_*`` are totals.
    ``devices``: GPU memory and utilisation (``shard.observe.devices``). ``ring_down``: why
    the ring serves nothing now (a block lost, what it waits for); ``repairing``: what the
    scheduler is repairing; each None when not.
    """

    swarm: str
    coordinator: NodeName
    seq: int
    at: float
    started: float
    ring: tuple[NodeName, ...]
    edges: tuple[EdgeStatus, ...]
    stages: tuple[StageStatus, ...]
    laps: int
    lap_last_s: float | None
    lap_median_s: float | None
    tokens_per_lap: float | None
    drafted: int
    accepted: int
    alpha: float | None
    k: int
    depth: int
    tok_s: float
    tokens: int
    sessions: int
    requests_done: int
    requests_failed: int
    standbys: tuple[NodeName, ...] = ()
    events: tuple[EventRecord, ...] = ()
    devices: tuple[DeviceStatus, ...] = ()  # the coordinator's GPUs (none without a driver)
    audit: AuditCounts = AuditCounts()  # spot checks (all zero in a swarm that does not audit)
    ring_down: str | None = None
    repairing: str | None = None


@attrs.frozen
class StatusReset:
    """Monitor -> coordinator: clear the rolling statistics (the monitor's reset binding).

    The only thing a monitor may ask; the coordinator logs it as a ``reset`` event.
    """

    node: NodeName


@attrs.frozen
class StageReport:
    """Stage -> monitor: one stage's executor counters, sent when they change.

    A monitor that dials a stage (``Hello`` role ``"monitor"``) reads these; tests use them to
    see, from outside the stage's process, that a session's KV was freed (``sessions``).
    """

    node: NodeName
    first: int
    last: int
    sessions: int
    chunks: int
    positions: int
    faults: int
