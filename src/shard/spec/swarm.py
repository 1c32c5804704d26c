"""Typed swarm specs: the TOML file that describes a whole swarm, as frozen attrs records.

A spec names the swarm, the model, the coordinator, the stage nodes (ring order is file
order), their layer blocks and the emulated link latency (``shard.spec.nodes``), the limits
(``shard.spec.limits``), the speculation policy (``shard.spec.speculation``), trust and fetch
(``shard.spec.trust``, ``shard.spec.fetch``), the HTTP API (``shard.spec.api``) and, for
failover, its timings, standby nodes and scripted faults (``shard.spec.failover``). This
module holds the whole-swarm record, ``SwarmSpec``, and the reader that assembles it from
those tables (the ``[swarm]`` table's own keys: ``shard.spec.swarm_table``). One file drives
every way of running a swarm: ``shard up --role stage --spec SPEC --node NAME`` (one node of
it), ``shard swarm up|run SPEC`` (every node as a local process) and the in-process test swarm.

Validation happens once, here, at the edge: ``SwarmSpec.from_file`` / ``from_dict`` either
return a consistent spec or raise ``SpecError`` with a one-line message naming the file, the
key and the fix. The one rule that needs the model, that the blocks end at its layer count, is
checked by ``SwarmSpec.blocks(n_layers)``. The format is documented in ``docs/specs.md``.
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs

from shard.placement.problem import ModelFacts
from shard.spec.api import API_KEYS, ApiSpec, read_api
from shard.spec.audit import AUDIT_KEYS, AuditSpec, read_audit
from shard.spec.device import DTYPES as DTYPES  # re-exported: the swarm's dtypes
from shard.spec.device import (
    DeviceSpec,
    check_device,
    check_dtype,
    check_dtypes,
    check_graphs,
    check_weights,
)
from shard.spec.failover import (
    FAILOVER_KEYS,
    STANDBY_KEYS,
    FailoverSpec,
    FaultSpec,
    read_failover,
    read_faults,
)
from shard.spec.fetch import FetchSpec, read_fetch
from shard.spec.formation import FORMATION_KEYS, FormationSpec, read_formation
from shard.spec.ledger import LEDGER_KEYS, LedgerSpec, read_ledger
from shard.spec.limits import LIMIT_KEYS, Limits, read_limits
from shard.spec.nodes import (
    COORDINATOR_KEYS,
    EDGE_KEYS,
    LINK_KEYS,
    STAGE_KEYS,
    Address,
    CoordinatorSpec,
    EdgeSpec,
    NodeSpec,
    StageSpec,
    StandbySpec,
    check_nodes,
    credentials_of,
    node_name,
    read_coordinator,
    read_edge,
    read_stage,
    read_standby,
)
from shard.spec.reach import advertised, check_reach, read_relay
from shard.spec.speculation import SPECULATION_KEYS, SpeculationSpec, read_speculation
from shard.spec.swarm_table import (
    check_nodes_weights,
    read_dtype,
    read_insecure,
    read_model,
    read_weights,
)
from shard.spec.trust import TRUST_KEYS, TrustSpec, check_secure, read_trust
from shard.spec.validate import (
    Block,
    Table,
    check_edges,
    check_layer_mode,
    check_tiling,
    even_split,
)
from shard.spec.validate import (
    SpecError as SpecError,  # re-exported: callers catch shard.spec.swarm.SpecError
)

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
    "api",
    "audit",
    "formation",
    "ledger",
)
_SWARM_KEYS: Final = ("name", "model", "dtype", "weights", "insecure", "relay")


@attrs.frozen(kw_only=True)
class SwarmSpec:
    """A whole swarm. Build with ``from_file`` / ``from_dict``; change with ``attrs.evolve``.

    ``model`` is a bundled name (``swarm_table.BUNDLED_MODELS``) or an absolute path.
    ``edges`` holds the per-hop overrides only; ``edge()`` and ``hops()`` resolve defaults.
    ``source`` is what error messages call the spec (the file path, or ``from_dict``'s
    ``source``).
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
    api: ApiSpec = attrs.field(factory=ApiSpec)  # [api]: the HTTP API (shard.spec.api)
    audit: AuditSpec = attrs.field(factory=AuditSpec)  # [audit]: spot checks (shard.spec.audit)
    #: [formation]: the ring forms from nodes that --join (no [[stage]]); None: as written
    formation: FormationSpec | None = None
    ledger: LedgerSpec = attrs.field(factory=LedgerSpec)  # [ledger]: the receipt log
    relay: str = ""  # [swarm] relay: the relay's node (shard.spec.reach); "": the coordinator
    #: [swarm] weights: how nodes hold weights (shard.spec.device.WEIGHTS); None: dense in dtype
    weights: str | None = None
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

        Long on purpose: one reader call per table of the spec, in the order the file is read.
        """
        top = Table.open(source, "", data, _TOP_KEYS)
        swarm = top.table("swarm", _SWARM_KEYS, required=True)
        limits = read_limits(top.table("limits", LIMIT_KEYS, required=False))
        coordinator = read_coordinator(
            top.table("coordinator", COORDINATOR_KEYS, required=True), base_dir
        )
        stages = tuple(read_stage(t, base_dir) for t in top.tables("stage", STAGE_KEYS))
        names = [s.name for s in stages]
        standbys = tuple(
            read_standby(t, base_dir, names) for t in top.tables("standby", STANDBY_KEYS)
        )
        formation = _read_formation(top, stages, standbys, secure=not read_insecure(swarm))
        check_nodes(source, coordinator, stages, standbys)
        relay = read_relay(swarm, coordinator.name)
        check_reach(source, relay, coordinator, (*stages, *standbys))
        links = top.table("links", LINK_KEYS, required=False)
        latency = links.number("latency_ms", default=0.0)
        bandwidth = links.number("bandwidth_mbps", default=0.0)
        edges = tuple(read_edge(t, latency, bandwidth) for t in links.tables("edge", EDGE_KEYS))
        ring = (coordinator.name, *(s.name for s in stages), coordinator.name)
        check_edges(source, ring, [(e.src, e.dst) for e in edges])
        insecure = read_insecure(swarm)
        trust_table = top.table("trust", TRUST_KEYS, required="trust" in data)
        trust = read_trust(trust_table, base_dir) if "trust" in data else None
        check_secure(source, insecure, trust, credentials_of(coordinator, stages, standbys))
        dtype = read_dtype(swarm)
        ring_nodes = [(f"stage[{i}]", s.runtime) for i, s in enumerate(stages)]
        ring_nodes += [(f"standby[{i}]", s.runtime) for i, s in enumerate(standbys)]
        check_dtypes(source, dtype, ring_nodes)
        weights = read_weights(swarm)
        check_nodes_weights(
            source, dtype, weights, [("coordinator", coordinator.runtime), *ring_nodes]
        )
        return cls(
            path=None,
            name=node_name(swarm, "name"),
            model=read_model(swarm, base_dir),
            dtype=dtype,
            weights=weights,
            insecure=insecure,
            limits=limits,
            coordinator=coordinator,
            stages=stages,
            default_latency_ms=latency,
            default_bandwidth_mbps=bandwidth,
            edges=edges,
            speculation=read_speculation(
                top.table("speculation", SPECULATION_KEYS, required=False),
                base_dir,
                swarm_model=read_model(swarm, base_dir),
            ),
            trust=trust,
            fetch=read_fetch(top, base_dir, [(s.name, str(s.listen)) for s in stages]),
            failover=read_failover(top.table("failover", FAILOVER_KEYS, required=False), base_dir),
            ledger=read_ledger(top.table("ledger", LEDGER_KEYS, required=False), base_dir),
            standbys=standbys,
            faults=read_faults(top, names, coordinator.name),
            api=read_api(
                top.table("api", API_KEYS, required=False),
                base_dir,
                max_sessions=limits.max_sessions,
            ),
            audit=read_audit(top.table("audit", AUDIT_KEYS, required=False), base_dir),
            formation=formation,
            relay=relay,
            source=source,
        )

    def blocks(self, n_layers: int, model: ModelFacts | None = None) -> tuple[Block, ...]:
        """Each stage's ``[first, last)`` in ring order, for a model with ``n_layers`` layers.

        ``"auto"`` with ``model`` (its layers' bytes as each stage's ``weights`` holds them:
        ``shard.nodes.sizes.model_facts``) makes the largest stage hold the fewest bytes, the
        embedding counted on the first and the head on the last
        (``shard.placement.split.auto_counts``); without ``model`` (or its sizes) it splits
        evenly (the remainder goes to the earliest stages). Explicit blocks must tile
        ``[0, n_layers)``. Errors: ``SpecError`` on gap, overlap, out of range.
        """
        if not self.stages:
            raise SpecError(
                self.source, "formation", "no [[stage]]: the scheduler places joined nodes"
            )
        explicit = [s.layers for s in self.stages if s.layers is not None]
        if not explicit:
            blocks = even_split(self.source, len(self.stages), n_layers)
            if model is None or model.sizes is None:
                return blocks
            from shard.placement.split import auto_counts, blocks_of

            counts = auto_counts(model, [s.name for s in self.stages])
            assert counts is not None and model.n_layers == n_layers  # even_split checked it
            return blocks_of(counts)
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

    def standby_block(
        self, name: str, n_layers: int, model: ModelFacts | None = None
    ) -> Block | None:
        """The block standby ``name`` loads at start: its ``layers_of`` stage's, None for a spare.

        Errors: ``SpecError`` if ``name`` is not a standby, or as ``blocks(n_layers, model)``."""
        standby = self.node(name)
        if not isinstance(standby, StandbySpec):
            raise SpecError(self.source, "standby", f"{name!r} is not a [[standby]] node")
        if standby.layers_of is None:
            return None
        index = [s.name for s in self.stages].index(standby.layers_of)
        return self.blocks(n_layers, model)[index]

    def runtime(self, name: str) -> DeviceSpec:
        """Node ``name``'s device, graphs mode and dtype, its ``dtype`` resolved (never None).

        Errors: ``SpecError`` if there is no such node."""
        runtime = self.node(name).runtime
        weights = runtime.weights or self.weights
        return attrs.evolve(runtime, dtype=runtime.dtype or self.dtype, weights=weights)

    def with_runtime(
        self,
        name: str,
        *,
        device: str | None = None,
        dtype: str | None = None,
        graphs: str | None = None,
        weights: str | None = None,
    ) -> SwarmSpec:
        """A copy where node ``name`` runs on ``device`` / in ``dtype`` / with ``graphs`` /
        holding ``weights`` (``shard up --device --dtype --graphs --weights``); None keeps
        the spec's value.

        Errors: ``SpecError`` for an unknown node, a bad value, or a stage dtype that no
        longer matches the ring's."""
        node = self.node(name)
        runtime = node.runtime
        for key, value, check in (
            ("device", device, check_device),
            ("dtype", dtype, check_dtype),
            ("graphs", graphs, check_graphs),
            ("weights", weights, check_weights),
        ):
            if value is None:
                continue
            try:
                runtime = attrs.evolve(runtime, **{key: check(value)})
            except ValueError as e:
                raise SpecError(self.source, f"{name}.{key}", str(e)) from None
        coordinator = self.coordinator
        if node is coordinator:
            coordinator = attrs.evolve(coordinator, runtime=runtime)
        spec = attrs.evolve(
            self,
            coordinator=coordinator,
            stages=tuple(attrs.evolve(s, runtime=runtime) if s is node else s for s in self.stages),
            standbys=tuple(
                attrs.evolve(s, runtime=runtime) if s is node else s for s in self.standbys
            ),
        )
        ring: list[StageSpec | StandbySpec] = [*spec.stages, *spec.standbys]
        ring_nodes = [(s.name, s.runtime) for s in ring]
        check_dtypes(self.source, self.dtype, ring_nodes)
        check_nodes_weights(self.source, self.dtype, self.weights, [(name, runtime)])
        return spec

    def address_of(self, name: str) -> str:
        """Where others dial node ``name``: its listen address, or ``nat:NAME`` when it has
        ``reachable = false`` (``shard.spec.reach``). Errors: ``SpecError`` (no such node)."""
        node = self.node(name)
        return advertised(node, str(node.listen))

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


def _read_formation(
    top: Table, stages: tuple[StageSpec, ...], standbys: tuple[StandbySpec, ...], *, secure: bool
) -> FormationSpec | None:
    """``[formation]`` (no stages, no standbys: they join), or stages as written."""
    if "formation" not in top.data:
        if not stages:
            raise top.error(
                "stage",
                "no stages; add at least one [[stage]] table with name, listen, layers, or a "
                "[formation] table to let nodes join with --join",
            )
        return None
    if stages or standbys:
        raise top.error(
            "formation",
            "a formed swarm places its own stages and standbys (they start with --join); "
            "remove the [[stage]] and [[standby]] tables, or [formation] to run them as written",
        )
    return read_formation(top.table("formation", FORMATION_KEYS, required=True), secure=secure)
