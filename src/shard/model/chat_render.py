"""A chat template rendered in a bounded sandbox: ``compile_template`` once, ``render`` per chat.

The environment is the one ``transformers`` renders chat templates with (Jinja's
``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, loop controls,
``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``), so a template
renders exactly as it does there. On top, every place a template can spend is charged to the
render's ``Budget`` (``shard.model.chat_bounds``), and the first charge over its
``RenderLimits`` stops the render with ``TemplateRefused``:

- every ``for`` loop's iterable is wrapped (at parse time) in a guard that charges a step per
  item, so loops nested in loops end, and so is the input of every filter that loops in
  Python (``select``, ``map``, ``batch``, ...); every call, filter, attribute and item lookup
  charges a step; the time is read at each. Filters that work word by word in Python
  (``urlize``, ``wordwrap``, ``title``, ...) take bounded input, and ``lipsum`` a bounded
  count;
- ``*``, ``**``, ``+`` and ``%`` are intercepted (``intercepted_binops``) and refused before
  they allocate too much; calls and filters have their arguments bounded (ints as widths
  and counts, other values by their text) and the amplifying ones (``join``, ``replace``,
  ``indent``, ``format``, ``expandtabs``, ``wordwrap``) their results foreseen; every
  result, ``namespace`` assignment, captured block (``environment.concat``), ``~``
  (``environment.shard_concat``, at parse time) and printed value (``finalize``) is checked;
- ``render`` streams the output (``Template.generate``) and stops once it is over
  ``max_chars``.

What is left: a literal list or dict of checked values (``[a, b, c]``) holds references
only, and is measured before it is printed, passed or joined; C-level work on a value already
within bounds (a regular expression over 4 MiB, a sort of a million items) runs to its end,
which is why the bound is a few MiB and not more. The render
runs synchronously: callers that serve others run it in a worker thread
(``shard.coordinator.text``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor
from jinja2.runtime import Context, markup_join, str_join
from jinja2.utils import Namespace, generate_lorem_ipsum

from shard.model.chat_bounds import (
    DEFAULT_LIMITS,
    Budget,
    RenderLimits,
    TemplateRefused,
    binop_size,
    format_size,
    text_size,
)

#: The render in progress in this thread (a context variable: threads render independently).
_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "shard_chat_budget", default=None
)

#: ``tojson``'s indent beyond this is refused: it multiplies with every nested item.
MAX_JSON_INDENT = 16

#: Filters that loop over their input in Python: the input is fed through ``shard_iterate``,
#: so each item is a step (and the clock is read), as in a ``for`` loop.
_ITERATING = frozenset(
    {
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "map",
        "batch",
        "slice",
        "unique",
        "groupby",
        "join",
        "min",
        "max",
        "sort",
    }
)

#: Text filters that work word by word in Python, slowly (urlize: ~7 µs a character): their
#: input is bounded (characters), far above a chat template's use and far below a second.
_SLOW_TEXT = {
    "urlize": 64 * 1024,
    "pprint": 64 * 1024,
    "wordwrap": 256 * 1024,
    "title": 256 * 1024,
    "striptags": 256 * 1024,
}

#: ``lipsum`` beyond these (paragraphs, words) is refused: it loops in Python without steps.
MAX_LIPSUM = (100, 1000)


def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in the bounded sandbox. Errors: ``jinja2.TemplateSyntaxError``."""
    return BoundedSandbox().from_string(source)


def render(
    template: jinja2.Template,
    variables: Mapping[str, Any],
    limits: RenderLimits = DEFAULT_LIMITS,
    *,
    clock: Callable[[], float] | None = None,
) -> str:
    """``template`` (from ``compile_template``) rendered with ``variables`` within ``limits``
    (``clock``: monotonic seconds for the time limit, by default ``time.monotonic``).

    Errors: ``TemplateRefused`` over a limit; the template's own errors
    (``jinja2.TemplateError``, and Python's, e.g. ``TypeError``) as they are raised.
    """
    budget = Budget(limits) if clock is None else Budget(limits, clock)
    token = _BUDGET.set(budget)
    try:
        pieces = []
        for chunk in template.generate(variables):
            budget.output(chunk)
            pieces.append(chunk)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)


def _budget() -> Budget:
    budget = _BUDGET.get()
    if budget is None:  # compile-time constant folding: let it run at render time instead
        raise TemplateRefused("not rendering")
    return budget


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The chat-template environment, charging every operation to the render's ``Budget``
    (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
            finalize=_finalize,
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["namespace"] = BoundedNamespace
        self.globals["lipsum"] = _lipsum

    @staticmethod
    def concat(parts: Iterable[str]) -> str:
        """A captured block's text (``{% set %}…``, a macro's body): refused before joining
        if over the bound."""
        pieces = list(parts)
        budget = _budget()
        budget.fits(sum(len(p) for p in pieces), "a block of text")
        return "".join(pieces)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """Parse, then wrap every ``for`` loop's iterable in ``environment.shard_iterate`` and
        make every ``a ~ b ~ …`` a call of ``environment.shard_concat`` (environment
        attributes: a template cannot shadow them)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = _call("shard_iterate", loop.iter)
        return _ConcatChecked().visit(tree)  # type: ignore[no-any-return]

    @staticmethod
    @jinja2.pass_eval_context
    def shard_concat(eval_ctx: jinja2.nodes.EvalContext, items: list[Any]) -> str:
        """``a ~ b ~ …`` as Jinja joins it, refused before joining if over the bound."""
        budget = _budget()
        budget.fits(sum(budget.size(item) for item in items), "'~'")
        join = markup_join if eval_ctx.autoescape or eval_ctx.volatile else str_join
        return join(items)

    @staticmethod
    def shard_iterate(items: Iterable[Any]) -> Iterator[Any]:
        """``items``, charging a step for each."""
        budget = _budget()
        for item in items:
            budget.step()
            yield item

    # Jinja's own spelling (__self): a call's keyword arguments may be named "self".
    def call(
        __self,
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = _budget()
        budget.step()
        budget.arguments(args, kwargs, "a call")
        _foresee_str_method(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.value(result, "a call's result")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.fits(binop_size(operator, left, right, budget.limits.max_chars), f"'{operator}'")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().step()
        return super().getitem(obj, argument)


def _call(attribute: str, argument: jinja2.nodes.Node) -> jinja2.nodes.Call:
    """The node of ``environment.ATTRIBUTE(argument)``."""
    target = jinja2.nodes.EnvironmentAttribute(attribute, lineno=argument.lineno)
    return jinja2.nodes.Call(target, [argument], [], None, None, lineno=argument.lineno)


class _ConcatChecked(jinja2.visitor.NodeTransformer):
    """Turns each ``Concat`` (``a ~ b``) into ``environment.shard_concat([a, b])``."""

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return _call("shard_concat", jinja2.nodes.List(node.nodes, lineno=node.lineno))


class BoundedNamespace(Namespace):
    """``namespace()`` whose assignments (``{% set ns.x = … %}``) are size-checked, so a value
    doubled in a loop is refused at the bound."""

    def __setitem__(self, name: str, value: Any) -> None:
        budget = _budget()
        budget.step()
        Namespace.__setitem__(self, name, budget.value(value, "a namespace value"))


def _finalize(value: Any) -> Any:
    """Every printed value (``{{ … }}``) before ``str()`` writes it."""
    budget = _BUDGET.get()
    return value if budget is None else budget.value(value, "a printed value")


def _foresee_str_method(budget: Budget, obj: Any, args: Any, kwargs: Any) -> None:
    """Refuse a ``str`` method call whose result would be over the bound, before it runs."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return
    limit = budget.limits.max_chars
    name = getattr(method, "__name__", "")
    if name in ("format", "format_map"):
        size = format_size(text, tuple(args), kwargs, limit)
    elif name == "replace" and len(args) >= 2:
        size = _replace_size(text, str(args[0]), str(args[1]))
    elif name == "join" and args and isinstance(args[0], list | tuple):
        size = text_size(list(args[0]), limit) + len(text) * len(args[0])
    elif name == "expandtabs":
        size = len(text) + text.count("\t") * int(args[0] if args else 8)
    elif name in ("translate", "maketrans"):
        raise TemplateRefused(f"the template may not call str.{name}")
    else:
        return
    budget.fits(size, f"str.{name}()")


def _replace_size(text: str, old: str, new: str) -> int:
    count = len(text) + 1 if not old else text.count(old)
    return len(text) + count * (len(new) - len(old))


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` charging a step, its arguments bounded, its result checked (and the amplifying
    filters' results foreseen)."""
    try:
        signature: inspect.Signature | None = inspect.signature(f)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.arguments(args, kwargs, f"'{name}'")
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                pass  # the filter raises its own error below
            else:
                bound.apply_defaults()
                _foresee_filter(budget, name, bound.arguments)
                value = bound.arguments.get("value")
                if name in _ITERATING and isinstance(value, Iterable):
                    bound.arguments["value"] = BoundedSandbox.shard_iterate(value)
                    args, kwargs = bound.args, bound.kwargs
        return budget.value(f(*args, **kwargs), f"'{name}'")

    return bounded


def _foresee_filter(budget: Budget, name: str, a: dict[str, Any]) -> None:
    limit = budget.limits.max_chars
    text = a.get("s", a.get("value"))
    if name in _SLOW_TEXT and budget.size(text) > _SLOW_TEXT[name]:
        raise TemplateRefused(
            f"the template would run '{name}' on over {_SLOW_TEXT[name]} characters"
        )
    if name == "join" and isinstance(text, list | tuple):
        size = text_size(list(text), limit) + len(str(a.get("d", ""))) * len(text)
    elif name == "replace" and isinstance(text, str):
        size = _replace_size(text, str(a.get("old", "")), str(a.get("new", "")))
    elif name == "indent" and isinstance(text, str):
        width = a.get("width", 4)
        per_line = width if isinstance(width, int) else len(str(width))
        size = len(text) + (text.count("\n") + 1) * per_line
    elif name == "wordwrap" and isinstance(text, str):
        wrap = a.get("wrapstring") or "\n"
        size = len(text) + (len(text) // max(1, int(a.get("width", 79))) + 1) * len(wrap)
    elif name == "format" and isinstance(text, str):
        size = format_size(text, tuple(a.get("args", ())), a.get("kwargs", {}), limit)
    elif name == "sum" and not isinstance(a.get("start", 0), int | float):
        raise TemplateRefused("the template may only sum numbers")
    else:
        return
    budget.fits(size, f"'{name}'")


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson escapes HTML characters, which changes what the model sees.
    if indent is not None and indent > MAX_JSON_INDENT:
        raise TemplateRefused(f"tojson indent {indent} is over {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's ``lipsum``, bounded (``MAX_LIPSUM``)."""
    if n > MAX_LIPSUM[0] or max > MAX_LIPSUM[1]:
        raise TemplateRefused(f"lipsum({n}, max={max}) is over {MAX_LIPSUM}")
    return str(generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


__all__ = ["BoundedNamespace", "BoundedSandbox", "compile_template", "render"]
