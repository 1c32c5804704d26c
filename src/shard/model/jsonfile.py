"""JSON model files read with bounds: a ``config.json``, a safetensors header or index.

A model file comes from whoever published it, so reading one must cost bounded time and
memory whatever it says. ``read_json`` refuses a file over its size bound before reading it,
turns Python's ``RecursionError`` on deep nesting into the caller's typed error, and refuses
nesting deeper than ``MAX_DEPTH`` after parsing (walked without recursion), so no recursive
code downstream (attrs, cattrs, a re-encoding) can ever recurse deep on it. ``NaN`` and
``Infinity`` are not JSON and are refused too.

This module imports neither torch nor safetensors.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any, Final

__all__ = ["MAX_DEPTH", "loads_bounded", "read_json"]

#: The deepest nesting a model file may have (real ones nest 3 or 4 deep).
MAX_DEPTH: Final = 64


def read_json(path: Path, *, max_bytes: int, error: type[Exception], what: str) -> Any:
    """``path`` parsed as JSON, refused with ``error`` (one line naming ``path``) when it is
    missing, not a regular file (a FIFO would block the read), unreadable, larger than
    ``max_bytes``, not UTF-8, not JSON or nested too deep."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
        size = st.st_size
        if size > max_bytes:
            raise error(f"{path}: {size} bytes, more than a {what} may have ({max_bytes})")
        with path.open("rb") as f:
            raw = f.read(size + 1)  # a regular file of that size; more if it grows
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror or e}); re-download the model") from None
    if len(raw) > max_bytes:  # it grew
        raise error(f"{path}: more than a {what} may have ({max_bytes} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text; re-download the model") from None
    return loads_bounded(text, error=error, what=f"{path}")


def loads_bounded(text: str | bytes, *, error: type[Exception], what: str) -> Any:
    """``text`` parsed as JSON with the nesting bound; ``error`` saying ``what`` was wrong."""

    def no_constant(name: str) -> float:
        raise ValueError(f"{name} is not JSON")

    try:
        data = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise error(f"{what}: JSON nested too deep (more than {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{what}: not valid JSON ({_short(str(e))})") from None
    if _depth_over(data, MAX_DEPTH):
        raise error(f"{what}: JSON nested too deep (more than {MAX_DEPTH} levels)")
    return data


def _depth_over(data: Any, limit: int) -> bool:
    """Whether ``data`` nests deeper than ``limit`` containers (an explicit stack, no recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
