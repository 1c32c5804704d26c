"""The ASGI plumbing under ``shard.api.app``: one request's response side, its head's size,
its headers, and the lifespan protocol.

``Reply.finishing`` is set before the last body message goes out, because that message is
where hypercorn ends the stream — and, on a ``Connection: close`` request, closes the socket —
inside the app's own ``send`` call; the stream's end also posts ``http.disconnect`` to the
app, which must not be taken for a client that went away (its cancellation would cut that
close short and leave the connection open).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from shard.api import responses

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Largest request head (request line plus headers) the API takes (docs/api.md); hypercorn
#: refuses a larger head that arrives in pieces, ``head_bytes`` one that arrived at once.
MAX_HEAD_BYTES = 16 * 1024


def header(scope: Scope, name: bytes) -> str:
    """The value of header ``name`` (lower case), or ""."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1").strip()
    return ""


def head_bytes(scope: Scope) -> int:
    """The size of the request's head as HTTP/1.1 sends it: ``METHOD SP target SP
    HTTP/1.1 CRLF``, ``name: value CRLF`` per header, and the blank line."""
    target = len(scope.get("raw_path") or scope.get("path", "").encode())
    query = scope.get("query_string", b"")
    if query:
        target += 1 + len(query)
    line = len(scope.get("method", "")) + 1 + target + len(" HTTP/1.1\r\n")
    fields = sum(len(k) + 2 + len(v) + 2 for k, v in scope.get("headers", ()))
    return line + fields + 2


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class Reply:
    """The response side of one request: whole responses or a stream of events."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finishing = False  # the last body message is going out (see the module doc)
        self.status = 0

    async def raw(
        self, status: int, body: bytes, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        await self._start(status, (*headers, ("content-length", str(len(body)))))
        self.finishing = True
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def json(
        self, status: int, body: dict[str, Any], headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        await self.raw(status, data, (("content-type", "application/json"), *headers))

    async def start_events(self, extra: tuple[tuple[str, str], ...] = ()) -> None:
        headers = (
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
            ("x-accel-buffering", "no"),
            *extra,
        )
        await self._start(200, headers)

    async def event(self, event: dict[str, Any] | str, *, last: bool = False) -> None:
        self.finishing = self.finishing or last
        body = {"type": "http.response.body", "body": responses.sse(event), "more_body": not last}
        await self._send(body)

    async def _start(self, status: int, headers: tuple[tuple[str, str], ...]) -> None:
        self.started, self.status = True, status
        encoded = [(k.encode(), v.encode()) for k, v in headers]
        await self._send({"type": "http.response.start", "status": status, "headers": encoded})
