"""What the planner is given: candidate nodes, the RTT mesh, the model's size, where the
coordinator may run, and whether the boundaries are pinned to trusted nodes.

Every record validates itself on construction and raises ``PlanError`` with what is wrong
and what to do, so the search downstream never meets a negative latency, a node missing from
the mesh or a model of zero layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["Candidate", "ModelFacts", "PlanError", "Problem", "RttMatrix", "Sizes"]


class PlanError(Exception):
    """No plan can be made from these inputs: ``str(err)`` says why and what to do."""


def _positive(what: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"{what} must be a positive number of ms, got {value!r}")


@attrs.frozen
class Candidate:
    """A node that may hold a block: its memory for weights (bytes; leave out what the KV
    cache and activations need), its measured compute per layer for a 1-token chunk and for
    a (K+1)-token verify chunk (ms), whether it may hold a boundary block (``trusted``) and
    whether it accepts inbound connections (``reachable``; two unreachable neighbours talk
    through a relay)."""

    name: str
    memory_bytes: int
    ms_per_layer_one: float
    ms_per_layer_chunk: float
    trusted: bool = False
    reachable: bool = True

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise PlanError("a candidate node needs a name")
        if self.memory_bytes < 0:
            raise PlanError(f"{self.name}: memory must be >= 0 bytes, got {self.memory_bytes}")
        _positive(f"{self.name}: ms per layer (1 token)", self.ms_per_layer_one)
        _positive(f"{self.name}: ms per layer (K+1 tokens)", self.ms_per_layer_chunk)


@attrs.frozen
class Sizes:
    """Bytes of a model's weights as one node holds them (its ``weights`` format): each
    layer's (``layers[i]`` is layer ``i``), the embedding (first stage), the final norm and
    head (last stage), and the head when the same stage holds the embedding too
    (``shared_head``; None: ``head``): a tied head is then the embedding itself, while a
    last stage without the embedding needs a copy of the table."""

    layers: tuple[int, ...]
    embedding: int = 0
    head: int = 0
    shared_head: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise PlanError("the model needs at least one layer, got 0")
        values = (*self.layers, self.embedding, self.head, self.shared_head or 0)
        if min(values) < 0:
            raise PlanError(f"the model's sizes must be >= 0 bytes, got {min(values)}")

    def stage(self, first: int, last: int, *, head_too: bool | None = None) -> int:
        """Bytes of a stage holding layers ``[first, last)``: the embedding when it starts
        at 0, the head when it ends at the last layer (``head_too`` overrides that end)."""
        total = sum(self.layers[first:last])
        ends_here = last == len(self.layers) if head_too is None else head_too
        if first == 0:
            total += self.embedding
        if ends_here:
            shared = self.head if self.shared_head is None else self.shared_head
            total += shared if first == 0 else self.head
        return total

    @property
    def total(self) -> int:
        """Every weight on one stage."""
        return self.stage(0, len(self.layers))


@attrs.frozen
class ModelFacts:
    """The model's shape as placement sees it: ``n_layers`` layers of at most
    ``layer_bytes``, plus the embedding (on the first stage) and the final norm and head (on
    the last). ``sizes``: each layer's real bytes (a config's footprint; None: every layer
    weighs ``layer_bytes``); ``node_sizes``: those of nodes that hold another ``weights``
    format than ``sizes`` (``of_sizes`` builds it all)."""

    n_layers: int
    layer_bytes: int
    embedding_bytes: int = 0
    head_bytes: int = 0
    sizes: Sizes | None = None
    node_sizes: tuple[tuple[str, Sizes], ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.n_layers < 1:
            raise PlanError(f"the model needs at least one layer, got {self.n_layers}")
        for what, value in (
            ("layer", self.layer_bytes),
            ("embedding", self.embedding_bytes),
            ("head", self.head_bytes),
        ):
            if value < 0:
                raise PlanError(f"the model's {what} size must be >= 0 bytes, got {value}")
        for _, found in (("", self.sizes), *self.node_sizes):
            if found is not None and len(found.layers) != self.n_layers:
                raise PlanError(
                    f"sizes for {len(found.layers)} layers given for a model of {self.n_layers}"
                )

    @classmethod
    def of_sizes(cls, sizes: Sizes, node_sizes: Mapping[str, Sizes] | None = None) -> ModelFacts:
        """The facts of a model whose layers weigh ``sizes`` (on every node but those of
        ``node_sizes``, which hold another format); ``layer_bytes`` is the largest layer."""
        others = tuple((n, s) for n, s in (node_sizes or {}).items() if s != sizes)
        return cls(len(sizes.layers), max(sizes.layers), sizes.embedding, sizes.head, sizes, others)

    def sizes_of(self, node: str) -> Sizes:
        """The bytes of each layer, embedding and head as ``node`` holds them."""
        for name, found in self.node_sizes:
            if name == node:
                return found
        if self.sizes is not None:
            return self.sizes
        return Sizes((self.layer_bytes,) * self.n_layers, self.embedding_bytes, self.head_bytes)

    @property
    def equal_layers(self) -> bool:
        """Every layer weighs ``layer_bytes`` on every node (the planner's counts are then
        exact; otherwise the chosen ring's split is recomputed layer by layer)."""
        every = [s for s in (self.sizes, *(s for _, s in self.node_sizes)) if s is not None]
        return all(
            set(s.layers) == {self.layer_bytes}
            and (s.embedding, s.head) == (self.embedding_bytes, self.head_bytes)
            for s in every
        )

    @property
    def total_bytes(self) -> int:
        """Every weight the ring must hold (the lightest format's, when nodes differ)."""
        if self.sizes is None:
            return self.n_layers * self.layer_bytes + self.embedding_bytes + self.head_bytes
        every = (self.sizes, *(s for _, s in self.node_sizes))
        return min(sum(s.layers) + s.embedding + s.head for s in every)


@attrs.frozen
class RttMatrix:
    """Round-trip times (ms) between named places: ``rtt_ms[i][j]`` from ``names[i]`` to
    ``names[j]``, as a ping from ``i`` measures it (so it may differ from ``[j][i]``). One hop
    of the ring costs half a round trip (``hop_ms``): data goes one way."""

    names: tuple[str, ...]
    rtt_ms: tuple[tuple[float, ...], ...]
    _index: Mapping[str, int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if len(set(self.names)) != len(self.names):
            raise PlanError(f"the RTT matrix names a node twice: {', '.join(self.names)}")
        if len(self.rtt_ms) != len(self.names):
            raise PlanError(
                f"the RTT matrix has {len(self.rtt_ms)} rows for {len(self.names)} nodes; "
                "give one row per node"
            )
        for i, row in enumerate(self.rtt_ms):
            if len(row) != len(self.names):
                raise PlanError(
                    f"RTT row {i} ({self.names[i]}) has {len(row)} entries, expected "
                    f"{len(self.names)}: the matrix must be square"
                )
            for j, value in enumerate(row):
                if not (math.isfinite(value) and value >= 0):
                    raise PlanError(
                        f"RTT {self.names[i]} -> {self.names[j]} is {value!r}; round trips "
                        "are finite and >= 0 ms"
                    )
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(self.names)})

    @classmethod
    def symmetric(cls, names: Sequence[str], pairs: Mapping[tuple[str, str], float]) -> RttMatrix:
        """A matrix from ``{(a, b): ms}``, each pair given once (either way round); the
        diagonal is 0. Errors: ``PlanError`` for a missing pair."""
        rows = []
        for a in names:
            row = []
            for b in names:
                if a == b:
                    row.append(0.0)
                    continue
                value = pairs.get((a, b), pairs.get((b, a)))
                if value is None:
                    raise PlanError(f"no RTT between {a} and {b}; give every pair")
                row.append(float(value))
            rows.append(tuple(row))
        return cls(tuple(names), tuple(rows))

    def has(self, name: str) -> bool:
        """Whether ``name`` is a row of the matrix."""
        return name in self._index

    def rtt(self, src: str, dst: str) -> float:
        """The round trip from ``src`` to ``dst`` (0 for a node to itself)."""
        return 0.0 if src == dst else self.rtt_ms[self._index[src]][self._index[dst]]

    def hop_ms(self, src: str, dst: str) -> float:
        """One-way latency of the hop ``src -> dst``: half the round trip."""
        return self.rtt(src, dst) / 2.0


@attrs.frozen
class Problem:
    """Everything one plan depends on. ``candidates`` in file order (the order of the even
    split the planner is compared with); ``coordinators`` the places the coordinator may run
    (the first is the default); ``pin_boundaries``: only trusted nodes hold the first block
    (embedding) and the last (head, acceptance).

    ``written``: the ring as a spec wrote it (stage names in order; empty: none): the even
    split over it is the baseline, and the plan on a tie, so a ring no plan beats stays as
    written. ``ring_size``: the ring holds exactly this many stages (None: any number), for
    a spec whose speeds and memory are assumed, not measured (``shard.spec.layout``).
    ``by_bytes``: no node's speed is measured, so a ring's layers are split to make its
    largest stage hold the fewest bytes (``split.byte_split``; the spec's ``"auto"``), not
    its slowest stage the fastest, and a plan beats the ring as written only by a shorter
    lap."""

    candidates: tuple[Candidate, ...]
    rtt: RttMatrix
    model: ModelFacts
    coordinators: tuple[str, ...]
    pin_boundaries: bool = False
    written: tuple[str, ...] = ()
    ring_size: int | None = None
    by_bytes: bool = False
    _by_name: Mapping[str, Candidate] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.candidates:
            raise PlanError("no candidate nodes; add stage nodes to plan a ring")
        if not self.coordinators:
            raise PlanError("no coordinator location; name at least one coordinator candidate")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise PlanError(f"a candidate is named twice: {', '.join(names)}")
        if len(set(self.coordinators)) != len(self.coordinators):
            raise PlanError(f"a coordinator candidate is named twice: {self.coordinators}")
        unknown = [n for n in self.written if n not in names]
        if unknown or len(set(self.written)) != len(self.written):
            raise PlanError(
                f"the ring as written ({', '.join(self.written)}) must name candidates once "
                f"each (candidates: {', '.join(names)})"
            )
        if self.ring_size is not None and not 1 <= self.ring_size <= len(names):
            raise PlanError(
                f"a ring of {self.ring_size} stages cannot be made of {len(names)} "
                f"candidate{'' if len(names) == 1 else 's'}"
            )
        missing = [n for n in (*names, *self.coordinators) if not self.rtt.has(n)]
        if missing:
            raise PlanError(
                f"the RTT matrix has no row for {', '.join(missing)}; measure or add them "
                f"(it has {', '.join(self.rtt.names)})"
            )
        object.__setattr__(self, "_by_name", {c.name: c for c in self.candidates})

    def candidate(self, name: str) -> Candidate:
        """The candidate called ``name`` (by a dict: the re-plan asks it for each of
        hundreds of standbys). Errors: ``PlanError`` if there is none."""
        found = self._by_name.get(name)
        if found is None:
            raise PlanError(f"no candidate node {name!r}")
        return found
