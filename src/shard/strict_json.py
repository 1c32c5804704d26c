"""JSON text from outside, parsed so that it cannot crash or fool its reader.

``loads`` is ``json.loads`` with three refusals, each a ``JsonRefused`` (a ``ValueError``, so
a reader that already turns ``ValueError`` into its own typed error keeps doing so):

- nesting deeper than ``max_depth`` (default ``MAX_DEPTH``). The C parser itself recurses and
  ends in ``RecursionError`` near Python's recursion limit (``[`` * 100000), which is caught
  here; and a value that parses is then walked iteratively, so later recursive code
  (cattrs structuring, canonical re-encoding, ``attrs.asdict``) never recurses deep;
- a duplicated key in any object (``{"signature": good, "signature": other}``), unless the
  reader allows it: for a signed record, two values of one key mean two readings of one file;
- ``NaN`` / ``Infinity``, unless the reader allows them.

It lives at the top of the package with no shard imports, like ``shard.errors``, so every
layer that reads JSON from a peer or a file (manifests, receipts, the HTTP API, checkpoints)
can use it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "JsonRefused", "check_depth", "loads"]

#: Nesting any record of this project needs, with room to spare: a manifest is 5 deep, a run
#: receipt 6, a chat request's tool schemas rarely 10.
MAX_DEPTH = 64


class JsonRefused(ValueError):
    """The text is JSON this reader will not take: too deep, a key twice, or a non-number."""


def loads(
    text: str | bytes | bytearray,
    *,
    max_depth: int = MAX_DEPTH,
    duplicate_keys: bool = False,
    constants: bool = False,
) -> Any:
    """``text`` parsed as JSON, refusing what the module docstring lists.

    Errors: ``ValueError`` — ``json.JSONDecodeError`` for text that is not JSON,
    ``JsonRefused`` for JSON refused here; both say what is wrong in one line.
    """
    try:
        value = json.loads(
            text,
            object_pairs_hook=None if duplicate_keys else _no_duplicates,
            parse_constant=None if constants else _no_constant,
        )
    except RecursionError:
        raise JsonRefused(
            f"nested deeper than the parser can follow (at most {max_depth} levels are read)"
        ) from None
    check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse ``value`` (parsed JSON: dicts, lists, scalars) if it nests deeper than
    ``max_depth``; walks iteratively, so a deep value cannot exhaust the stack here.

    Errors: ``JsonRefused``."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            raise JsonRefused(f"nested more than {max_depth} levels deep")
        stack.extend((child, depth + 1) for child in children)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonRefused(f"duplicate JSON key {key!r} (one value per key)")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise JsonRefused(f"{name} is not a JSON number")
