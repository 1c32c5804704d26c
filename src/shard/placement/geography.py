"""A geography: the RTT matrix between places, and optionally the nodes there (memory,
compute profile, trust, reachability), the model and the coordinator locations, read from
parsed TOML or JSON (the caller reads the file; this module does no I/O).

The format (``docs/placement.md``; ``specs/geography/world.toml`` is an example)::

    coordinators = ["coord-fra", "coord-iad"]   # where the coordinator may run; first = default
    pin_boundaries = false
    [model]            # n_layers, layer_gib, embedding_gib, head_gib
    [[node]]           # name, memory_gib, ms_per_layer_1, ms_per_layer_k, trusted, reachable,
                       # region (a label, printed only)
    [rtt]
    nodes = ["fra-1", "fra-2", ...]   # row and column order
    ms = [[0, 2.1, ...], ...]         # round trips, ms; row i is measured from nodes[i]

Every mistake is a ``GeographyError`` naming the file, the key and the fix, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from shard.placement.problem import Candidate, ModelFacts, PlanError, RttMatrix

__all__ = ["Geography", "GeographyError", "read_geography"]

_GIB = 1 << 30
_TOP = ("coordinators", "pin_boundaries", "model", "node", "rtt")
_NODE = ("name", "region", "memory_gib", "ms_per_layer_1", "ms_per_layer_k", "trusted", "reachable")
_MODEL = ("n_layers", "layer_gib", "embedding_gib", "head_gib")


class GeographyError(PlanError):
    """A geography (``--rtt`` file) that cannot be used: the file, the key, what to do."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


@attrs.frozen
class Geography:
    """What a geography file says: the matrix, the nodes it profiles (file order), their
    regions, the coordinator locations, the model (None: not given) and pinning."""

    rtt: RttMatrix
    nodes: tuple[Candidate, ...] = ()
    regions: Mapping[str, str] = attrs.field(factory=dict)
    coordinators: tuple[str, ...] = ()
    model: ModelFacts | None = None
    pin_boundaries: bool = False

    def node(self, name: str) -> Candidate | None:
        """The profile of node ``name``, or None when the file gives none."""
        return next((c for c in self.nodes if c.name == name), None)


def read_geography(data: Mapping[str, object], source: str) -> Geography:
    """Validate a parsed geography. Errors: ``GeographyError``."""
    _known(source, "", data, _TOP)
    if "rtt" not in data:
        raise GeographyError(source, "rtt", "missing; give [rtt] nodes = [...] and ms = [[...]]")
    rtt = _read_rtt(source, _table(source, "rtt", data["rtt"]))
    nodes = [_read_node(source, i, t) for i, t in enumerate(_tables(source, "node", data))]
    regions = {str(t["name"]): str(t.get("region", "")) for t in _tables(source, "node", data)}
    coordinators = tuple(_strings(source, "coordinators", data.get("coordinators", [])))
    for key, names in (("node", [n.name for n in nodes]), ("coordinators", coordinators)):
        missing = [n for n in names if not rtt.has(n)]
        if missing:
            raise GeographyError(
                source, key, f"{', '.join(missing)} not in rtt.nodes; add a row and column"
            )
    model = None
    if "model" in data:
        model = _read_model(source, _table(source, "model", data["model"]))
    pin = data.get("pin_boundaries", False)
    if not isinstance(pin, bool):
        raise GeographyError(source, "pin_boundaries", f"must be true or false, got {pin!r}")
    try:
        return Geography(rtt, tuple(nodes), regions, coordinators, model, pin)
    except PlanError as e:
        raise GeographyError(source, "", str(e)) from None


def _read_rtt(source: str, table: Mapping[str, object]) -> RttMatrix:
    _known(source, "rtt", table, ("nodes", "ms"))
    names = _strings(source, "rtt.nodes", table.get("nodes"))
    rows = table.get("ms")
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise GeographyError(source, "rtt.ms", "not a matrix; give a list of rows of numbers")
    if len(rows) != len(names):
        raise GeographyError(
            source, "rtt.ms", f"not a matrix: {len(rows)} rows for {len(names)} nodes"
        )
    matrix = []
    for i, row in enumerate(rows):
        if len(row) != len(names):
            raise GeographyError(
                source, f"rtt.ms[{i}]", f"not a matrix: {len(row)} entries, expected {len(names)}"
            )
        values = [_number(source, f"rtt.ms[{i}][{j}]", v) for j, v in enumerate(row)]
        matrix.append(tuple(values))
    try:
        return RttMatrix(tuple(names), tuple(matrix))
    except PlanError as e:
        raise GeographyError(source, "rtt", str(e)) from None


def _read_node(source: str, i: int, t: Mapping[str, object]) -> Candidate:
    key = f"node[{i}]"
    _known(source, key, t, _NODE)
    for need in ("name", "memory_gib", "ms_per_layer_1", "ms_per_layer_k"):
        if need not in t:
            raise GeographyError(source, f"{key}.{need}", "missing")
    name = t["name"]
    if not isinstance(name, str) or not name:
        raise GeographyError(source, f"{key}.name", f"must be a non-empty string, got {name!r}")
    flags = {f: t.get(f, f == "reachable") for f in ("trusted", "reachable")}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise GeographyError(source, f"{key}.{flag}", f"must be true or false, got {value!r}")
    try:
        return Candidate(
            name=name,
            memory_bytes=int(_number(source, f"{key}.memory_gib", t["memory_gib"]) * _GIB),
            ms_per_layer_one=_number(source, f"{key}.ms_per_layer_1", t["ms_per_layer_1"]),
            ms_per_layer_chunk=_number(source, f"{key}.ms_per_layer_k", t["ms_per_layer_k"]),
            trusted=bool(flags["trusted"]),
            reachable=bool(flags["reachable"]),
        )
    except PlanError as e:
        raise GeographyError(source, key, str(e)) from None


def _read_model(source: str, t: Mapping[str, object]) -> ModelFacts:
    _known(source, "model", t, _MODEL)
    n = t.get("n_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GeographyError(source, "model.n_layers", f"must be an integer >= 1, got {n!r}")

    def gib(key: str) -> int:
        return int(_number(source, f"model.{key}", t.get(key, 0)) * _GIB)

    return ModelFacts(n, gib("layer_gib"), gib("embedding_gib"), gib("head_gib"))


def _number(source: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GeographyError(source, key, f"must be a number, got {value!r}")
    if value < 0:
        raise GeographyError(source, key, f"is negative ({value}); give a value >= 0")
    return float(value)


def _strings(source: str, key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GeographyError(source, key, "must be a list of node names")
    return list(value)


def _table(source: str, key: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise GeographyError(source, key, "must be a table")
    return value


def _tables(source: str, key: str, data: Mapping[str, object]) -> Sequence[Mapping[str, object]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise GeographyError(source, key, "must be a list of tables ([[node]])")
    return value


def _known(source: str, where: str, table: Mapping[str, object], keys: Sequence[str]) -> None:
    for key in table:
        if key not in keys:
            at = f"{where}.{key}" if where else key
            raise GeographyError(source, at, f"unknown key; known: {', '.join(keys)}")
