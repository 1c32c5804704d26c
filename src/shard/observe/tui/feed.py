"""The Trio side of the monitor: follow a coordinator's status feed, reconnecting forever.

``FeedWatcher.run(address)`` dials the coordinator as role ``"monitor"`` (the same
``Hello``/``Welcome`` handshake as every peer, so it is authenticated like them once the wire
is), then reports every ``StatusSnapshot`` to ``post``. When the connection fails or the
coordinator goes away it reports ``FeedLost`` and dials again after a pause that grows to
``retry_max_s``; a restarted coordinator is picked up by the next dial. ``request_reset``
makes the live connection send one ``StatusReset``.

``post`` is called from Trio code; the guest-mode bridge (``shard.observe.tui.guest``) runs that
code
on the app's own thread, so ``post`` may touch the app directly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from shard.messages import Hello, NodeName, StatusReset, StatusSnapshot
from shard.observe.tui.state import FeedDialing, FeedEvent, FeedLost
from shard.transport import Connection, Network, TransportError
from shard.transport.links import HandshakeError, dial_peer
from shard.wire import WireError

log = logging.getLogger(__name__)

Post = Callable[[FeedEvent], None]


class FeedWatcher:
    """Follows one coordinator's status feed over ``network`` (opened by the caller).

    Cancellation: cancelling ``run`` closes the feed connection; nothing else is left behind.

    Errors: none of the network's: a refused dial, a failed handshake, a lost connection or a
    malformed frame becomes a ``FeedLost`` (with the reason) and another dial. Bugs propagate.
    """

    def __init__(
        self,
        network: Network,
        *,
        swarm: str,
        post: Post,
        node: str = "monitor",
        dial_timeout_s: float = 5.0,
        retry_s: float = 0.25,
        retry_max_s: float = 4.0,
    ) -> None:
        self._network = network
        self._post = post
        self._hello = Hello(node=NodeName(node), role="monitor", swarm=swarm)
        self._dial_timeout_s = dial_timeout_s
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self._reset = trio.Event()

    def request_reset(self) -> None:
        """Ask the coordinator to clear its rolling statistics (dropped while disconnected).

        Call from the Trio thread (the bridge's ``call_soon``)."""
        self._reset.set()

    async def run(self, address: str) -> None:
        attempt = 0
        pause = self._retry_s
        while True:
            attempt += 1
            self._post(FeedDialing(address, attempt))
            try:
                conn = await dial_peer(
                    self._network, address, self._hello, timeout_s=self._dial_timeout_s
                )
            except (TransportError, HandshakeError) as exc:
                self._post(FeedLost(str(exc)))
            else:
                attempt, pause = 0, self._retry_s
                try:
                    reason = await self._follow(conn)
                finally:
                    with trio.CancelScope(shield=True):
                        await conn.aclose()
                self._post(FeedLost(reason))
            await trio.sleep(pause)  # a retry back-off, not a wait for state
            pause = min(pause * 2, self._retry_max_s)

    async def _follow(self, conn: Connection) -> str:
        """Report snapshots until the connection ends; returns why it ended."""
        self._reset = trio.Event()  # a reset asked for while disconnected is not replayed
        reason = "connection closed"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_resets, conn)
            try:
                while True:
                    msg = await conn.receive()
                    if not isinstance(msg, StatusSnapshot):
                        reason = f"{conn.peer} sent {type(msg).__name__}, not a status snapshot"
                        break
                    self._post(msg)
            except (TransportError, WireError) as exc:
                reason = str(exc)
            nursery.cancel_scope.cancel()
        return reason

    async def _send_resets(self, conn: Connection) -> None:
        while True:
            await self._reset.wait()
            self._reset = trio.Event()
            try:
                await conn.send(StatusReset(node=self._hello.node))
            except TransportError as exc:
                log.info("reset not sent to %s: %s", conn.peer, exc)
                return
