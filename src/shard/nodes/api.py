"""The coordinator's HTTP API, composed from the spec: its ``ApiConfig`` from ``[api]`` and
``[limits]``, its keys read from ``[api] keys_file``, and the ``ApiServer`` that serves it.

Built here, not in ``shard.api``, so that the API takes the one record made for it and never
the whole ``SwarmSpec``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from shard.api.app import ApiApp, ApiConfig
from shard.api.keys import ApiKeys
from shard.api.server import ApiServer
from shard.coordinator.checkpoint import CheckpointStore
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.text import TextAdapter
from shard.nodes.launcher import api_listen_error
from shard.spec.swarm import SwarmSpec
from shard.spec.swarm_table import BUNDLED_MODELS


def model_id(spec: SwarmSpec) -> str:
    """The id clients name: ``[api] model_name``, else the bundled name or the model's
    directory (or .gguf file) name."""
    if spec.api.model_name is not None:
        return spec.api.model_name
    return spec.model if spec.model in BUNDLED_MODELS else Path(spec.model).stem


def api_config(spec: SwarmSpec) -> ApiConfig:
    """The API's record from ``spec``'s ``[api]`` and ``[limits]``.

    Errors: ``KeyFileError`` when the keys file is missing or malformed."""
    api = spec.api
    keys = ApiKeys.from_file(api.keys_file) if api.keys_file is not None else None
    return ApiConfig(
        model_id=model_id(spec),
        max_len=spec.limits.max_len,
        max_sessions=api.max_sessions,
        max_body_bytes=api.max_body_kib * 1024,
        body_timeout_s=api.body_timeout_s,
        keys=keys,
        max_prompt_bytes=spec.limits.max_prompt_bytes,
    )


def make_server(
    spec: SwarmSpec,
    coordinator: Coordinator,
    text: TextAdapter,
    *,
    failovers: Callable[[], int] = lambda: 0,
    checkpoints: CheckpointStore | None = None,
) -> ApiServer | None:
    """The API server ``spec``'s ``[api]`` asks for (None when ``listen`` is not set);
    ``checkpoints``: the coordinator's, which makes its streams resumable (``.resume``).

    Errors: ``KeyFileError`` when the keys file is missing or malformed."""
    if spec.api.listen is None:
        return None
    app = ApiApp(coordinator, text, api_config(spec), failovers=failovers, checkpoints=checkpoints)
    return ApiServer(app, str(spec.api.listen))


async def serve_api(nursery: trio.Nursery, api: ApiServer, listen: str) -> str:
    """Start the HTTP API at ``listen``; its bound ``http://HOST:PORT``.

    Errors: ``ListenError`` in one line when ``listen`` (``--api``, ``[api] listen``) cannot
    be bound — the server's own error is a nest of exception groups around an ``OSError``."""
    try:
        bound: str = await nursery.start(api.run)
    except (OSError, BaseExceptionGroup) as exc:
        cause = _bind_error(exc)
        if cause is None:
            raise
        raise api_listen_error(listen, cause) from None
    return bound


def _bind_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` inside ``exc`` (a group's leaves included), if any."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((e for e in map(_bind_error, exc.exceptions) if e is not None), None)
    return None
