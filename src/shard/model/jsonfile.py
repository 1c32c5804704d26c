"""JSON model files read with bounds: a ``config.json``, a safetensors header or index.

A model file comes from whoever published it, so reading one must cost bounded time and
memory whatever it says. ``read_json`` refuses a file that is not a regular file or is over
its size bound before reading it, and parses with ``shard.strict_json`` (the project's one
strict parser): nesting past 64 levels (or past the C parser's reach), a key given twice (a
tensor with two byte ranges, a config with two values of one field) and ``NaN`` /
``Infinity`` are refused, each as the caller's typed error in one line.

This module imports neither torch nor safetensors.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from shard import strict_json

__all__ = ["loads_bounded", "read_json"]


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
    """``text`` parsed by ``shard.strict_json`` (nesting bounded, no key twice, no NaN);
    ``error`` saying ``what`` was wrong, in one line."""
    try:
        return strict_json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{what}: not valid JSON ({_short(str(e))})") from None


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
