"""A ``config.json``'s fields, each read with its type and range checked.

``Fields`` wraps the parsed dict; every accessor names the field, checks its JSON type (an
integer is an integer: not a string, a bool, NaN or a fraction), its range (positive, and
under a bound no published model comes near, so a count of 2^40 layers or experts is refused
before anything loops over it) and returns a plain Python value. A refusal is one
``ModelLoadError`` line: the file, the field, what it must be and what it was.

The bounds (``MAX``) are far above every published model (the largest have ~160 layers,
16k width, 256k vocabulary, 512 experts and 10M positions) and far below what would hang or
exhaust a machine.

This module imports neither torch nor safetensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, TypeVar

__all__ = ["MAX", "Fields", "ModelLoadError"]

T = TypeVar("T")
_MISSING: Final = object()

#: Upper bounds of the counts and sizes a config may declare.
MAX: Final[dict[str, int]] = {
    "layers": 1024,
    "width": 1 << 17,  # hidden and head sizes
    "ffn": 1 << 20,  # feed-forward and expert widths
    "heads": 1024,
    "vocab": 1 << 24,
    "positions": 1 << 24,
    "experts": 4096,
}


class ModelLoadError(Exception):
    """A checkpoint cannot be used: the message says what is wrong and what to do."""


class Fields:
    """Typed access to one JSON object of a model file (``where`` names it in messages)."""

    def __init__(self, d: Any, where: str = "config.json") -> None:
        if not isinstance(d, Mapping):
            raise ModelLoadError(f"{where}: must be a JSON object, got {_kind(d)}")
        self._d, self.where = d, where

    def has(self, key: str) -> bool:
        """Whether ``key`` is present and not null."""
        return self._d.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as parsed (for a caller that checks it itself)."""
        return self._d.get(key, default)

    def integer(self, key: str, default: Any = _MISSING, *, lo: int = 1, hi: int) -> int:
        """An integer in ``[lo, hi]``; ``default`` when absent or null (required without one)."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return int(default)
        return self._int(key, value, lo, hi)

    def opt_integer(self, key: str, *, lo: int = 1, hi: int) -> int | None:
        """An integer in ``[lo, hi]``, or ``None`` when absent or null."""
        value = self._d.get(key)
        return None if value is None else self._int(key, value, lo, hi)

    def real(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        lo: float = -math.inf,
        hi: float = math.inf,
        above: bool = False,
    ) -> float:
        """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``above``); ``default`` when
        absent or null."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return float(default)
        return self.number(key, value, lo=lo, hi=hi, above=above)

    def opt_real(
        self, key: str, *, lo: float = -math.inf, hi: float = math.inf, above: bool = False
    ) -> float | None:
        """A finite number in range, or ``None`` when absent or null."""
        value = self._d.get(key)
        return None if value is None else self.number(key, value, lo=lo, hi=hi, above=above)

    def flag(self, key: str, default: bool) -> bool:
        """A boolean (``true``/``false``, or 0/1); ``default`` when absent or null."""
        value = self._d.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):
            return bool(value)
        raise self.error(key, "true or false", value)

    def text(self, key: str, default: str | None = None) -> str | None:
        """A string; ``default`` when absent or null."""
        value = self._d.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, "a string", value)
        return value

    def table(self, key: str) -> Fields | None:
        """A nested object as ``Fields``, or ``None`` when absent, null or empty."""
        value = self._d.get(key)
        if value is None or value == {}:
            return None
        if not isinstance(value, Mapping):
            raise self.error(key, "a JSON object", value)
        return Fields(value, f"{self.where} {key}")

    def integers(self, key: str, *, lo: int, hi: int, most: int) -> tuple[int, ...] | None:
        """A list of at most ``most`` integers in range (or one integer), ``None`` when absent."""
        value = self._d.get(key)
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if len(items) > most:
            raise self.error(key, f"a list of at most {most} integers", f"{len(items)} items")
        return tuple(self._int(key, v, lo, hi) for v in items)

    def texts(self, key: str, *, most: int) -> tuple[str, ...] | None:
        """A list of at most ``most`` strings, ``None`` when absent or null."""
        value = self._d.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) > most:
            raise self.error(key, f"a list of at most {most} strings", value)
        if not all(isinstance(v, str) for v in value):
            raise self.error(key, "a list of strings", value)
        return tuple(value)

    def number(
        self,
        key: str,
        value: Any,
        *,
        lo: float = -math.inf,
        hi: float = math.inf,
        above: bool = False,
    ) -> float:
        """``value`` (of field ``key``) as a finite float in range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, "a number", value)
        x = float(value)
        low_ok = x > lo if above else x >= lo
        if not (math.isfinite(x) and low_ok and x <= hi):
            low = f"above {lo:g}" if above else f"at least {lo:g}"
            bound = low if hi == math.inf else f"{low} and at most {hi:g}"
            raise self.error(key, f"a finite number {bound}", value)
        return x

    def error(self, key: str, want: str, got: Any) -> ModelLoadError:
        """The one-line refusal of field ``key``."""
        return ModelLoadError(
            f"{self.where}: {key} must be {want}, got {_show(got)}; fix or re-download the file"
        )

    def _get(self, key: str, default: Any) -> Any:
        value = self._d.get(key)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.where}: missing required field {key!r}")
            return default
        return value

    def _int(self, key: str, value: Any, lo: int, hi: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, "an integer", value)
        if not lo <= value <= hi:
            raise self.error(key, f"an integer in [{lo}, {hi}]", value)
        return value


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else type(value).__name__


def _show(value: Any, limit: int = 60) -> str:
    """A short repr of an offending value (a huge one is cut, never printed whole)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{_kind(value)} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
