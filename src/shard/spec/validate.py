"""The checks behind ``shard.spec``: a typed reader over parsed TOML and the cross-field rules.

Every failure is a ``SpecError`` whose text is one line, ``FILE: KEY: what is wrong; what to do``,
so an operator fixes a spec without reading a traceback. The table modules build the records;
this module only decides whether the input is acceptable and says why not. It is pure: no I/O,
no knowledge of the records, so each rule is a plain function with a plain test.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from datetime import date, datetime, time

import attrs

Block = tuple[int, int]


class SpecError(Exception):
    """A swarm spec is invalid. ``str()`` is one line: ``FILE: KEY: problem; fix``.

    ``key`` is the dotted path of the offending key (``stage[1].layers``), or ``""`` when the
    problem is the file itself (missing, not TOML).
    """

    def __init__(self, source: str, key: str, problem: str) -> None:
        # Passing every field to Exception keeps the error picklable (a spawned stage
        # process may report it to its parent).
        super().__init__(source, key, " ".join(problem.splitlines()))
        self.source = source
        self.key = key
        self.problem: str = self.args[2]

    def __str__(self) -> str:
        where = f"{self.source}: {self.key}" if self.key else self.source
        return f"{where}: {self.problem}"


def toml_type(value: object) -> str:
    """The TOML name of a parsed value's type, for "expected X, got Y" messages."""
    if isinstance(value, bool):
        return "boolean"
    names: tuple[tuple[type, str], ...] = (
        (int, "integer"),
        (float, "float"),
        (str, "string"),
        (list, "array"),
        (dict, "table"),
        (datetime, "date-time"),
        (date, "date"),
        (time, "time"),
    )
    return next((name for kind, name in names if isinstance(value, kind)), type(value).__name__)


def _got(value: object) -> str:
    text = repr(value)
    return f"got {toml_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


@attrs.frozen
class Table:
    """One TOML table being read: typed access by key; errors name the file and ``where.key``.

    Build with ``Table.open``, which rejects unknown keys first: a misspelt key would otherwise
    surface as a confusing "missing" error for the key the operator meant.
    """

    source: str
    where: str
    data: Mapping[str, object]

    @classmethod
    def open(
        cls, source: str, where: str, data: Mapping[str, object], known: Collection[str]
    ) -> Table:
        table = cls(source, where, data)
        for name in data:
            if name not in known:
                close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
                hint = f"did you mean '{close[0]}'? " if close else ""
                allowed = ", ".join(known)
                raise table.error(name, f"unknown key; {hint}(allowed here: {allowed})")
        return table

    def key(self, name: str) -> str:
        """The dotted path of ``name`` in this table, as error messages show it."""
        return f"{self.where}.{name}" if self.where else name

    def error(self, name: str, problem: str) -> SpecError:
        return SpecError(self.source, self.key(name), problem)

    def raw(self, name: str, example: str | None) -> object:
        """The value of ``name``; ``example`` None means optional (returns None when absent)."""
        if name in self.data:
            return self.data[name]
        if example is None:
            return None
        raise self.error(name, f"missing required key; add {name} = {example}")

    def string(self, name: str, *, default: str | None = None, example: str = '"..."') -> str:
        value = self.raw(name, example if default is None else None)
        if value is None:
            assert default is not None
            return default
        if not isinstance(value, str):
            raise self.error(name, f"expected a string, {_got(value)}")
        if not value:
            raise self.error(name, f"must not be empty; e.g. {name} = {example}")
        return value

    def boolean(self, name: str, *, default: bool) -> bool:
        value = self.raw(name, None)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"expected true or false, {_got(value)}")
        return value

    def integer(self, name: str, *, default: int, minimum: int = 1) -> int:
        value = self.raw(name, None)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"expected an integer, {_got(value)}")
        if value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def number(self, name: str, *, default: float, positive: bool = False) -> float:
        """A finite float (TOML integers accepted), >= 0, or > 0 when ``positive``."""
        value = self.raw(name, None)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(name, f"expected a number, {_got(value)}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise self.error(name, f"must be a finite number {bound}, got {value}")
        return float(value)

    def table(self, name: str, known: Collection[str], *, required: bool) -> Table:
        """The sub-table ``[name]``; an absent optional table reads as empty."""
        value = self.raw(name, f"{{...}} (a [{self.key(name)}] table)" if required else None)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise self.error(name, f"expected a table [{self.key(name)}], {_got(value)}")
        return Table.open(self.source, self.key(name), value, known)

    def tables(self, name: str, known: Collection[str]) -> list[Table]:
        """The array of tables ``[[name]]``, each opened as ``name[i]``; absent reads as []."""
        value = self.raw(name, None)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.error(
                name, f"expected an array of tables [[{self.key(name)}]], {_got(value)}"
            )
        key = self.key(name)
        return [Table.open(self.source, f"{key}[{i}]", v, known) for i, v in enumerate(value)]

    def layers(self, name: str) -> Block | None:
        """``[first, last)`` as two integers with 0 <= first < last, or ``"auto"`` (None)."""
        value = self.raw(name, None)
        if value is None or value == "auto":
            return None
        expected = 'expected [first, last] (two integers) or "auto"'
        if not isinstance(value, list) or len(value) != 2:
            raise self.error(name, f"{expected}, {_got(value)}")
        first, last = value
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (first, last)):
            raise self.error(name, f"{expected}, {_got(value)}")
        if first < 0 or first >= last:
            raise self.error(
                name, f"[{first}, {last}) is empty or negative; need 0 <= first < last"
            )
        return (first, last)


def check_unique(source: str, entries: Sequence[tuple[str, str]], what: str, fix: str) -> None:
    """Reject two entries with the same value; ``entries`` are ``(key, value)`` pairs."""
    seen: dict[str, str] = {}
    for key, value in entries:
        if value in seen:
            raise SpecError(source, key, f"duplicate {what} {value!r} (also {seen[value]}); {fix}")
        seen[value] = key


def check_layer_mode(source: str, layers: Sequence[Block | None]) -> None:
    """Either every stage says ``"auto"`` or every stage gives ``[first, last)``."""
    autos = [i for i, block in enumerate(layers) if block is None]
    if autos and len(autos) != len(layers):
        explicit = next(i for i, block in enumerate(layers) if block is not None)
        later = max(autos[0], explicit)
        raise SpecError(
            source,
            f"stage[{later}].layers",
            f'mixes "auto" (stage[{autos[0]}]) with explicit blocks (stage[{explicit}]); '
            'use "auto" on every stage or [first, last) on every stage',
        )


def check_tiling(source: str, blocks: Sequence[Block], n_layers: int | None = None) -> None:
    """Blocks must tile ``[0, n_layers)`` in ring order: start at 0, no gap, no overlap.

    With ``n_layers`` None only the order is checked (the spec alone does not know the model).
    """
    tile = "blocks must tile [0, n_layers) in ring order"
    previous: Block | None = None
    for i, (first, last) in enumerate(blocks):
        key = f"stage[{i}].layers"
        if first >= last:
            raise SpecError(source, key, f"[{first}, {last}) is empty; need first < last")
        if previous is None and first != 0:
            raise SpecError(source, key, f"starts at layer {first}; the first block starts at 0")
        if previous is not None and first > previous[1]:
            raise SpecError(
                source,
                key,
                f"gap after stage[{i - 1}] (layers [{previous[1]}, {first}) unassigned); {tile}",
            )
        if previous is not None and first < previous[1]:
            span = f"[{previous[0]}, {previous[1]}) and [{first}, {last})"
            raise SpecError(source, key, f"overlaps stage[{i - 1}] ({span}); {tile}")
        if n_layers is not None and last > n_layers:
            raise SpecError(
                source,
                key,
                f"[{first}, {last}) is out of range; the model has {n_layers} layers",
            )
        previous = (first, last)
    if n_layers is not None and previous is not None and previous[1] != n_layers:
        raise SpecError(
            source,
            f"stage[{len(blocks) - 1}].layers",
            f"last block ends at {previous[1]} but the model has {n_layers} layers; "
            f"the last block must end at {n_layers}",
        )


def even_split(source: str, n_stages: int, n_layers: int) -> tuple[Block, ...]:
    """``"auto"`` layers: equal blocks, the remainder one layer each to the earliest stages."""
    if n_stages > n_layers:
        raise SpecError(
            source,
            "stage",
            f"{n_stages} stages but the model has {n_layers} layers; "
            "remove stages so each holds at least one layer",
        )
    size, extra = divmod(n_layers, n_stages)
    blocks: list[Block] = []
    first = 0
    for i in range(n_stages):
        last = first + size + (1 if i < extra else 0)
        blocks.append((first, last))
        first = last
    return tuple(blocks)


def check_edges(source: str, ring: Sequence[str], edges: Sequence[tuple[str, str]]) -> None:
    """Each ``links.edge`` override names a known node pair that is one hop of the ring."""
    nodes = set(ring)
    hops = set(itertools.pairwise(ring))
    path = " -> ".join(ring)
    seen: set[tuple[str, str]] = set()
    for i, (src, dst) in enumerate(edges):
        for field, name in (("from", src), ("to", dst)):
            if name not in nodes:
                close = difflib.get_close_matches(name, sorted(nodes), n=1, cutoff=0.6)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise SpecError(
                    source,
                    f"links.edge[{i}].{field}",
                    f"unknown node {name!r}; {hint}(nodes: {', '.join(sorted(nodes))})",
                )
        if (src, dst) not in hops:
            raise SpecError(
                source,
                f"links.edge[{i}]",
                f"{src} -> {dst} is not a hop of the ring ({path}); "
                "an override must name two consecutive nodes",
            )
        if (src, dst) in seen:
            raise SpecError(
                source, f"links.edge[{i}]", f"{src} -> {dst} is overridden twice; keep one"
            )
        seen.add((src, dst))
