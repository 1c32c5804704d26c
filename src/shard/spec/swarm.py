"""Typed swarm specs: the TOML file that describes a whole swarm, as frozen attrs records.

A spec names the swarm, the model, the coordinator, the stage nodes (ring order is file order),
their layer blocks, the emulated link latency and the limits; for failover, its timings, standby
nodes and scripted faults (``shard.spec.failover``). One file drives every way of running a
swarm: ``shard up --role stage --spec SPEC --node NAME`` (one node of it), ``shard swarm
up|run SPEC`` (every node as a local process) and the in-process test swarm.

Validation happens once, here, at the edge: ``SwarmSpec.from_file`` / ``from_dict`` either
return a consistent spec or raise ``SpecError`` with a one-line message naming the file, the
key and the fix. The one rule that needs the model, that the blocks end at its layer count, is
checked by ``SwarmSpec.blocks(n_layers)``. The format is documented in ``docs/specs.md``.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs

from shard.spec.failover import (
    FAILOVER_KEYS,
    STANDBY_KEYS,
    FailoverSpec,
    FaultSpec,
    read_failover,
    read_faults,
    read_layers_of,
)
from shard.spec.fetch import FetchSpec, read_fetch
from shard.spec.speculation import SPECULATION_KEYS, SpeculationSpec, read_speculation
from shard.spec.trust import (
    CREDENTIAL_KEYS,
    TRUST_KEYS,
    CredentialPaths,
    TrustSpec,
    check_secure,
    read_credentials,
    read_trust,
)
from shard.spec.validate import (
    Block,
    Table,
    check_edges,
    check_layer_mode,
    check_tiling,
    check_unique,
    even_split,
)
from shard.spec.validate import (
    SpecError as SpecError,  # re-exported: callers catch shard.spec.swarm.SpecError
)

#: Activation / weight dtypes a swarm may run in.
DTYPES: Final = ("float32", "bfloat16", "float16")
#: Model names that need no path: shipped with shard (``shard.model`` knows where).
BUNDLED_MODELS: Final = ("smollm2",)

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

_TOP_KEYS: Final = (
    "swarm",
    "limits",
    "coordinator",
    "stage",
    "links",
    "speculation",
    "trust",
    "fetch",
    "failover",
    "standby",
    "faults",
)
_SWARM_KEYS: Final = ("name", "model", "dtype", "insecure")
_NODE_KEYS: Final = ("name", "listen", *CREDENTIAL_KEYS)
_STAGE_KEYS: Final = ("name", "listen", "layers", *CREDENTIAL_KEYS)
_LINK_KEYS: Final = ("latency_ms", "bandwidth_mbps", "edge")
_EDGE_KEYS: Final = ("from", "to", "latency_ms", "bandwidth_mbps")


@attrs.frozen
class Address:
    """A ``host:port`` to listen on or dial. IPv6 hosts are stored without brackets.

    Port 0 asks the OS for a free port (tests bind it, then learn the port and use
    ``SwarmSpec.with_ports``).
    """

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``"127.0.0.1:7700"``, ``"[::1]:7700"`` or ``"node-a.example:7700"``.

        Errors: ``ValueError`` saying what is wrong with ``text``.
        """
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected host:port, got {text!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"{host!r} is not an IPv6 address") from None
        elif ":" in host:
            raise ValueError(f"IPv6 hosts need brackets ([::1]:7700); got {text!r}")
        elif not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or IP address")
        elif all(label.isdigit() for label in host.split(".")):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"{host!r} is not an IPv4 address") from None
        if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
            raise ValueError(f"port must be an integer 0..65535, got {port_text!r}")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@attrs.frozen
class StageSpec:
    """One stage node: its name, where it listens, and its block ``[first, last)`` (None = auto).

    ``credentials``: its key and token files (secure swarms; ``shard.spec.trust``)."""

    name: str
    listen: Address
    layers: Block | None
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)


@attrs.frozen
class CoordinatorSpec:
    """The coordinator: its name, the return endpoint the tail dials, its key and token."""

    name: str
    listen: Address
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)


@attrs.frozen
class StandbySpec:
    """A standby node, outside the ring until failover splices it in for a dead stage.

    ``layers_of``: the stage whose block it loads at start (hot), or None (a spare: it loads
    the dead stage's block when assigned). ``credentials`` as on a stage."""

    name: str
    listen: Address
    layers_of: str | None = None
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)


NodeSpec = StageSpec | CoordinatorSpec | StandbySpec


@attrs.frozen
class EdgeSpec:
    """Emulated one-way latency and bandwidth of one ring hop (``bandwidth_mbps`` 0 = unlimited)."""

    src: str
    dst: str
    latency_ms: float
    bandwidth_mbps: float


@attrs.frozen
class Limits:
    """Resource limits every node of the swarm applies."""

    max_sessions: int = 16
    max_len: int = 2048  # per-session KV cache length, in positions
    prefill_chunk: int = 128
    max_message_mib: int = 64  # cap on one decompressed wire message
    max_buffer_mib: int = 256  # cap on received bytes a node buffers, all connections together
    max_connections: int = 256  # concurrent inbound connections a node serves
    max_prompt_bytes: int = 256 * 1024  # a prompt's UTF-8 size, checked before tokenizing
    connect_timeout_s: float = 10.0
    verdict_timeout_s: float = 60.0  # a ring silent this long fails the request (a stalled node)
    retry_after_s: float = 10.0  # no verdict this long (ring not in repair): re-send the chunk


_LIMIT_KEYS: Final = tuple(field.name for field in attrs.fields(Limits))


@attrs.frozen(kw_only=True)
class SwarmSpec:
    """A whole swarm. Build with ``from_file`` / ``from_dict``; change with ``attrs.evolve``.

    ``model`` is a bundled name (``BUNDLED_MODELS``) or an absolute path. ``edges`` holds the
    per-hop overrides only; ``edge()`` and ``hops()`` resolve defaults. ``source`` is what error
    messages call the spec (the file path, or ``from_dict``'s ``source``).
    """

    path: Path | None
    name: str
    model: str
    dtype: str
    insecure: bool
    limits: Limits
    coordinator: CoordinatorSpec
    stages: tuple[StageSpec, ...]
    default_latency_ms: float
    default_bandwidth_mbps: float
    edges: tuple[EdgeSpec, ...]
    speculation: SpeculationSpec = attrs.field(factory=SpeculationSpec)
    trust: TrustSpec | None = None  # [trust]: authority, revocations (shard.spec.trust)
    fetch: FetchSpec | None = None  # [fetch]: manifest, publisher, seeders (shard.spec.fetch)
    failover: FailoverSpec = attrs.field(factory=FailoverSpec)  # shard.spec.failover
    standbys: tuple[StandbySpec, ...] = ()
    faults: tuple[FaultSpec, ...] = ()  # acted on by `shard swarm run` only
    source: str = attrs.field(default="<spec>", eq=False)

    @classmethod
    def from_file(cls, path: Path) -> SwarmSpec:
        """Read and validate a TOML spec. Relative model paths resolve against its directory.

        Errors: ``SpecError`` for a missing or unreadable file, bad TOML or an invalid spec.
        """
        source = str(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise SpecError(source, "", "no such file") from None
        except IsADirectoryError:
            raise SpecError(source, "", "is a directory; give the path of a .toml spec") from None
        except UnicodeDecodeError as e:
            raise SpecError(source, "", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        except tomllib.TOMLDecodeError as e:
            raise SpecError(source, "", f"invalid TOML: {e}") from None
        spec = cls.from_dict(data, source=source, base_dir=path.parent)
        return attrs.evolve(spec, path=path)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, object], *, source: str = "<spec>", base_dir: Path | None = None
    ) -> SwarmSpec:
        """Validate parsed TOML. ``base_dir`` anchors a relative model path (default: cwd).

        Errors: ``SpecError`` naming ``source`` and the offending key.
        """
        top = Table.open(source, "", data, _TOP_KEYS)
        swarm = top.table("swarm", _SWARM_KEYS, required=True)
        limits = _read_limits(top.table("limits", _LIMIT_KEYS, required=False))
        coordinator = _read_coordinator(
            top.table("coordinator", _NODE_KEYS, required=True), base_dir
        )
        stages = tuple(_read_stage(t, base_dir) for t in top.tables("stage", _STAGE_KEYS))
        if not stages:
            raise top.error(
                "stage", "no stages; add at least one [[stage]] table with name, listen, layers"
            )
        names = [s.name for s in stages]
        standbys = tuple(
            _read_standby(t, base_dir, names) for t in top.tables("standby", STANDBY_KEYS)
        )
        _check_nodes(source, coordinator, stages, standbys)
        links = top.table("links", _LINK_KEYS, required=False)
        latency = links.number("latency_ms", default=0.0)
        bandwidth = links.number("bandwidth_mbps", default=0.0)
        edges = tuple(_read_edge(t, latency, bandwidth) for t in links.tables("edge", _EDGE_KEYS))
        ring = (coordinator.name, *(s.name for s in stages), coordinator.name)
        check_edges(source, ring, [(e.src, e.dst) for e in edges])
        insecure = _read_insecure(swarm)
        trust_table = top.table("trust", TRUST_KEYS, required="trust" in data)
        trust = read_trust(trust_table, base_dir) if "trust" in data else None
        check_secure(source, insecure, trust, _credentials(coordinator, stages, standbys))
        return cls(
            path=None,
            name=_node_name(swarm, "name"),
            model=_read_model(swarm, base_dir),
            dtype=_read_dtype(swarm),
            insecure=insecure,
            limits=limits,
            coordinator=coordinator,
            stages=stages,
            default_latency_ms=latency,
            default_bandwidth_mbps=bandwidth,
            edges=edges,
            speculation=read_speculation(
                top.table("speculation", SPECULATION_KEYS, required=False), base_dir
            ),
            trust=trust,
            fetch=read_fetch(top, base_dir, [(s.name, str(s.listen)) for s in stages]),
            failover=read_failover(top.table("failover", FAILOVER_KEYS, required=False), base_dir),
            standbys=standbys,
            faults=read_faults(top, names, coordinator.name),
            source=source,
        )

    def blocks(self, n_layers: int) -> tuple[Block, ...]:
        """Each stage's ``[first, last)`` in ring order, for a model with ``n_layers`` layers.

        ``"auto"`` splits evenly (the remainder goes to the earliest stages); explicit blocks
        must tile ``[0, n_layers)``. Errors: ``SpecError`` on gap, overlap, out of range.
        """
        explicit = [s.layers for s in self.stages if s.layers is not None]
        if not explicit:
            return even_split(self.source, len(self.stages), n_layers)
        check_layer_mode(self.source, [s.layers for s in self.stages])
        check_tiling(self.source, explicit, n_layers)
        return tuple(explicit)

    def ring(self) -> tuple[str, ...]:
        """Node names in ring order, closed: ``("coord", "s0", ..., "coord")``."""
        name = self.coordinator.name
        return (name, *(s.name for s in self.stages), name)

    def hops(self) -> tuple[EdgeSpec, ...]:
        """Every hop of the ring with its resolved latency and bandwidth, in ring order."""
        ring = self.ring()
        return tuple(self.edge(src, dst) for src, dst in itertools.pairwise(ring))

    def edge(self, src: str, dst: str) -> EdgeSpec:
        """Latency and bandwidth of the hop ``src -> dst`` (its override, else the defaults).

        Errors: ``SpecError`` if ``src -> dst`` is not a hop of the ring.
        """
        ring = self.ring()
        if (src, dst) not in itertools.pairwise(ring):
            raise SpecError(
                self.source, "links", f"{src} -> {dst} is not a hop of {' -> '.join(ring)}"
            )
        for e in self.edges:
            if (e.src, e.dst) == (src, dst):
                return e
        return EdgeSpec(src, dst, self.default_latency_ms, self.default_bandwidth_mbps)

    def node(self, name: str) -> StageSpec | CoordinatorSpec | StandbySpec:
        """The node (coordinator, stage or standby) called ``name``.

        Errors: ``SpecError`` if there is none."""
        for node in self._nodes():
            if node.name == name:
                return node
        known = ", ".join(node.name for node in self._nodes())
        raise SpecError(self.source, "node", f"no node named {name!r}; nodes: {known}")

    def standby_block(self, name: str, n_layers: int) -> Block | None:
        """The block standby ``name`` loads at start: its ``layers_of`` stage's, None for a spare.

        Errors: ``SpecError`` if ``name`` is not a standby, or as ``blocks(n_layers)``."""
        standby = self.node(name)
        if not isinstance(standby, StandbySpec):
            raise SpecError(self.source, "standby", f"{name!r} is not a [[standby]] node")
        if standby.layers_of is None:
            return None
        index = [s.name for s in self.stages].index(standby.layers_of)
        return self.blocks(n_layers)[index]

    def _nodes(self) -> tuple[NodeSpec, ...]:
        return (self.coordinator, *self.stages, *self.standbys)

    def with_ports(self, ports: Mapping[str, int]) -> SwarmSpec:
        """A copy with some nodes' listen ports replaced (tests bind port 0, then learn it).

        Errors: ``SpecError`` for an unknown node name or a port outside 0..65535.
        """
        for name, port in ports.items():
            self.node(name)
            if not 0 <= port <= 65535:
                raise SpecError(self.source, f"{name}.listen", f"port {port} outside 0..65535")

        def listen(node: NodeSpec) -> Address:
            port = ports.get(node.name, node.listen.port)
            return attrs.evolve(node.listen, port=port)

        return attrs.evolve(
            self,
            coordinator=attrs.evolve(self.coordinator, listen=listen(self.coordinator)),
            stages=tuple(attrs.evolve(s, listen=listen(s)) for s in self.stages),
            standbys=tuple(attrs.evolve(s, listen=listen(s)) for s in self.standbys),
        )


def load_spec(path: str | Path) -> SwarmSpec:
    """Read and validate the spec at ``path``. Errors: ``SpecError`` (also for a missing file)."""
    return SwarmSpec.from_file(Path(path))


# --- readers: one per table ------------------------------------------------------------------


def _node_name(table: Table, key: str) -> str:
    name = table.string(key, example='"s0"')
    if not _NODE_NAME.fullmatch(name):
        raise table.error(key, f"{name!r} is not a valid name; use letters, digits, '_', '.', '-'")
    return name


def _address(table: Table, key: str, example: str) -> Address:
    text = table.string(key, example=example)
    try:
        return Address.parse(text)
    except ValueError as e:
        raise table.error(key, f"{e}; e.g. {key} = {example}") from None


def _read_model(swarm: Table, base_dir: Path | None) -> str:
    model = swarm.string("model", example='"smollm2"')
    if model in BUNDLED_MODELS:
        return model
    path = Path(model).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    path = path.resolve()
    use = f"use one of {', '.join(BUNDLED_MODELS)} or a HF checkpoint directory or a .gguf file"
    if not path.exists():
        relative = "" if base_dir is None else " (relative paths resolve against the spec's dir)"
        raise swarm.error("model", f"{str(path)!r} not found{relative}; {use}")
    if path.is_file() and path.suffix != ".gguf":
        raise swarm.error("model", f"{str(path)!r} is a file but not a .gguf; {use}")
    return str(path)


def _read_dtype(swarm: Table) -> str:
    dtype = swarm.string("dtype", default="float32")
    if dtype not in DTYPES:
        raise swarm.error("dtype", f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype


def _read_insecure(swarm: Table) -> bool:
    # false (the default) needs [trust] and node credentials: spec_trust.check_secure
    return swarm.boolean("insecure", default=False)


def _read_limits(table: Table) -> Limits:
    d = Limits()
    limits = Limits(
        max_sessions=table.integer("max_sessions", default=d.max_sessions),
        max_len=table.integer("max_len", default=d.max_len),
        prefill_chunk=table.integer("prefill_chunk", default=d.prefill_chunk),
        max_message_mib=table.integer("max_message_mib", default=d.max_message_mib),
        max_buffer_mib=table.integer("max_buffer_mib", default=d.max_buffer_mib),
        max_connections=table.integer("max_connections", default=d.max_connections),
        max_prompt_bytes=table.integer("max_prompt_bytes", default=d.max_prompt_bytes),
        connect_timeout_s=table.number(
            "connect_timeout_s", default=d.connect_timeout_s, positive=True
        ),
        verdict_timeout_s=table.number(
            "verdict_timeout_s", default=d.verdict_timeout_s, positive=True
        ),
        retry_after_s=table.number("retry_after_s", default=d.retry_after_s, positive=True),
    )
    if limits.prefill_chunk > limits.max_len:
        raise table.error(
            "prefill_chunk",
            f"{limits.prefill_chunk} exceeds max_len = {limits.max_len}; lower it or raise max_len",
        )
    if limits.max_buffer_mib < 2 * limits.max_message_mib:
        raise table.error(
            "max_buffer_mib",
            f"{limits.max_buffer_mib} is less than twice max_message_mib = "
            f"{limits.max_message_mib}: a node could not hold a message while reading the next",
        )
    return limits


def _read_coordinator(table: Table, base_dir: Path | None) -> CoordinatorSpec:
    name = _node_name(table, "name") if "name" in table.data else "coord"
    return CoordinatorSpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7700"'),
        credentials=read_credentials(table, base_dir, name),
    )


def _read_stage(table: Table, base_dir: Path | None) -> StageSpec:
    name = _node_name(table, "name")
    return StageSpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7701"'),
        layers=table.layers("layers"),
        credentials=read_credentials(table, base_dir, name),
    )


def _read_standby(table: Table, base_dir: Path | None, stages: list[str]) -> StandbySpec:
    name = _node_name(table, "name")
    return StandbySpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7711"'),
        layers_of=read_layers_of(table, stages),
        credentials=read_credentials(table, base_dir, name),
    )


def _keyed(
    coordinator: CoordinatorSpec, stages: tuple[StageSpec, ...], standbys: tuple[StandbySpec, ...]
) -> list[tuple[str, NodeSpec]]:
    """Every node with its key path in the spec: ``coordinator``, ``stage[i]``, ``standby[i]``."""
    keyed: list[tuple[str, NodeSpec]] = [("coordinator", coordinator)]
    keyed += [(f"stage[{i}]", s) for i, s in enumerate(stages)]
    keyed += [(f"standby[{i}]", s) for i, s in enumerate(standbys)]
    return keyed


def _credentials(
    coordinator: CoordinatorSpec, stages: tuple[StageSpec, ...], standbys: tuple[StandbySpec, ...]
) -> list[tuple[str, str, CredentialPaths]]:
    keyed = _keyed(coordinator, stages, standbys)
    return [(key, node.name, node.credentials) for key, node in keyed]


def _read_edge(table: Table, latency_ms: float, bandwidth_mbps: float) -> EdgeSpec:
    return EdgeSpec(
        src=table.string("from", example='"s0"'),
        dst=table.string("to", example='"s1"'),
        latency_ms=table.number("latency_ms", default=latency_ms),
        bandwidth_mbps=table.number("bandwidth_mbps", default=bandwidth_mbps),
    )


def _check_nodes(
    source: str,
    coordinator: CoordinatorSpec,
    stages: tuple[StageSpec, ...],
    standbys: tuple[StandbySpec, ...],
) -> None:
    """Unique names, unique listen addresses (port 0 excepted), one layer mode, ordered blocks."""
    keyed = _keyed(coordinator, stages, standbys)
    check_unique(
        source,
        [(f"{key}.name", node.name) for key, node in keyed],
        "node name",
        "every node needs its own name",
    )
    check_unique(
        source,
        [(f"{key}.listen", str(node.listen)) for key, node in keyed if node.listen.port != 0],
        "listen address",
        "give each node its own port (or port 0 for an ephemeral one)",
    )
    check_layer_mode(source, [s.layers for s in stages])
    explicit = [s.layers for s in stages if s.layers is not None]
    if explicit:
        check_tiling(source, explicit)
