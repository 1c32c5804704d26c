"""A node's budget for received message bytes, shared by all its WebSocket connections.

trio-websocket caps one message (``max_message_size``) but not how many a node holds: each
connection may have one message queued, one being assembled and one being decoded, so eight
peers sending 63 MiB each cost the node 1.5 GiB. Here every connection reads through a
``BudgetedStream`` that parses WebSocket frame headers as the bytes arrive and, before
handing a data frame's first bytes to trio-websocket, takes the frame's whole payload from
the node's ``ByteBudget`` (waiting, and so not reading that socket, while the budget is
spent). The bytes go back when the application takes the message (``take_message``) or
the connection ends (``release_all``).

The bound: message bytes held by a node <= ``ByteBudget.total``, plus at most one receive
chunk (64 KiB) and a frame header per connection outside it, plus the transient copy
trio-websocket makes when it joins a message's parts. Taking a frame whole (never part of
it) means two honest large messages cannot each hold half the budget and wait forever for
the rest. Control frames (ping, pong, close: at most 125 bytes each) and the HTTP upgrade
are not counted.

The same parse tells when a message is in progress: ``message_since`` is when the first byte
of a frame arrived with no message under way, until that message's last frame ended (a
fragmented message, and control frames inside it, count as one), and ``message_bytes`` how
much of it has arrived — what a listening network's trickle deadline reads
(``shard.transport.guard.PeerDeadlines``). While a whole message waits for the application
(``behind``) nothing is read, so that time is never the peer's.
"""

from __future__ import annotations

import collections
import struct

import attrs
import trio

_DATA_OPCODES = frozenset({0x0, 0x1, 0x2})  # continuation, text, binary
_END_OF_HEADERS = b"\r\n\r\n"


@attrs.frozen
class BudgetStatistics:
    """``used`` bytes are held now; ``peak`` is the most ever held; ``waits`` counts reads
    that had to wait for budget (a sign of a flood or a slow consumer)."""

    total: int
    used: int
    peak: int
    waits: int


class ByteBudget:
    """``total`` bytes shared by every connection of one node (see the module docstring)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a byte budget must be positive, got {total}")
        self.total = total
        self._used = 0
        self._peak = 0
        self._waits = 0
        self._freed = trio.lowlevel.ParkingLot()

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(self.total, self._used, self._peak, self._waits)

    async def acquire(self, n: int) -> None:
        """Take ``n`` bytes (``n <= total``), waiting until that many are free."""
        if n > self.total:
            raise ValueError(f"cannot take {n} bytes from a budget of {self.total}")
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._used + n > self.total:
            self._waits += 1
            while self._used + n > self.total:
                await self._freed.park()
        self._used += n
        self._peak = max(self._peak, self._used)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def release(self, n: int) -> None:
        self._used -= n
        assert self._used >= 0, "released more bytes than were taken"
        self._freed.unpark_all()


class BudgetedStream(trio.abc.Stream):
    """A stream that takes each received WebSocket data frame's payload from ``budget``
    before passing the frame on; ``max_message`` caps what one message may take (past it
    trio-websocket closes the connection with 1009 anyway)."""

    def __init__(self, inner: trio.abc.Stream, budget: ByteBudget, *, max_message: int) -> None:
        if max_message > budget.total:
            raise ValueError(f"max_message {max_message} exceeds the byte budget {budget.total}")
        self._inner = inner
        self._budget = budget
        self._max_message = max_message
        self._in_http = True  # the HTTP upgrade comes before any frame
        self._http_tail = b""
        self._header = bytearray()  # a frame header read in part
        self._remaining = 0  # payload bytes of the current frame not yet read
        self._data_frame = False
        self._final = False
        self._message = 0  # bytes taken for the message being received
        self._complete: collections.deque[int] = collections.deque()  # taken, not yet released
        self._held = 0
        self._fragmented = False  # a data frame without FIN ended: its message goes on
        #: When the message now arriving began (None: between messages), and its bytes so far.
        self.message_since: float | None = None
        self.message_bytes = 0
        self._message_started = trio.lowlevel.ParkingLot()

    @property
    def held(self) -> int:
        """Bytes this connection holds of the budget now."""
        return self._held

    @property
    def behind(self) -> bool:
        """Whether a whole message waits for the application: the socket is then not read
        (trio-websocket's queue is full), so a message in progress is not the peer's delay."""
        return bool(self._complete)

    async def wait_message_start(self) -> None:
        """Wait until the next message begins to arrive, or the application takes one."""
        await self._message_started.park()

    def take_message(self) -> None:
        """The application took the oldest complete message: give its bytes back (and, caught
        up, start the clock of a message in progress afresh: it was not read meanwhile)."""
        if self._complete:
            self._give_back(self._complete.popleft())
            if not self._complete and self.message_since is not None:
                self.message_since = trio.current_time()
            self._message_started.unpark_all()

    def release_all(self) -> None:
        """The connection ended: give back everything it holds."""
        self._complete.clear()
        self._message = 0
        self._give_back(self._held)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._inner.receive_some(max_bytes)
        await self._account(data)
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def _give_back(self, n: int) -> None:
        if n:
            self._held -= n
            self._budget.release(n)

    async def _account(self, data: bytes | bytearray) -> None:
        at = self._skip_http(data) if self._in_http else 0
        self.message_bytes += len(data) - at
        while at < len(data):
            if self._remaining:
                step = min(self._remaining, len(data) - at)
                at += step
                self._remaining -= step
                if not self._remaining:
                    self._end_frame()
                continue
            if not self._header and self.message_since is None:  # a message's first byte
                self.message_since = trio.current_time()
                self.message_bytes = len(data) - at
                self._message_started.unpark_all()
            at = self._read_header(data, at)
            if self._header_length() == len(self._header):
                await self._start_frame()

    def _skip_http(self, data: bytes | bytearray) -> int:
        """Where the frames start in ``data`` (``len(data)``: still in the HTTP upgrade)."""
        seen = self._http_tail + bytes(data)
        end = seen.find(_END_OF_HEADERS)
        if end < 0:
            self._http_tail = seen[-3:]
            return len(data)
        self._in_http = False
        return end + len(_END_OF_HEADERS) - len(self._http_tail)

    def _header_length(self) -> int:
        """Bytes of the frame header being read (2 until its first two bytes are in)."""
        if len(self._header) < 2:
            return 2
        length7 = self._header[1] & 0x7F
        extended = 2 if length7 == 126 else 8 if length7 == 127 else 0
        mask = 4 if self._header[1] & 0x80 else 0
        return 2 + extended + mask

    def _read_header(self, data: bytes | bytearray, at: int) -> int:
        while at < len(data) and len(self._header) < self._header_length():
            need = self._header_length() - len(self._header)
            self._header += data[at : at + need]
            at += min(need, len(data) - at)
        return at

    async def _start_frame(self) -> None:
        first, second = self._header[0], self._header[1]
        length7 = second & 0x7F
        if length7 == 126:
            (length,) = struct.unpack_from(">H", self._header, 2)
        elif length7 == 127:
            (length,) = struct.unpack_from(">Q", self._header, 2)
        else:
            length = length7
        self._header.clear()
        self._final = bool(first & 0x80)
        self._data_frame = first & 0x0F in _DATA_OPCODES
        self._remaining = length
        if self._data_frame:
            grant = min(length, max(0, self._max_message - self._message))
            asked = trio.current_time()
            await self._budget.acquire(grant)
            if self.message_since is not None:  # waiting on this node is not the peer's delay
                self.message_since += trio.current_time() - asked
            self._message += grant
            self._held += grant
        if not self._remaining:
            self._end_frame()

    def _end_frame(self) -> None:
        if self._data_frame:
            self._fragmented = not self._final
        if self._data_frame and self._final:
            self._complete.append(self._message)
            self._message = 0
        self._data_frame = False
        if not self._fragmented:
            self.message_since = None
