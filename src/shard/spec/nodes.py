"""The nodes of a swarm spec and the hops between them: ``[coordinator]``, ``[[stage]]``,
``[[standby]]`` and ``[links]``, each as a frozen record with its reader.

A node has a name, a ``listen`` address, its credentials (``shard.spec.trust``) and where it
computes (``device``, ``dtype``, ``graphs``: ``shard.spec.device``); a stage also has its layer
block, a standby the stage whose block it holds hot (``layers_of``) and its ``role`` (a standby,
or a dedicated auditor; both read in ``shard.spec.failover``). ``check_nodes`` holds the rules
that span nodes: unique names, unique listen addresses, one layer mode, ordered blocks.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from shard.spec.device import DEVICE_KEYS, STAGE_DEVICE_KEYS, DeviceSpec, read_device
from shard.spec.failover import read_layers_of, read_standby_role
from shard.spec.reach import read_reachable
from shard.spec.trust import CREDENTIAL_KEYS, CredentialPaths, read_credentials
from shard.spec.validate import Block, Table, check_layer_mode, check_tiling, check_unique

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

NODE_KEYS: Final = ("name", "listen", "reachable", *CREDENTIAL_KEYS, *DEVICE_KEYS)
#: ``[coordinator]``: a node's keys, and a standby coordinator's addresses (docs/failover.md)
COORDINATOR_KEYS: Final = (*NODE_KEYS, "standby", "standby_api")
STAGE_KEYS: Final = (
    "name", "listen", "reachable", "layers", *CREDENTIAL_KEYS, *STAGE_DEVICE_KEYS
)  # fmt: skip
LINK_KEYS: Final = ("latency_ms", "bandwidth_mbps", "edge")
EDGE_KEYS: Final = ("from", "to", "latency_ms", "bandwidth_mbps")


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

    ``credentials``: its key and token files (secure swarms; ``shard.spec.trust``);
    ``runtime``: its device, dtype and CUDA-graph mode (``shard.spec.device``);
    ``reachable``: whether it accepts inbound connections (``shard.spec.reach``)."""

    name: str
    listen: Address
    layers: Block | None
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)
    runtime: DeviceSpec = attrs.field(factory=DeviceSpec)
    reachable: bool = True


@attrs.frozen
class CoordinatorSpec:
    """The coordinator: its name, the return endpoint the tail dials, its key and token, and
    the device and dtype its draft model runs on (``runtime``)."""

    name: str
    listen: Address
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)
    runtime: DeviceSpec = attrs.field(factory=DeviceSpec)
    reachable: bool = True
    #: a standby coordinator's listen address (``shard up --role coordinator --standby-of``)
    #: and its HTTP API's once it took over; None: no standby coordinator
    standby: Address | None = None
    standby_api: Address | None = None

    @property
    def addresses(self) -> tuple[str, ...]:
        """Where the coordinator is, in the order stages and clients try: the primary, then
        the standby."""
        standby = () if self.standby is None else (str(self.standby),)
        return (str(self.listen), *standby)


@attrs.frozen
class StandbySpec:
    """A standby node, outside the ring until failover splices it in for a dead stage.

    ``layers_of``: the stage whose block it loads at start (hot), or None (a spare: it loads
    the dead stage's block when assigned). ``role``: ``standby``, or ``auditor`` (it answers
    audits of ``layers_of``'s block and is never spliced in). ``credentials`` and ``runtime``
    as on a stage."""

    name: str
    listen: Address
    layers_of: str | None = None
    role: str = "standby"
    credentials: CredentialPaths = attrs.field(factory=CredentialPaths)
    runtime: DeviceSpec = attrs.field(factory=DeviceSpec)
    reachable: bool = True


NodeSpec = StageSpec | CoordinatorSpec | StandbySpec


@attrs.frozen
class EdgeSpec:
    """Emulated one-way latency and bandwidth of one ring hop (``bandwidth_mbps`` 0 = unlimited)."""

    src: str
    dst: str
    latency_ms: float
    bandwidth_mbps: float


# --- readers ---------------------------------------------------------------------------------


def node_name(table: Table, key: str) -> str:
    """A node name: letters, digits, ``_ . -``, at most 64 characters."""
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


def read_coordinator(table: Table, base_dir: Path | None) -> CoordinatorSpec:
    """Validate ``[coordinator]`` (its name defaults to ``coord``)."""
    name = node_name(table, "name") if "name" in table.data else "coord"
    return CoordinatorSpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7700"'),
        credentials=read_credentials(table, base_dir, name),
        runtime=read_device(table, graphs=False),
        reachable=read_reachable(table),
        standby=_address(table, "standby", '"127.0.0.1:7790"') if "standby" in table.data else None,
        standby_api=(
            _address(table, "standby_api", '"127.0.0.1:8090"')
            if "standby_api" in table.data
            else None
        ),
    )


def read_stage(table: Table, base_dir: Path | None) -> StageSpec:
    """Validate one ``[[stage]]``."""
    name = node_name(table, "name")
    return StageSpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7701"'),
        layers=table.layers("layers"),
        credentials=read_credentials(table, base_dir, name),
        runtime=read_device(table, graphs=True),
        reachable=read_reachable(table),
    )


def read_standby(table: Table, base_dir: Path | None, stages: list[str]) -> StandbySpec:
    """Validate one ``[[standby]]``; ``stages`` are the names ``layers_of`` may give."""
    name = node_name(table, "name")
    layers_of = read_layers_of(table, stages)
    return StandbySpec(
        name=name,
        listen=_address(table, "listen", '"127.0.0.1:7711"'),
        layers_of=layers_of,
        role=read_standby_role(table, layers_of),
        credentials=read_credentials(table, base_dir, name),
        runtime=read_device(table, graphs=True),
        reachable=read_reachable(table),
    )


def read_edge(table: Table, latency_ms: float, bandwidth_mbps: float) -> EdgeSpec:
    """Validate one ``[[links.edge]]``; absent values are the ``[links]`` defaults given."""
    return EdgeSpec(
        src=table.string("from", example='"s0"'),
        dst=table.string("to", example='"s1"'),
        latency_ms=table.number("latency_ms", default=latency_ms),
        bandwidth_mbps=table.number("bandwidth_mbps", default=bandwidth_mbps),
    )


def _keyed(
    coordinator: CoordinatorSpec, stages: Sequence[StageSpec], standbys: Sequence[StandbySpec]
) -> list[tuple[str, NodeSpec]]:
    """Every node with its key path in the spec: ``coordinator``, ``stage[i]``, ``standby[i]``."""
    keyed: list[tuple[str, NodeSpec]] = [("coordinator", coordinator)]
    keyed += [(f"stage[{i}]", s) for i, s in enumerate(stages)]
    keyed += [(f"standby[{i}]", s) for i, s in enumerate(standbys)]
    return keyed


def credentials_of(
    coordinator: CoordinatorSpec, stages: Sequence[StageSpec], standbys: Sequence[StandbySpec]
) -> list[tuple[str, str, CredentialPaths]]:
    """``(key, name, credentials)`` of every node, for ``shard.spec.trust.check_secure``."""
    keyed = _keyed(coordinator, stages, standbys)
    return [(key, node.name, node.credentials) for key, node in keyed]


def check_nodes(
    source: str,
    coordinator: CoordinatorSpec,
    stages: Sequence[StageSpec],
    standbys: Sequence[StandbySpec],
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
