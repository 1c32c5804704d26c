"""The ``[fetch]`` table of a swarm spec: stages fetch their block, verified, from seeders.

```toml
[fetch]
manifest = "smollm2.manifest.json"   # the signed manifest (shard manifest build + sign)
publisher = "keys/publisher.key.pub" # who must have signed it: 64 hex digits or a .pub path
stages = "all"                       # stages that fetch their block at start: "all" or names
                                     # (a [formation] swarm: names of nodes that --join)
cache = "cache/blocks"               # where fetched blocks go (default: the user cache)
parallel = 4                         # chunk requests in flight per stage
chunk_timeout_s = 30.0               # a chunk slower than this is asked of another peer

[[fetch.seeder]]                     # `shard up --role seeder --spec SPEC --node seed-a`
name = "seed-a"
listen = "127.0.0.1:7810"
model = "/models/smollm2"            # the directory it serves (default: the swarm's model)

[[fetch.seeder]]                     # named like a stage: that stage serves what it holds
name = "s1"
listen = "127.0.0.1:7811"
```

Paths are relative to the spec file. Files are read when a node starts, never here.

A node started with ``--join`` fetches the block the scheduler gives it when ``stages`` is
``"all"`` (the default) or names it; in a ``[formation]`` spec ``stages`` may name such nodes,
which are in no ``[[stage]]`` (``shard.nodes.joining``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from shard.spec.nodes import Address
from shard.spec.trust import resolve_path
from shard.spec.validate import Table, check_unique
from shard.trust.identity import parse_public_key

FETCH_KEYS: Final = (
    "manifest",
    "publisher",
    "stages",
    "cache",
    "parallel",
    "chunk_timeout_s",
    "seeder",
)
SEEDER_KEYS: Final = ("name", "listen", "model")


@attrs.frozen
class SeederSpec:
    """A seeder: its name, its ``host:port``, and the directory it serves (None: the model)."""

    name: str
    listen: str
    model: Path | None = None


@attrs.frozen
class FetchSpec:
    """Typed ``[fetch]``. ``publisher`` is 64 hex digits or an absolute ``.pub`` path;
    ``every``: ``stages = "all"`` (then ``stages`` lists the spec's ``[[stage]]`` names)."""

    manifest: Path
    publisher: str
    stages: tuple[str, ...]
    cache: Path | None = None
    parallel: int = 4
    chunk_timeout_s: float = 30.0
    seeders: tuple[SeederSpec, ...] = ()
    every: bool = False

    def fetches(self, stage: str) -> bool:
        """Whether ``stage`` (a ``[[stage]]``, or a node that joins) fetches its block."""
        return self.every or stage in self.stages

    def seeder(self, name: str) -> SeederSpec | None:
        """The seeder called ``name`` (a stage's name: that stage serves), or None."""
        return next((s for s in self.seeders if s.name == name), None)


def read_fetch(
    top: Table, base_dir: Path | None, stages: Sequence[tuple[str, str]]
) -> FetchSpec | None:
    """Validate ``[fetch]`` of the spec ``top`` (None when absent: stages read their model
    directory); ``stages`` are the spec's ``(name, listen)``."""
    if "fetch" not in top.data:
        return None
    table = top.table("fetch", FETCH_KEYS, required=True)
    manifest = resolve_path(table, "manifest", base_dir, '"model.manifest.json"')
    if manifest is None:
        raise table.error("manifest", 'missing required key; add manifest = "model.manifest.json"')
    publisher = table.string("publisher", example='"keys/publisher.key.pub"')
    try:
        parse_public_key(publisher)
    except ValueError:
        resolved = resolve_path(table, "publisher", base_dir, '"keys/publisher.key.pub"')
        assert resolved is not None
        publisher = str(resolved)
    seeders = tuple(_read_seeder(t, base_dir) for t in table.tables("seeder", SEEDER_KEYS))
    _check_seeders(table, seeders, stages)
    names = [name for name, _ in stages]
    joined = "formation" in top.data  # its nodes join under names no [[stage]] holds
    return FetchSpec(
        manifest=manifest,
        publisher=publisher,
        stages=_read_stages(table, names, joined=joined),
        every=table.raw("stages", None) in (None, "all"),
        cache=resolve_path(table, "cache", base_dir, '"cache/blocks"'),
        parallel=table.integer("parallel", default=4, minimum=1),
        chunk_timeout_s=table.number("chunk_timeout_s", default=30.0, positive=True),
        seeders=seeders,
    )


def _read_stages(table: Table, names: list[str], *, joined: bool) -> tuple[str, ...]:
    """The stages that fetch; ``joined``: names of nodes that --join are allowed too."""
    value = table.raw("stages", None)
    if value is None or value == "all":
        return tuple(names)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise table.error("stages", f'expected "all" or a list of stage names, got {value!r:.60}')
    for name in value:
        if name not in names and not joined:
            raise table.error("stages", f"no stage named {name!r}; stages: {', '.join(names)}")
    return tuple(value)


def _read_seeder(table: Table, base_dir: Path | None) -> SeederSpec:
    name = table.string("name", example='"seed-a"')
    listen = table.string("listen", example='"127.0.0.1:7810"')
    try:
        address = Address.parse(listen)
    except ValueError as exc:
        raise table.error("listen", f'{exc}; e.g. listen = "127.0.0.1:7810"') from None
    model = resolve_path(table, "model", base_dir, '"/models/smollm2"')
    return SeederSpec(name=name, listen=str(address), model=model)


def _check_seeders(
    table: Table, seeders: tuple[SeederSpec, ...], stages: Sequence[tuple[str, str]]
) -> None:
    where = table.key("seeder")
    check_unique(
        table.source,
        [(f"{where}[{i}].name", s.name) for i, s in enumerate(seeders)],
        "seeder name",
        "give each seeder its own name",
    )
    taken = [(f"stage {name}", listen) for name, listen in stages if not listen.endswith(":0")]
    mine = [(f"{where}[{i}].listen", s.listen) for i, s in enumerate(seeders)]
    check_unique(
        table.source,
        taken + [entry for entry in mine if not entry[1].endswith(":0")],
        "listen address",
        "a seeder listens on its own port, apart from the ring's",
    )
