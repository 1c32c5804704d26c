"""The connections a WebSocket server holds from each remote host (``WebSocketNetwork``'s
``max_peer_connections``): at most the cap open (or in their handshakes) from one host, and
at the cap, room made for a new one by closing the one idle longest, when it has been idle for
at least ``reclaim_idle_s`` (``PeerDeadlines``) — so an honest client is served beside an idle
flood from its own address. A new connection with no room is refused, with the reason.

"Idle" is ``Activity``'s: on a client link, no request running since the last one ended,
however many heartbeats (or other messages that start no request) it sends — a flood of
heartbeating client links is reclaimed like a silent one. Why evict the idle-longest and not
refuse the newcomer: refusing lets whoever fills the cap first hold it (an honest client on a
shared or NATed address is locked out until ``idle_timeout_s``), while evicting takes only a
connection that has done nothing for ``reclaim_idle_s`` and is doing nothing now — a
connection with a request running is never evicted, and one just opened gets
``reclaim_idle_s`` to send its first request. The cost: an honest client that keeps a link
open between requests can lose it to a newcomer from its own host while its host is at the
cap; it reconnects (the wire client dials per request). Links whose use is messages (ring,
return, control, monitor) stay busy while they heartbeat: they are nobody's to evict.
"""

from __future__ import annotations

import logging

import attrs
import trio

from shard.transport.guard import Activity, PeerDeadlines

log = logging.getLogger("shard.transport")


@attrs.define(eq=False)
class Held:
    """One served connection from a host: its activity, and the scope that cuts it."""

    activity: Activity
    scope: trio.CancelScope
    reclaimed: bool = False


class PerHost:
    """Served connections by remote host, capped at ``cap`` each (None: no cap); with
    ``deadlines``, an idle one is reclaimed to make room (None: nothing is)."""

    def __init__(self, cap: int | None, deadlines: PeerDeadlines | None) -> None:
        self._cap = cap
        self._deadlines = deadlines
        self._hosts: dict[str, list[Held]] = {}  # remote host -> connections open or opening
        self.reclaimed = 0  # idle connections closed to make room under a host's cap

    def admit(self, host: str, peer: str) -> Held | str:
        """Hold a new connection from ``peer`` (at ``host``), making room if its host is at
        the cap: its ``Held`` (give it back with ``release``), or why it is refused (logged)."""
        cap = self._cap
        held = self._hosts.setdefault(host, [])
        full = cap is not None and sum(not h.reclaimed for h in held) >= cap
        if full and not self._reclaim(held, peer):
            reason = (
                f"too many connections from {host}: at most {cap} at once "
                "(limits.max_peer_connections), none of them idle; close some and retry"
            )
            log.warning("refused %s: %s", peer, reason)
            if not held:
                del self._hosts[host]
            return reason
        mine = Held(Activity(), trio.CancelScope())
        held.append(mine)
        return mine

    def release(self, host: str, mine: Held) -> None:
        """``mine``, from ``host``, is closed."""
        held = self._hosts[host]
        held.remove(mine)
        if not held:
            del self._hosts[host]

    def _reclaim(self, held: list[Held], peer: str) -> bool:
        """Close the connection of ``held`` idle longest, if one is idle for at least
        ``reclaim_idle_s``, to make room for ``peer``; whether one was."""
        if self._deadlines is None:
            return False
        now = trio.current_time()
        idle = [h for h in held if not h.reclaimed]
        oldest = max(idle, key=lambda h: h.activity.idle_for(now), default=None)
        if oldest is None or oldest.activity.idle_for(now) < self._deadlines.reclaim_idle_s:
            return False
        log.warning(
            "closed a connection idle for %.0f s to make room for %s (its host is at "
            "limits.max_peer_connections)",
            oldest.activity.idle_for(now),
            peer,
        )
        oldest.reclaimed = True
        oldest.scope.cancel()
        self.reclaimed += 1
        return True


__all__ = ["Held", "PerHost"]
