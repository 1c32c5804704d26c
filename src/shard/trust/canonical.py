"""Strict canonical JSON for signed record files (run receipts, audit evidence).

A record file is written one way only — every field, sorted keys, two-space indent, ASCII,
no NaN, a final newline — and read back only if it is exactly that: no duplicate keys, no
NaN/Infinity, every field of the right type and no other, and the same bytes when written
again. So two spellings of one record cannot both verify.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import attrs
import cattrs

from shard import strict_json
from shard.wire.convert import converter, explain

T = TypeVar("T")

__all__ = ["as_body", "from_canonical_json", "to_canonical_json"]


def _kept(field: attrs.Attribute[Any], value: Any) -> bool:
    return not (field.metadata.get("omit_empty") and not value)


def as_body(record: Any) -> dict[str, Any]:
    """``record`` (an attrs instance) as plain data, every field but empty ``omit_empty`` ones
    (at any depth)."""
    return attrs.asdict(record, recurse=True, filter=_kept)


def to_canonical_json(record: Any) -> str:
    """``record`` (an attrs instance) as its one file spelling."""
    body = as_body(record)
    return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n"


def from_canonical_json(
    text: str, cls: type[T], *, error: type[Exception], what: str, canonical: str
) -> T:
    """Parse ``text`` as a ``cls`` file, strictly (see the module docstring).

    ``what`` names the record in messages ("a shard run receipt (version 2)"); ``canonical``
    is the message for a file that parses but is not spelt canonically.

    Errors: ``error`` saying what is wrong.
    """

    try:
        data = strict_json.loads(text)
    except ValueError as exc:  # not JSON, a key twice, NaN, or nested too deep
        raise error(f"not {what}: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"not {what}: expected a JSON object")
    try:
        record = converter().structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, AttributeError) as exc:
        raise error(f"not {what}: {explain(exc)}") from None
    if to_canonical_json(record) != text:
        raise error(canonical)
    return record
