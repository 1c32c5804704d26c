"""What the monitor knows, as a pure fold: ``apply(state, event, now) -> state``.

Feed events come from the Trio side (``shard.observe.tui.feed``) or a test's script; the app renders
whatever state results. No I/O, no clock reads (``now`` is passed in), no Textual: tiny
synchronous tests cover every transition.

The event log merges the coordinator's events (deduplicated across snapshots, kept across
coordinator restarts) with the monitor's own notes (feed lost, coordinator restarted, reset),
in time order (two clocks: the coordinator's and the monitor's; one host, or NTP-synced),
capped at ``LOG_KEPT``.
"""

from __future__ import annotations

import attrs

from shard.messages import DeviceStatus, EventRecord, StatusSnapshot

#: Points kept for each sparkline (at 4 snapshots a second: the last 30 seconds).
HISTORY = 120
LOG_KEPT = 200
#: What an unknown value looks like on screen.
UNKNOWN = "–"


@attrs.frozen
class FeedDialing:
    """The feed client is dialing the coordinator (``attempt`` counts since the last success)."""

    address: str
    attempt: int


@attrs.frozen
class FeedLost:
    """The feed connection failed or was lost; the client retries after a pause."""

    reason: str


@attrs.frozen
class FeedNote:
    """Something the monitor's side has to say (e.g. "starting the swarm")."""

    text: str


FeedEvent = FeedDialing | FeedLost | FeedNote | StatusSnapshot


@attrs.frozen
class MonitorState:
    """``link`` is "connecting", "live" or "reconnecting"; ``snapshot`` the latest one (kept
    while reconnecting, shown as stale); ``tok_s`` and ``alpha`` the sparkline histories."""

    link: str = "connecting"
    address: str = ""
    attempt: int = 0
    reason: str = ""
    snapshot: StatusSnapshot | None = None
    tok_s: tuple[float, ...] = ()
    alpha: tuple[float, ...] = ()
    log: tuple[EventRecord, ...] = ()


def _note(state: MonitorState, now: float, text: str) -> tuple[EventRecord, ...]:
    return (*state.log, EventRecord(now, "monitor", text))[-LOG_KEPT:]


def apply(state: MonitorState, event: FeedEvent, now: float) -> MonitorState:
    """The state after ``event``, observed at ``now`` (the monitor's wall clock)."""
    if isinstance(event, FeedDialing):
        link = "reconnecting" if state.snapshot is not None else "connecting"
        return attrs.evolve(state, link=link, address=event.address, attempt=event.attempt)
    if isinstance(event, FeedLost):
        if state.link == "live":
            log = _note(state, now, f"feed lost: {event.reason}; reconnecting")
            return attrs.evolve(state, link="reconnecting", reason=event.reason, log=log)
        return attrs.evolve(state, reason=event.reason)
    if isinstance(event, FeedNote):
        return attrs.evolve(state, log=_note(state, now, event.text))
    return _snapshot(state, event, now)


def _snapshot(state: MonitorState, snap: StatusSnapshot, now: float) -> MonitorState:
    log = state.log
    previous = state.snapshot
    if previous is not None and previous.started != snap.started:
        log = _note(state, now, f"coordinator {snap.coordinator} restarted")
    elif state.link != "live" and previous is not None:
        log = _note(state, now, "feed restored")
    seen = set(log)
    fresh = [e for e in snap.events if e not in seen]
    if fresh:  # in time order, whoever's clock: the coordinator's events and our notes
        log = tuple(sorted((*log, *fresh), key=lambda e: e.at))[-LOG_KEPT:]
    alpha = state.alpha if snap.alpha is None else (*state.alpha, snap.alpha)[-HISTORY:]
    return attrs.evolve(
        state,
        link="live",
        attempt=0,
        reason="",
        snapshot=snap,
        tok_s=(*state.tok_s, snap.tok_s)[-HISTORY:],
        alpha=alpha,
        log=log,
    )


def reset(state: MonitorState, now: float) -> MonitorState:
    """Clear the sparkline histories (the reset binding; the coordinator clears its own)."""
    log = _note(state, now, "rolling statistics reset requested")
    return attrs.evolve(state, tok_s=(), alpha=(), log=log)


# --- formatting (pure, shared by the app and its tests) --------------------------------------


def ms(seconds: float | None) -> str:
    """``0.01234`` -> ``"12.3"`` (milliseconds); None -> ``"–"``."""
    if seconds is None:
        return UNKNOWN
    value = seconds * 1000.0
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def ratio(value: float | None) -> str:
    """α and other ratios: two decimals; None -> ``"–"``."""
    return UNKNOWN if value is None else f"{value:.2f}"


def rate(value: float) -> str:
    """Tokens per second: one decimal."""
    return f"{value:.1f}"


def count(value: int | None) -> str:
    return UNKNOWN if value is None else str(value)


def number(value: float | None) -> str:
    """Rows per forward, forwards per second: one decimal; None -> ``"–"``."""
    return UNKNOWN if value is None else f"{value:.1f}"


def device(d: DeviceStatus) -> str:
    """``gpu0 coord NVIDIA H200  mem 12.3/139.8 GiB  util 45%`` (util ``–`` when unknown)."""
    gib = 1024**3
    util = UNKNOWN if d.utilization is None else f"{d.utilization}%"
    return (
        f"gpu{d.index} {d.node} {d.name}  mem {d.memory_used / gib:.1f}/"
        f"{d.memory_total / gib:.1f} GiB  util {util}"
    )
