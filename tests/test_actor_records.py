"""Each actor takes one record made for it, its channels and its clock (issue "House, third
pass"): no constructor of an actor in ``src/shard`` — a class with a ``run`` method, the
shape every actor has — takes more than ``MAX_PARAMETERS`` parameters. A long parameter list
is a record waiting to be made (``shard.coordinator.config``, ``shard.stage.config``,
``shard.failover.scheduler_config``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"
MAX_PARAMETERS = 8


def constructors(root: Path) -> dict[str, int]:
    """``path:Class`` -> the parameters of its ``__init__`` (``self`` not counted), for each
    class of ``root`` with a ``run`` method (attrs classes: their annotated fields)."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            methods = {
                m.name: m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            if "run" not in methods:
                continue
            key = f"{path.relative_to(root).as_posix()}:{cls.name}"
            init = methods.get("__init__")
            if init is not None:
                a = init.args
                out[key] = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
            else:
                fields = [s for s in cls.body if isinstance(s, ast.AnnAssign)]
                out[key] = len(fields)
    return out


def test_no_actor_takes_more_than_eight_parameters() -> None:
    found = constructors(SRC)
    assert "coordinator/coordinator.py:Coordinator" in found  # the scan sees the actors
    long = {k: n for k, n in found.items() if n > MAX_PARAMETERS}
    assert long == {}, f"actors with more than {MAX_PARAMETERS} parameters: {long}"


def test_a_long_constructor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "class Long:\n"
        "    def __init__(self, a, b, c, d, e, f, g, *, h, i): ...\n"
        "    async def run(self): ...\n"
        "class NotAnActor:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h, i, j): ...\n"
    )
    assert constructors(tmp_path) == {"a.py:Long": 9}
