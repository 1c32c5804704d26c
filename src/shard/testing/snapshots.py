"""Fixed status data for monitor tests, snapshot tests and demos (public, like
``shard.testing``): a three-stage ring with believable numbers, and a way to vary them.

No clock, no randomness: the same arguments give the same snapshot.
"""

from __future__ import annotations

from shard.messages import EdgeStatus, EventRecord, NodeName, StageStatus, StatusSnapshot

#: 2025-01-01 12:00:00 UTC: fixed, so times render the same everywhere (with ``tz=UTC``).
T0 = 1_735_732_800.0


def sample_snapshot(
    *,
    seq: int = 1,
    tok_s: float = 41.5,
    alpha: float | None = 0.75,
    started: float = T0,
    scale: float = 1.0,
    events: tuple[EventRecord, ...] | None = None,
) -> StatusSnapshot:
    """A snapshot of swarm "local": coord -> s0 -> s1 -> s2 -> coord, K=4, D=2.

    ``scale`` multiplies every duration, to tell two snapshots apart on screen.
    """
    names = [NodeName(n) for n in ("coord", "s0", "s1", "s2")]
    transit = (0.0004, 0.0021, 0.0018, 0.0009)
    compute = (0.0112, 0.0105, 0.0131)
    edges = tuple(
        EdgeStatus(src, dst, last_s=t * scale, median_s=t * scale * 0.9)
        for (src, dst), t in zip(
            zip(names, [*names[1:], names[0]], strict=True), transit, strict=True
        )
    )
    stages = tuple(
        StageStatus(
            name,
            compute_last_s=c * scale,
            compute_median_s=c * scale * 0.95,
            chunks=64,
            queued_median_s=c * scale * 0.2 if i else None,
            batch_rows_median=4.0 + i if i else None,
            forwards_per_s=60.0 / (1 + i) if i else None,
        )
        for i, (name, c) in enumerate(zip(names[1:], compute, strict=True))
    )
    if events is None:
        events = (
            EventRecord(T0 + 1, "join", "s2 (stage) connected from 127.0.0.1:40122"),
            EventRecord(T0 + 95, "fault", "s1: oom: session 7 needs 4096 positions"),
            EventRecord(T0 + 96, "epoch", "session 9: epoch 3 after a rejected draft"),
        )
    return StatusSnapshot(
        swarm="local",
        coordinator=NodeName("coord"),
        seq=seq,
        at=T0 + 120 + seq,
        started=started,
        ring=tuple(names),
        edges=edges,
        stages=stages,
        laps=812 + seq,
        lap_last_s=0.0412 * scale,
        lap_median_s=0.0398 * scale,
        tokens_per_lap=3.1,
        drafted=1024,
        accepted=768,
        alpha=alpha,
        k=4,
        depth=2,
        tok_s=tok_s,
        tokens=2519,
        sessions=2,
        requests_done=14,
        requests_failed=1,
        events=events,
    )
