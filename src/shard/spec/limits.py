"""The ``[limits]`` table of a swarm spec: sizes and timeouts every node applies.

```toml
[limits]
max_sessions = 16          # concurrent sessions per node (each holds a KV cache)
max_len = 2048             # KV cache length per session, in positions
prefill_chunk = 128        # prompt positions per prefill chunk
max_message_mib = 64       # largest wire frame a node sends or accepts
max_buffer_mib = 256       # received bytes a node buffers, all connections together
max_connections = 256      # inbound connections a node serves at once
max_prompt_bytes = 262144  # a prompt's UTF-8 size, checked before tokenizing
connect_timeout_s = 10.0   # dialling a neighbour
handshake_timeout_s = 10.0 # Hello / Welcome on a fresh connection
verdict_timeout_s = 60.0   # a ring silent this long fails the request
retry_after_s = 10.0       # no verdict this long (no repair under way): re-send the chunk
max_resyncs = 8            # re-sends one request may need before it fails
receipt_timeout_s = 10.0   # gathering the stages' signed receipts after a request
idle_timeout_s = 300.0     # a client with no request running this long is cut (any
                           # connection with no message either way: 300 + message_timeout_s)
message_timeout_s = 30.0   # a client or monitor must take each message within this, and a
                           # message a peer began sending must arrive within it (+1 s/64 KiB)
max_peer_connections = 64  # connections a node holds open per remote host
reclaim_idle_s = 10.0      # at that cap, the host's connection idle longest (this long at
                           # least) is closed for the new one, else the new one is refused
max_batch_rows = 512       # rows (positions, all sessions) one stage forward may batch; 1: off
gather_window_s = 0.0      # a stage waits up to this for chunks of sessions it expects (0: never)
kv_budget_mib = 0          # KV cache a stage may hold, all sessions (0: max_sessions x max_len)
```

``Limits`` is what the actors take: the coordinator and each request's driver read it as is
(``shard.coordinator``), so a knob exists once, here, with its default.
"""

from __future__ import annotations

from typing import Final

import attrs

from shard.messages.ids import HANDSHAKE_TIMEOUT_S
from shard.spec.validate import Table


@attrs.frozen
class Limits:
    """Resource limits and timeouts every node of the swarm applies (``docs/specs.md``)."""

    max_sessions: int = 16
    max_len: int = 2048  # per-session KV cache length, in positions
    prefill_chunk: int = 128
    max_message_mib: int = 64  # cap on one decompressed wire message
    max_buffer_mib: int = 256  # cap on received bytes a node buffers, all connections together
    max_connections: int = 256  # concurrent inbound connections a node serves
    max_prompt_bytes: int = 256 * 1024  # a prompt's UTF-8 size, checked before tokenizing
    connect_timeout_s: float = 10.0
    verdict_timeout_s: float = 60.0  # a ring silent this long fails the request (a stalled node)
    retry_after_s: float = 10.0  # no verdict this long (ring not in repair): re-send the chunk
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # Hello -> Welcome on every new connection
    max_resyncs: int = 8  # re-sends one request may need (repaired ring, lost frames)
    receipt_timeout_s: float = 10.0  # the stages' receipts, after the last verdict
    idle_timeout_s: float = 300.0  # a client with no request running this long is cut
    message_timeout_s: float = 30.0  # a client or monitor must take each message within this
    max_peer_connections: int = 64  # connections a node holds open per remote host
    reclaim_idle_s: float = 10.0  # at that cap, an idle one this long makes room for a new one
    max_batch_rows: int = 512  # rows one stage forward may batch, all sessions together
    gather_window_s: float = 0.0  # longest wait for expected sessions' chunks (0: take what waits)
    kv_budget_mib: int = 0  # KV memory per stage, all sessions (0: no cap but the two above)


LIMIT_KEYS: Final = tuple(field.name for field in attrs.fields(Limits))


def read_limits(table: Table) -> Limits:
    """Validate ``[limits]`` (an absent table reads as the defaults)."""
    d = Limits()

    def seconds(name: str, default: float) -> float:
        return table.number(name, default=default, positive=True)

    limits = Limits(
        max_sessions=table.integer("max_sessions", default=d.max_sessions),
        max_len=table.integer("max_len", default=d.max_len),
        prefill_chunk=table.integer("prefill_chunk", default=d.prefill_chunk),
        max_message_mib=table.integer("max_message_mib", default=d.max_message_mib),
        max_buffer_mib=table.integer("max_buffer_mib", default=d.max_buffer_mib),
        max_connections=table.integer("max_connections", default=d.max_connections),
        max_prompt_bytes=table.integer("max_prompt_bytes", default=d.max_prompt_bytes),
        connect_timeout_s=seconds("connect_timeout_s", d.connect_timeout_s),
        verdict_timeout_s=seconds("verdict_timeout_s", d.verdict_timeout_s),
        retry_after_s=seconds("retry_after_s", d.retry_after_s),
        handshake_timeout_s=seconds("handshake_timeout_s", d.handshake_timeout_s),
        max_resyncs=table.integer("max_resyncs", default=d.max_resyncs, minimum=0),
        receipt_timeout_s=seconds("receipt_timeout_s", d.receipt_timeout_s),
        idle_timeout_s=seconds("idle_timeout_s", d.idle_timeout_s),
        message_timeout_s=seconds("message_timeout_s", d.message_timeout_s),
        max_peer_connections=table.integer("max_peer_connections", default=d.max_peer_connections),
        reclaim_idle_s=seconds("reclaim_idle_s", d.reclaim_idle_s),
        max_batch_rows=table.integer("max_batch_rows", default=d.max_batch_rows),
        gather_window_s=table.number("gather_window_s", default=d.gather_window_s),
        kv_budget_mib=table.integer("kv_budget_mib", default=d.kv_budget_mib, minimum=0),
    )
    if limits.prefill_chunk > limits.max_len:
        raise table.error(
            "prefill_chunk",
            f"{limits.prefill_chunk} exceeds max_len = {limits.max_len}; lower it or raise max_len",
        )
    if limits.max_buffer_mib < 2 * limits.max_message_mib:
        raise table.error(
            "max_buffer_mib",
            f"{limits.max_buffer_mib} is less than twice max_message_mib = "
            f"{limits.max_message_mib}: a node could not hold a message while reading the next",
        )
    return limits
