"""Strict JSON from outside (``shard.strict_json``): deep nesting, keys given twice and
NaN are refused as one-line ``ValueError``s, never a ``RecursionError``."""

from __future__ import annotations

import pytest

from shard import strict_json
from shard.strict_json import JsonRefused


def test_plain_json_reads_as_json_loads_does() -> None:
    """Ordinary JSON comes back as ``json.loads`` gives it."""
    assert strict_json.loads('{"a": [1, 2.5, "x", null, {"b": true}]}') == {
        "a": [1, 2.5, "x", None, {"b": True}]
    }


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000],
    ids=["lists", "objects"],
)
def test_nesting_past_the_parser_is_refused(text: str) -> None:
    """Nesting the C parser cannot follow is a ``JsonRefused``, not a ``RecursionError``."""
    with pytest.raises(JsonRefused, match="nested deeper"):
        strict_json.loads(text)


def test_depth_is_bounded_after_parsing() -> None:
    """64 levels read; 65 are refused (by the iterative walk), as are deeper ones anywhere."""
    assert strict_json.loads("[" * 64 + "]" * 64) is not None
    with pytest.raises(JsonRefused, match="nested more than 64 levels"):
        strict_json.loads("[" * 65 + "]" * 65)
    with pytest.raises(JsonRefused, match="nested more than 3 levels"):
        strict_json.loads('{"a": 1, "b": [[1], [[2]]]}', max_depth=3)
    strict_json.check_depth({"a": [[1]]}, 3)


def test_a_key_twice_is_refused_unless_allowed() -> None:
    """A duplicated key at any depth is refused; a reader may allow it (last one wins)."""
    with pytest.raises(JsonRefused, match="duplicate JSON key 'k'"):
        strict_json.loads('{"a": {"k": 1, "k": 2}}')
    assert strict_json.loads('{"k": 1, "k": 2}', duplicate_keys=True) == {"k": 2}


def test_nan_is_refused_unless_allowed() -> None:
    """NaN and Infinity are not JSON numbers unless the reader allows them."""
    with pytest.raises(JsonRefused, match="NaN"):
        strict_json.loads("[NaN]")
    assert strict_json.loads("[Infinity]", constants=True) == [float("inf")]


def test_refusals_are_value_errors() -> None:
    """Readers that turn ``ValueError`` into their own typed error keep doing so."""
    assert issubclass(JsonRefused, ValueError)
