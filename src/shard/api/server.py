"""Serve an ``ApiApp`` over HTTP with hypercorn's Trio worker, as a startable actor.

Hypercorn does the HTTP (HTTP/1.1 through h11, HTTP/2 through h2): malformed requests, a
request head over ``MAX_HEAD_BYTES`` still arriving (``h11_max_incomplete_size``: 431) and
idle or slow-header connections (``keep_alive_timeout``) are its business, answered or closed
per connection; a head over the limit that arrived whole is the app's (431), as is a slow body
(``body_timeout_s``: 408). ``Connection: close`` closes the connection after the response.
Nothing a client sends can end the server.
"""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from shard.api.app import ApiApp
from shard.api.reply import MAX_HEAD_BYTES

log = logging.getLogger(__name__)


def _config(listen: str) -> Config:
    config = Config()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("shard.api.http")
    config.include_server_header = False
    config.h11_max_incomplete_size = MAX_HEAD_BYTES
    config.keep_alive_timeout = 5.0
    config.graceful_timeout = 1.0
    return config


class ApiServer:
    """Serves ``app`` at ``listen`` (``host:port``; port 0 picks a free one).

    ``run`` reports the bound ``http://host:port`` once it accepts connections.

    Cancellation: cancelling ``run`` closes the listener and every connection (streams in
    flight end, and with them their ring sessions). Errors: ``OSError`` when the address
    cannot be bound.
    """

    def __init__(self, app: ApiApp, listen: str) -> None:
        self._app = app
        self._listen = listen

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                lambda task_status: serve(
                    self._app,  # type: ignore[arg-type]
                    _config(self._listen),
                    mode="asgi",
                    task_status=task_status,
                )
            )
            log.info("API listening on %s", binds[0])
            task_status.started(binds[0])
