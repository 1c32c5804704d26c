"""The ``[api]`` table of a swarm spec: the coordinator's OpenAI-compatible HTTP API.

```toml
[api]
listen = "127.0.0.1:8000"   # where the API and the chat page listen (absent: no API)
keys_file = "api-keys.txt"  # hashed bearer keys (`shard api-key`); absent: no key needed
max_sessions = 16           # requests in flight at once; beyond: 429 with Retry-After
model_name = "smollm2"      # the model id clients name (default: the spec's model)
max_body_kib = 1024         # largest request body; beyond: 413
body_timeout_s = 10.0       # a request body that takes longer to arrive: 408
```

The API listens on loopback unless told otherwise: ``shard up --api PORT`` binds
127.0.0.1, and a non-loopback ``listen`` needs ``keys_file`` (an open port that spends the
swarm's GPUs for anyone is a mistake worth one line of spec to make on purpose: ``public =
true``). Keys themselves never appear in a spec: ``keys_file`` holds their SHA-256 hashes.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Final

import attrs

from shard.spec.nodes import Address
from shard.spec.trust import resolve_path
from shard.spec.validate import SpecError, Table

API_KEYS: Final = (
    "listen",
    "keys_file",
    "max_sessions",
    "model_name",
    "max_body_kib",
    "body_timeout_s",
    "public",
)
LOOPBACK: Final = "127.0.0.1"


@attrs.frozen
class ApiSpec:
    """Typed ``[api]``: ``listen`` None means the API is off (``--api`` may turn it on)."""

    listen: Address | None = None
    keys_file: Path | None = None
    max_sessions: int = 16
    model_name: str | None = None
    max_body_kib: int = 1024
    body_timeout_s: float = 10.0
    public: bool = False

    def serving(self, listen: Address) -> ApiSpec:
        """This table with the API listening at ``listen`` (the ``--api`` flag)."""
        return attrs.evolve(self, listen=listen)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost`` or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_api_address(text: str) -> Address:
    """``--api`` text: ``HOST:PORT``, or a bare ``PORT`` (on loopback).

    Errors: ``ValueError`` saying what is wrong.
    """
    if text.isascii() and text.isdigit():
        text = f"{LOOPBACK}:{text}"
    return Address.parse(text)


def read_api(table: Table, base_dir: Path | None, *, max_sessions: int) -> ApiSpec:
    """Validate ``[api]`` (absent: the API off). ``max_sessions`` is ``[limits]``' value,
    the default and the ceiling (the ring holds no more sessions than that)."""
    listen = None
    if table.raw("listen", None) is not None:
        text = table.string("listen", example='"127.0.0.1:8000"')
        try:
            listen = Address.parse(text)
        except ValueError as e:
            raise table.error("listen", f'{e}; e.g. listen = "127.0.0.1:8000"') from None
    sessions = table.integer("max_sessions", default=max_sessions)
    if sessions > max_sessions:
        raise table.error(
            "max_sessions",
            f"{sessions} exceeds limits.max_sessions = {max_sessions} (the ring's own cap); "
            "lower it or raise limits.max_sessions",
        )
    model_name = None
    if table.raw("model_name", None) is not None:
        model_name = table.string("model_name", example='"smollm2"')
    spec = ApiSpec(
        listen=listen,
        keys_file=resolve_path(table, "keys_file", base_dir, '"api-keys.txt"'),
        max_sessions=sessions,
        model_name=model_name,
        max_body_kib=table.integer("max_body_kib", default=1024),
        body_timeout_s=table.number("body_timeout_s", default=10.0, positive=True),
        public=table.boolean("public", default=False),
    )
    check_exposure(table.source, spec)
    return spec


def check_exposure(source: str, api: ApiSpec) -> None:
    """A non-loopback ``listen`` needs ``keys_file`` or an explicit ``public = true``."""
    if api.listen is None or is_loopback(api.listen.host) or api.keys_file or api.public:
        return
    raise SpecError(
        source,
        "api.listen",
        f"{api.listen} is reachable from other machines but no keys_file is set; add "
        'keys_file = "api-keys.txt" (make keys with `shard api-key --keys api-keys.txt`), '
        "listen on 127.0.0.1, or set public = true to serve anyone on purpose",
    )
