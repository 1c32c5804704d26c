"""Config is built once, in the composition roots: no class in ``src/shard`` takes or holds the
whole swarm spec (``SwarmSpec``) — not as an ``__init__`` parameter, not as a field (an attrs
or dataclass attribute annotated in the class body). A root (a function) reads the spec and
hands each actor one frozen config with just what it reads. ``shard.spec``, which defines the
spec, is exempt."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"
SPEC_PACKAGE = SRC / "spec"
WHOLE_SPEC = "SwarmSpec"


def _names(annotation: ast.expr | None) -> set[str]:
    """Every name an annotation mentions, string annotations (``"SwarmSpec | None"``) too."""
    if annotation is None:
        return set()
    found: set[str] = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                found |= _names(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                continue
    return found


def _init_params(cls: ast.ClassDef) -> list[ast.arg]:
    for item in cls.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == "__init__":
            a = item.args
            return [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return []


def holders(source: str, where: str) -> list[str]:
    """``WHERE: CLASS.NAME`` for each ``__init__`` parameter or class-level annotated attribute
    of a class in ``source`` whose annotation mentions ``SwarmSpec``."""
    out: list[str] = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for arg in _init_params(cls):
            if WHOLE_SPEC in _names(arg.annotation):
                out.append(f"{where}: {cls.name}.__init__({arg.arg})")
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and WHOLE_SPEC in _names(item.annotation):
                out.append(f"{where}: {cls.name}.{ast.unparse(item.target)}")
    return out


def test_no_class_takes_or_holds_the_whole_swarm_spec() -> None:
    """Outside ``shard.spec``, no constructor takes a ``SwarmSpec`` and no field holds one."""
    found: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        if not path.is_relative_to(SPEC_PACKAGE):
            found += holders(path.read_text(), str(path.relative_to(SRC.parent)))
    assert found == [], "\n".join(found)


def test_a_class_holding_the_spec_is_caught() -> None:
    """A constructor parameter and attrs fields (plain, optional, quoted) are each reported;
    a function taking the spec (a root) and a class holding a part of it are not."""
    source = """
import attrs
from shard.spec import swarm
from shard.spec.swarm import SwarmSpec

class Node:
    def __init__(self, spec: SwarmSpec, *, name: str) -> None: ...

@attrs.frozen
class Handle:
    spec: swarm.SwarmSpec | None
    later: "SwarmSpec"
    limits: swarm.Limits

def run_node(spec: SwarmSpec) -> Node: ...
"""
    assert holders(source, "m.py") == [
        "m.py: Node.__init__(spec)",
        "m.py: Handle.spec",
        "m.py: Handle.later",
    ]


#: Where a function may take the whole spec: the composition roots (``nodes``, ``cli``: the
#: benchmark ``shard bench`` runs, ``cli/benchmark``, builds its swarms from a base spec) and
#: the spec itself.
ROOTS = ("nodes", "cli", "spec")


def spec_takers(root: Path) -> list[str]:
    """``path: function(param)`` for each function outside ``ROOTS`` with a parameter whose
    annotation mentions ``SwarmSpec``."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ROOTS:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = fn.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if WHOLE_SPEC in _names(arg.annotation):
                    out.append(f"{rel.as_posix()}: {fn.name}({arg.arg})")
    return out


def test_only_the_roots_take_the_whole_spec() -> None:
    """No function outside ``nodes/``, ``cli/`` and ``spec/`` takes a ``SwarmSpec`` (issue
    "House, third pass")."""
    found = spec_takers(SRC)
    assert found == [], "\n".join(found)


def test_a_function_taking_the_spec_outside_the_roots_is_caught(tmp_path: Path) -> None:
    (tmp_path / "api").mkdir()
    (tmp_path / "nodes").mkdir()
    (tmp_path / "api" / "server.py").write_text(
        "def make(spec: 'SwarmSpec', port: int) -> None: ...\n"
    )
    (tmp_path / "nodes" / "root.py").write_text("def run(spec: SwarmSpec) -> None: ...\n")
    assert spec_takers(tmp_path) == ["api/server.py: make(spec)"]
