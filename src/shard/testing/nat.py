"""Test helpers for NAT-friendly edges (re-exported by ``shard.testing``; never imported by
production code — ``tests/test_import_boundaries.py`` enforces it).

- ``Firewall``: a path network that refuses every dial to some addresses, as a home router
  drops inbound connections: whatever reaches a node behind it must come out of that node.
  In one process it stands for ``reachable = false`` (the real thing, network namespaces
  behind a MASQUERADE router, is ``tests/test_nat_procs.py``).
- ``TamperingHub``: a relay that flips one bit of one message it carries (and records the
  first byte of every message), to show that the ring rejects what a relay altered and that
  a relay on the sealed wire only ever carries sealed records.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection

import trio

from shard.transport.base import Connection, Handler, NetworkBase, TransportError
from shard.transport.paths import Item, PathNetwork, Router
from shard.transport.relayhub import RelayHub

__all__ = ["SEALED_RECORD", "WIRE_FRAME", "Firewall", "TamperingHub"]

log = logging.getLogger("shard.testing")

#: First byte of a sealed record (``shard.trust.sealer``) and of a plaintext wire frame.
SEALED_RECORD = 0x81
WIRE_FRAME = 0x01


class Firewall(NetworkBase):
    """``inner`` (shared by every node of an in-process swarm) with dials to ``closed``
    addresses refused (``TransportError``); ``refused`` lists the addresses tried."""

    def __init__(self, inner: PathNetwork, closed: Collection[str]) -> None:
        self._inner = inner
        self._closed = frozenset(closed)
        self.refused: list[str] = []

    def _check(self, address: str) -> None:
        if address in self._closed:
            self.refused.append(address)
            raise TransportError(f"{address}: no route (it accepts no inbound connection)")

    async def dial(self, address: str) -> Connection:
        self._check(address)
        return await self._inner.dial(address)

    async def dial_path(self, address: str, path: str, *, dialer: bool) -> Connection:
        self._check(address)
        return await self._inner.dial_path(address, path, dialer=dialer)

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self._inner.serve(address, handler, task_status=task_status)

    async def serve_paths(
        self,
        address: str,
        handler: Handler,
        router: Router,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self._inner.serve_paths(address, handler, router, task_status=task_status)


class TamperingHub(RelayHub):
    """A relay that flips the lowest bit of the last byte of a message it carries: the first
    one, in either direction, that is message ``at`` or later of its direction and at least
    ``min_bytes`` long, ``times`` times in all (0: never; it then only watches).

    ``first_bytes`` counts the first byte of every binary message carried; a plaintext wire
    frame (first byte ``WIRE_FRAME``) is logged (the first time), so a test of a process can
    tell from the log whether the relay could have read the ring's frames."""

    def __init__(
        self, *args: object, at: int = 0, min_bytes: int = 0, times: int = 1, **kw: object
    ) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.at = at
        self.min_bytes = min_bytes
        self.times = times
        self.first_bytes: Counter[int] = Counter()
        self.tampered = 0

    def carry(self, item: Item, way: int, n: int) -> Item:
        if not isinstance(item, bytes | bytearray) or not item:
            return item
        self.first_bytes[item[0]] += 1
        if item[0] == WIRE_FRAME and self.first_bytes[WIRE_FRAME] == 1:
            log.warning("watching relay: carried a plaintext wire frame (0x01): readable here")
        if self.tampered >= self.times or n < self.at or len(item) < self.min_bytes:
            return item
        self.tampered += 1
        log.warning(
            "tampering relay: flipped a bit of message %d of direction %d (%d bytes, first "
            "byte 0x%02x)",
            n,
            way,
            len(item),
            item[0],
        )
        return bytes(item[:-1]) + bytes([item[-1] ^ 1])
