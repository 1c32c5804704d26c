"""``GET /metrics``: the API's and the ring's counters in Prometheus text format (0.0.4).

``ApiCounters`` is what the app counts itself (requests by endpoint and status, tokens in and
out, sessions in flight); ``render`` adds the coordinator's view of the ring (tok/s,
acceptance, lap time, sessions, failovers). Pure: plain values in, text out.
"""

from __future__ import annotations

import math
from collections import Counter

import attrs

from shard.coordinator.coordinator import CoordinatorStatistics


@attrs.define
class ApiCounters:
    """Counters since the API started."""

    requests: Counter[tuple[str, int]] = attrs.field(factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    rejected_busy: int = 0
    disconnects: int = 0

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1


def _number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _metric(out: list[str], name: str, kind: str, help_text: str, value: float | None) -> None:
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]


def render(
    counters: ApiCounters,
    ring: CoordinatorStatistics,
    *,
    max_sessions: int,
    ready: bool,
    failovers: int,
) -> str:
    """The whole exposition, one metric family after another."""
    out = [
        "# HELP shard_api_requests_total HTTP requests answered, by endpoint and status.",
        "# TYPE shard_api_requests_total counter",
    ]
    for (endpoint, status), n in sorted(counters.requests.items()):
        out.append(f'shard_api_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
    out += [
        "# HELP shard_api_tokens_total Tokens of API requests, by kind.",
        "# TYPE shard_api_tokens_total counter",
        f'shard_api_tokens_total{{kind="prompt"}} {counters.prompt_tokens}',
        f'shard_api_tokens_total{{kind="completion"}} {counters.completion_tokens}',
    ]
    rolling = ring.ring
    families: list[tuple[str, str, str, float | None]] = [
        ("shard_api_sessions_in_flight", "gauge", "API requests running now.", counters.in_flight),
        ("shard_api_sessions_max", "gauge", "API requests admitted at once.", max_sessions),
        ("shard_api_rejected_busy_total", "counter", "429s.", counters.rejected_busy),
        ("shard_api_disconnects_total", "counter", "Clients gone mid-reply.", counters.disconnects),
        ("shard_ring_ready", "gauge", "1 when the ring takes requests.", 1 if ready else 0),
        ("shard_ring_sessions_open", "gauge", "Sessions on the ring.", ring.sessions_open),
        ("shard_requests_done_total", "counter", "Requests finished.", ring.requests_done),
        ("shard_requests_failed_total", "counter", "Requests failed.", ring.requests_failed),
        ("shard_tokens_total", "counter", "Tokens committed.", ring.tokens),
        ("shard_tok_s", "gauge", "Committed tokens per second (rolling).", rolling.tok_s),
        ("shard_acceptance", "gauge", "Accepted / drafted tokens (rolling).", rolling.alpha),
        ("shard_lap_seconds", "gauge", "Median ring lap (rolling).", rolling.lap_median_s),
        ("shard_lap_last_seconds", "gauge", "Last ring lap.", rolling.lap_last_s),
        ("shard_tokens_per_lap", "gauge", "Tokens committed per lap.", rolling.tokens_per_lap),
        ("shard_draft_k", "gauge", "Drafted tokens per chunk now.", ring.k),
        ("shard_depth", "gauge", "Verify chunks in flight now.", ring.depth),
        ("shard_failovers_total", "counter", "Ring repairs (splices).", failovers),
    ]
    for name, kind, help_text, value in families:
        _metric(out, name, kind, help_text, value)
    return "\n".join(out) + "\n"
