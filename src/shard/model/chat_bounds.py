"""What a chat template may spend while it renders: characters, steps, seconds.

A model's chat template is code from the model's files, run on every chat request. Jinja's
sandbox keeps it away from Python's internals, but not from spending: ``{{ 'x' * 10**9 }}``,
nested ``range`` loops, a string doubled in a ``namespace`` until memory runs out. A
``Budget`` is what one render may spend (``RenderLimits``); the bounded sandbox
(``shard.model.chat_render``) charges it at every loop iteration, call, filter, attribute or
item lookup, operator and output, and refuses (``TemplateRefused``) the first one over:

- *size*: every value the template makes is checked against ``max_chars`` — before the
  allocation where its size can be foreseen (``*``, ``+``, ``%``, ``**``, ``join``,
  ``replace``, ``indent``, ``format``, ``center``-like widths, printing a value), after it
  otherwise (each such operation grows its inputs by a small factor) — and so is the
  whole output;
- *steps*: ``max_steps`` charged operations, so loops nested in loops end;
- *time*: ``max_seconds`` from the start, read at every step, so a loop of steps that are
  each cheap but many, or each a few milliseconds of copying, ends too.

Sizes are "characters ``str()`` would write", estimated without writing them (``text_size``):
a list of a thousand references to one 4 MiB string is 4 GiB of text when printed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jinja2

#: Ints a template may make: 65,536 bits is ~20,000 digits, more than any honest template
#: needs; past it ``*`` and ``**`` on ints are refused (huge ints cost time as well as memory).
MAX_INT_BITS = 65536

_DIGITS = re.compile(r"\d+")


class TemplateRefused(jinja2.TemplateError):
    """The template was stopped: it went over one of its ``RenderLimits`` (the message says
    which). A ``TemplateError``, so it ends the render like the template's own errors."""


@attrs.frozen
class RenderLimits:
    """What one render of a chat template may spend.

    ``max_chars``: the rendered text, and any value made on the way (4 MiB: 16 times the
    default ``limits.max_prompt_bytes``, room for a template's own text — system prompts,
    tool documentation — around any prompt the coordinator accepts, and ~1M tokens, more than
    any context, so nothing a model could take is refused; tokenizing that much takes well
    under a second, off the event loop). ``max_steps``: loop iterations, calls, filters,
    lookups and operators (a real template takes hundreds to a few thousand). ``max_seconds``:
    from the start of the render (a real one takes milliseconds).
    """

    max_chars: int = 4 * 1024 * 1024
    max_steps: int = 1_000_000
    max_seconds: float = 1.0


DEFAULT_LIMITS = RenderLimits()


class Budget:
    """One render's spending against its ``RenderLimits``; ``clock`` is monotonic seconds
    (injected: tests pass their own)."""

    def __init__(self, limits: RenderLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._deadline = clock() + limits.max_seconds
        self.steps = 0
        self.chars = 0
        # Sizes of containers already measured, by id, holding each (so no id is reused
        # during the render): a sandboxed template cannot change a list or dict, and a
        # template that passes ``messages`` to a macro on every turn must not walk it each time.
        self._sizes: dict[int, tuple[Any, int]] = {}

    def step(self) -> None:
        """Charge one operation. Errors: ``TemplateRefused`` past ``max_steps`` or the time."""
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise TemplateRefused(
                f"the template ran over {self.limits.max_steps} steps (loops within loops?)"
            )
        if self._clock() > self._deadline:
            raise TemplateRefused(f"the template ran over {self.limits.max_seconds:g} s")

    def output(self, chunk: str) -> None:
        """Charge ``chunk`` of rendered text. Errors: ``TemplateRefused`` past ``max_chars``."""
        self.chars += len(chunk)
        if self.chars > self.limits.max_chars:
            raise TemplateRefused(
                f"the template rendered over {self.limits.max_chars} characters "
                "(it would make a prompt far larger than any context)"
            )
        self.step()

    def fits(self, size: int, what: str) -> None:
        """Refuse making ``what`` of ``size`` characters (or items) if over ``max_chars``."""
        if size > self.limits.max_chars:
            raise TemplateRefused(
                f"the template would make {what} of over {self.limits.max_chars} characters"
            )

    def value(self, value: Any, what: str) -> Any:
        """``value``, once its text fits (``text_size``); else ``TemplateRefused``."""
        self.fits(self.size(value), what)
        return value

    def size(self, value: Any) -> int:
        """``text_size(value)``, measured once per container per render."""
        if not isinstance(value, list | dict | tuple):
            return text_size(value, self.limits.max_chars)
        known = self._sizes.get(id(value))
        if known is None:
            known = self._sizes[id(value)] = (value, text_size(value, self.limits.max_chars))
        return known[1]

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str) -> None:
        """Refuse an argument over ``max_chars``: an int as a width, count or repeat, any
        other value by its text (a value joined from checked ones, ``a ~ b``, is seen here)."""
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                self.fits(abs(arg), f"{what} sized by {arg}")
            else:
                self.fits(self.size(arg), f"{what}'s argument")


def text_size(value: Any, limit: int) -> int:
    """About how many characters ``str(value)`` writes, at least one per element; walks
    iteratively and stops once past ``limit`` (so a huge value costs ``limit`` steps)."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10 + 2
        elif isinstance(item, dict):
            total += 2 + 2 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            total += 2 + 2 * len(item)
            stack.extend(item)
        else:
            total += 64  # a float, an undefined, a macro, a namespace: short reprs
    return total


def format_size(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], limit: int) -> int:
    """At most how long ``fmt % args`` or ``fmt.format(*args, **kwargs)`` comes out: every
    field as the largest argument, every number written in ``fmt`` as a width, and every int
    argument as a width too (``'%*d'``, ``'{:{}}'``)."""
    values = [*args, *kwargs.values()]
    for arg in list(values):
        if isinstance(arg, Mapping):
            values.extend(arg.values())
        elif isinstance(arg, tuple):
            values.extend(arg)
    largest = max((text_size(v, limit) for v in values), default=0)
    fields = fmt.count("%") + fmt.count("{")
    widths = sum(int(d) for d in _DIGITS.findall(fmt)[:1000]) if fields else 0
    ints = sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))
    return len(fmt) + widths + fields * largest + (ints if fields else 0)


def binop_size(operator: str, left: Any, right: Any, limit: int) -> int:
    """The size ``left OPERATOR right`` makes (characters, or bits/``MAX_INT_BITS`` * limit
    for ints, so an oversized int is over the limit too)."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        if ints:
            return _bits(left.bit_length() + right.bit_length(), limit)
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and isinstance(seq, str):
            return max(0, times) * len(seq)
        if isinstance(times, int) and isinstance(seq, list | tuple):
            return max(0, times) * text_size(seq, limit)
    elif operator == "**" and ints and right > 0 and abs(left) > 1:
        return _bits(left.bit_length() * min(right, MAX_INT_BITS + 1), limit)
    elif operator == "+" and isinstance(left, str | list | tuple):
        return text_size(left, limit) + text_size(right, limit)
    elif operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        return format_size(left, args, {}, limit)
    return 0


def _bits(bits: int, limit: int) -> int:
    return limit + 1 if bits > MAX_INT_BITS else 0


__all__ = [
    "DEFAULT_LIMITS",
    "MAX_INT_BITS",
    "Budget",
    "RenderLimits",
    "TemplateRefused",
    "binop_size",
    "format_size",
    "text_size",
]
