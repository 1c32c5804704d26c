"""Every package's ``__init__`` docstring is its map: it names each of its modules (``name.py``)
and subpackages (``name/``), and every module it names exists — so a newcomer reading the maps
finds every file, and a moved or deleted module cannot leave a stale entry behind. The map
reads one way: no package, at any depth, imports itself through others, and no file does
either; no module is over ``MAX_LINES`` lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_import_boundaries import cycles, imports_of, module_name

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"

#: ``name.py`` not preceded by a word character, a slash or a dot (``tests/x.py``,
#: ``pkg/x.py`` and ``shard.x`` are references to other places, not entries of this map).
_LISTED = re.compile(r"(?<![\w/.])([a-z_0-9]+\.py)\b")


def _doc(init: Path) -> str:
    return ast.get_docstring(ast.parse(init.read_text())) or ""


def gaps(root: Path) -> list[str]:
    """``PACKAGE: missing NAME`` / ``PACKAGE: names NAME, which is not there`` for every
    package under ``root``."""
    out: list[str] = []
    for init in sorted(root.rglob("__init__.py")):
        package, doc = init.parent, _doc(init)
        rel = package.relative_to(root.parent)
        for path in sorted(package.iterdir()):
            if path.name.startswith(("_", ".")):
                continue
            if path.suffix == ".py" and not re.search(rf"(?<![\w.]){re.escape(path.name)}", doc):
                out.append(f"{rel}: missing {path.name}")
            if (path / "__init__.py").is_file() and f"{path.name}/" not in doc:
                out.append(f"{rel}: missing {path.name}/")
        for name in sorted(set(_LISTED.findall(doc))):
            if not any(package.rglob(name)):
                out.append(f"{rel}: names {name}, which is not there")
    return out


def test_every_package_map_is_complete_and_true() -> None:
    """Each package's docstring names all its modules and subpackages, and nothing else."""
    found = gaps(SRC)
    assert found == [], "\n".join(found)


def test_a_missing_or_stale_entry_is_reported(tmp_path: Path) -> None:
    """A module left out of its map, and a map entry whose module is gone, are both caught."""
    root = tmp_path / "shard"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text('"""Map: ``a.py`` and ``gone.py``; ``sub/``."""\n')
    (root / "a.py").write_text("")
    (root / "b.py").write_text("")
    (root / "sub" / "__init__.py").write_text('"""Nothing listed."""\n')
    (root / "sub" / "c.py").write_text("")
    found = gaps(root)
    assert "shard: missing b.py" in found
    assert "shard: names gone.py, which is not there" in found
    assert "shard/sub: missing c.py" in found
    assert not any("a.py" in line for line in found)


#: The most lines a module of ``src/shard`` may have (issue "House, second pass": ~450).
MAX_LINES = 450


def test_no_module_is_over_the_line_limit() -> None:
    """Every module of the package fits in ``MAX_LINES`` lines, so each stays one idea a
    newcomer can read through (bench scripts and tests are outside the package)."""
    long = {
        str(path.relative_to(SRC)): n
        for path in sorted(SRC.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


Graph = dict[str, dict[str, list[str]]]


def _modules(root: Path) -> dict[str, Path]:
    return {module_name(root, path): path for path in sorted(root.rglob("*.py"))}


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module ``target`` names (``shard.a.b.Name`` -> ``shard.a.b``), if it is one of ours."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _package(name: str, modules: dict[str, Path]) -> str:
    """A module's innermost package (a package's ``__init__`` is the package itself)."""
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def package_graph_at_every_depth(root: Path) -> Graph:
    """``{package: {imported package: [FILE:LINE, ...]}}`` between every package under ``root``,
    nested ones included (``shard.observe`` and ``shard.observe.tui`` are two), over every
    import, function-local ones too; the root's own modules (``errors.py``, ...) are outside."""
    modules = _modules(root)
    top = module_name(root, root / "__init__.py")
    graph: Graph = {_package(m, modules): {} for m in modules if _package(m, modules) != top}
    for name, path in modules.items():
        source = _package(name, modules)
        for line, target in imports_of(path, name):
            found = _resolve(target, modules)
            if source == top or found is None or _package(found, modules) in (source, top):
                continue
            graph[source].setdefault(_package(found, modules), []).append(f"{path.name}:{line}")
    return graph


def file_graph(root: Path) -> Graph:
    """``{module: {imported module: [LINE, ...]}}`` over every import of every file under
    ``root``: module-level, under ``if TYPE_CHECKING:`` and inside functions alike (an import
    put off until it is needed is a dependency all the same)."""
    modules = _modules(root)
    graph: Graph = {name: {} for name in modules}
    for name, path in modules.items():
        for line, target in imports_of(path, name):
            found = _resolve(target, modules)
            if found is not None and found != name:
                graph[name].setdefault(found, []).append(str(line))
    return graph


def _explain(graph: Graph) -> str:
    return "\n".join(
        f"{a} -> {b}: {', '.join(graph[a][b][:3])}"
        for members in cycles(graph)
        for a in members
        for b in members
        if b in graph[a]
    )


def test_no_package_at_any_depth_imports_itself_through_others() -> None:
    """Packages and their subpackages form layers: no cycle among them (the top-level packages'
    own check is ``tests/test_import_boundaries.py``)."""
    graph = package_graph_at_every_depth(SRC)
    assert "shard.observe.tui" in graph and "shard.cli.args" in graph  # nested ones are there
    assert cycles(graph) == [], _explain(graph)


def test_no_file_imports_itself_through_others() -> None:
    """No file circle: the modules form layers too, function-local imports included."""
    graph = file_graph(SRC)
    assert len(graph) > 300
    assert cycles(graph) == [], _explain(graph)


def test_a_package_or_file_circle_is_reported(tmp_path: Path) -> None:
    """A subpackage importing its parent's module that imports it back (from inside a function)
    is a package cycle; two files importing each other, one under ``TYPE_CHECKING`` or inside a
    function, are a circle; a package's module importing a sibling is neither."""
    root = tmp_path / "shard"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "a/__init__.py": "",
        "a/x.py": "from shard.a.y import f\nfrom shard import errors\n",
        "a/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import g\n",
        "b/__init__.py": "",
        "b/p.py": "def f():\n    from shard.b import q\n",
        "b/q.py": "from shard.b.p import f\n",
        "c/__init__.py": "",
        "c/m.py": "from shard.c.d.n import h\n",
        "c/d/__init__.py": "",
        "c/d/n.py": "def h():\n    from shard.c import m\n",
        "d/__init__.py": "",
        "d/s.py": "from shard.d.t import u\n",
        "d/t.py": "u = 1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert cycles(file_graph(root)) == [
        ["shard.a.x", "shard.a.y"],
        ["shard.b.p", "shard.b.q"],
        ["shard.c.d.n", "shard.c.m"],
    ]
    assert cycles(package_graph_at_every_depth(root)) == [["shard.c", "shard.c.d"]]
