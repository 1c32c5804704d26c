"""The ``[trust]`` table of a swarm spec, and each node's ``key`` / ``token`` paths.

```toml
[swarm]
insecure = false                  # the default: the secure wire

[trust]
authority = "keys/authority.pub"  # the authority's public key: 64 hex digits or a .pub path
revoked = [7, 12]                 # serials of tokens no node may use any more
client_key = "keys/client.key"    # optional: what `shard generate --spec` presents
client_token = "keys/client.token"

[coordinator]                     # every node, in a secure swarm:
key = "keys/coord.key"            #   its secret key (shard keygen)
token = "keys/coord.token"        #   its admission token (shard admit)
```

Paths are relative to the spec file. Files are read when a node starts (each machine has only
its own key), never here; a node says which file is missing or wrong (``shard.nodes.compose``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from shard.spec.validate import SpecError, Table
from shard.trust.identity import parse_public_key

TRUST_KEYS: Final = ("authority", "revoked", "client_key", "client_token")
CREDENTIAL_KEYS: Final = ("key", "token")
_GUIDE: Final = "see docs/security.md"


@attrs.frozen
class TrustSpec:
    """Typed ``[trust]``. ``authority`` is 64 hex digits or an absolute ``.pub`` path."""

    authority: str
    revoked: frozenset[int] = frozenset()
    client_key: Path | None = None
    client_token: Path | None = None


@attrs.frozen
class CredentialPaths:
    """A node's ``key`` and ``token`` paths (absolute), or None where not given."""

    key: Path | None = None
    token: Path | None = None


def resolve_path(table: Table, name: str, base_dir: Path | None, example: str) -> Path | None:
    """An optional path key, made absolute against the spec's directory."""
    if table.raw(name, None) is None:
        return None
    path = Path(table.string(name, example=example)).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    return path


def read_credentials(table: Table, base_dir: Path | None, node: str) -> CredentialPaths:
    """A node table's ``key`` and ``token``."""
    return CredentialPaths(
        key=resolve_path(table, "key", base_dir, f'"keys/{node}.key"'),
        token=resolve_path(table, "token", base_dir, f'"keys/{node}.token"'),
    )


def read_trust(table: Table, base_dir: Path | None) -> TrustSpec:
    """Validate a present ``[trust]`` table."""
    authority = table.string("authority", example='"keys/authority.pub"')
    try:
        parse_public_key(authority)
    except ValueError:
        resolved = resolve_path(table, "authority", base_dir, '"keys/authority.pub"')
        assert resolved is not None
        authority = str(resolved)
    client_key = resolve_path(table, "client_key", base_dir, '"keys/client.key"')
    client_token = resolve_path(table, "client_token", base_dir, '"keys/client.token"')
    if (client_key is None) != (client_token is None):
        missing = "client_token" if client_token is None else "client_key"
        raise table.error(missing, "client_key and client_token go together; give both or neither")
    return TrustSpec(authority, _revoked(table), client_key, client_token)


def _revoked(table: Table) -> frozenset[int]:
    value = table.raw("revoked", None)
    if value is None:
        return frozenset()
    ok = isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in value
    )
    if not ok:
        raise table.error(
            "revoked", f"expected a list of token serials (integers >= 0), got {value!r:.60}"
        )
    assert isinstance(value, list)
    return frozenset(value)


def check_secure(
    source: str,
    insecure: bool,
    trust: TrustSpec | None,
    nodes: list[tuple[str, str, CredentialPaths]],
) -> None:
    """A secure spec (``insecure = false``) has ``[trust]`` and a key and token per node.

    ``nodes`` are ``(key path in the spec, node name, credentials)``.
    """
    if insecure:
        return
    if trust is None:
        raise SpecError(
            source,
            "swarm.insecure",
            "insecure = false (the default) needs a [trust] table naming the swarm's "
            "authority key, and a key and token for every node "
            f"({_GUIDE}); set insecure = true only for local development",
        )
    for where, name, paths in nodes:
        if paths.key is None:
            raise SpecError(
                source,
                f"{where}.key",
                f'missing required key in a secure swarm; add key = "keys/{name}.key" '
                f"(create it with `shard keygen --out keys/{name}.key`; {_GUIDE})",
            )
        if paths.token is None:
            raise SpecError(
                source,
                f"{where}.token",
                f'missing required key in a secure swarm; add token = "keys/{name}.token" '
                f"(from `shard admit ... --out keys/{name}.token`; {_GUIDE})",
            )
