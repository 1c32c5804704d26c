"""Actors talk on channels, not through call-backs handed in (issue "House, third pass"): no
parameter or attrs field named ``on_*`` carries a callable in ``src/shard``, outside
``observe/tui`` (Textual's own message handlers are methods named ``on_*``, not parameters).

A parameter counts when its annotation names a callable (``Callable``, ``Awaitable``) or it
has none; ``on_demand: bool`` and other plain values are not call-backs.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"
EXEMPT = ("observe/tui/",)
CALLABLE_WORDS = ("Callable", "Awaitable", "Coroutine")


def _is_callback(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return True
    text = ast.unparse(annotation)
    return any(word in text for word in CALLABLE_WORDS)


def callbacks(root: Path) -> list[str]:
    """``path:line name`` for each ``on_*`` parameter or class field that takes a callable."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(EXEMPT):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                a = node.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                    if arg.arg.startswith("on_") and _is_callback(arg.annotation):
                        found.append(f"{rel}:{arg.lineno} {arg.arg}")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and item.target.id.startswith("on_")
                        and _is_callback(item.annotation)
                    ):
                        found.append(f"{rel}:{item.lineno} {item.target.id}")
    return found


def test_no_on_parameter_or_field_carries_a_call_back() -> None:
    found = callbacks(SRC)
    assert found == [], "call-backs handed in (send on a channel instead):\n" + "\n".join(found)


def test_a_call_back_parameter_or_field_is_reported(tmp_path: Path) -> None:
    """The check finds an ``on_*`` parameter and field typed as callables (and one without a
    type), and lets plain values and exempt paths be."""
    (tmp_path / "observe" / "tui").mkdir(parents=True)
    (tmp_path / "a.py").write_text(
        "from collections.abc import Callable\n"
        "def f(x: int, on_done: Callable[[int], None]) -> None: ...\n"
        "async def g(*, on_any) -> None: ...\n"
        "def h(on_demand: bool = False) -> None: ...\n"
        "class C:\n"
        "    on_exit: Callable[[], None]\n"
        "    on_flag: bool = True\n"
    )
    (tmp_path / "observe" / "tui" / "app.py").write_text("def on_key(on_event) -> None: ...\n")
    assert callbacks(tmp_path) == ["a.py:2 on_done", "a.py:3 on_any", "a.py:6 on_exit"]
