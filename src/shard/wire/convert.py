"""The one cattrs converter: messages <-> msgpack-ready dicts, as a tagged union.

Every class in ``shard.messages.MESSAGE_TYPES`` is tagged by its class name under the key
``TAG``. Structuring is strict where cattrs is lenient by default: an int field takes only an
int (not a bool, float or digit string) within int64, a str only a str, a bool only a bool, a
sequence only a msgpack array, and unknown keys are errors. Floats also accept ints (lossless,
and what msgpack gives back for a float that was built as ``0``). ``Tensor`` passes through
untouched both ways: the frame codec swaps it for a descriptor plus raw payload (see
``shard.wire.tensors``).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception, transform_error

from shard.messages import MESSAGE_TYPES, Message, Tensor
from shard.wire.limits import INT64_MAX, INT64_MIN

#: Key of the message tag in the header map.
TAG = "t"

#: Tag -> message class; tags are class names.
TAGS: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}


class FieldError(ValueError):
    """A value of the wrong type or range; ``explain`` reports its message as is."""


def _structure_int(value: object, _: type) -> int:
    if type(value) is not int:
        raise FieldError(f"expected int, got {type(value).__name__}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise FieldError(f"int {value} is outside int64")
    return value


def _structure_float(value: object, _: type) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise FieldError(f"expected float, got {type(value).__name__}")


def _structure_str(value: object, _: type) -> str:
    if type(value) is not str:
        raise FieldError(f"expected str, got {type(value).__name__}")
    return value


def _structure_bool(value: object, _: type) -> bool:
    if type(value) is not bool:
        raise FieldError(f"expected bool, got {type(value).__name__}")
    return value


def _structure_tensor(value: object, _: type) -> Tensor:
    # Only the frame codec's ext hook makes Tensors; a map in a tensor slot is forged.
    if type(value) is not Tensor:
        raise FieldError(f"expected a tensor descriptor, got {type(value).__name__}")
    return value


def _is_homogeneous_tuple(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_hook_factory(
    tp: Any, conv: cattrs.Converter
) -> Callable[[object, type], tuple[object, ...]]:
    """``tuple[X, ...]`` from a list or tuple only (cattrs would take any iterable, even a map)."""
    item_type = typing.get_args(tp)[0]
    item_hook = conv.get_structure_hook(item_type)

    def structure(value: object, _: type) -> tuple[object, ...]:
        if not isinstance(value, list | tuple):
            raise FieldError(f"expected an array, got {type(value).__name__}")
        out = []
        for index, item in enumerate(value):
            try:
                out.append(item_hook(item, item_type))
            except Exception as exc:
                # Fail on the first bad item, but keep its index for explain()'s path.
                note = IterableValidationNote(f"Structuring {tp} @ index {index}", index, item_type)
                exc.__notes__ = [*getattr(exc, "__notes__", []), note]
                raise IterableValidationError(f"While structuring {tp!r}", [exc], tp) from None
        return tuple(out)

    return structure


def _check_tag_free(classes: tuple[type, ...]) -> None:
    for cls in classes:
        if any(field.name == TAG for field in attrs.fields(cls)):
            raise TypeError(f"{cls.__name__} has a field named {TAG!r}, the wire's tag key")


@functools.cache
def converter() -> cattrs.Converter:
    """The one converter for every message, built once; for the codec, tests and debugging."""
    _check_tag_free(MESSAGE_TYPES)
    conv = cattrs.Converter(forbid_extra_keys=True, omit_if_default=True)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(Tensor, _structure_tensor)
    conv.register_unstructure_hook(Tensor, lambda tensor: tensor)
    conv.register_structure_hook_factory(_is_homogeneous_tuple, _tuple_hook_factory)
    configure_tagged_union(Message, conv, tag_generator=lambda cls: cls.__name__, tag_name=TAG)
    return conv


def _format(exc: BaseException, tp: type | None) -> str:
    if isinstance(exc, FieldError):
        return str(exc)
    if isinstance(exc, AttributeError):
        return "expected a map"  # cattrs calls .keys() on what should be a nested class's map
    if isinstance(exc, TypeError) and tp is not None and attrs.has(tp):
        return "expected a map"  # ... or, for a class with defaults, tests ``key in`` it
    return format_exception(exc, tp)


def explain(exc: Exception, *, most: int = 3) -> str:
    """A short reason for a structuring failure: the first few problems with their paths.

    Example: ``"expected int, got bool @ $.start"``.
    """
    if isinstance(exc, cattrs.BaseValidationError):
        lines = transform_error(exc, format_exception=_format)
        more = f" (+{len(lines) - most} more)" if len(lines) > most else ""
        return "; ".join(lines[:most]) + more
    return _format(exc, None)
