"""Every package's ``__init__`` docstring is its map: it names each of its modules (``name.py``)
and subpackages (``name/``), and every module it names exists — so a newcomer reading the maps
finds every file, and a moved or deleted module cannot leave a stale entry behind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
