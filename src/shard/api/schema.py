"""Request validation: an OpenAI request body (parsed JSON) in, a typed ``Generation`` out.

Pure: every rule is a plain function of the body, so each has a plain test. Every number is
checked against the one table of bounds (``shard.messages.bounds``: what the wire and the
model can carry) and every text is checked to be valid Unicode (a lone surrogate is a 400,
never a tokenizer crash). Anything shard cannot honour is refused with a 400 that names the
parameter — ``n > 1``, ``logprobs``,
``tools``, penalties, an unknown key — never silently ignored; a parameter given at its no-op
value (``n = 1``, ``logprobs = false``, ``presence_penalty = 0``) is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from shard.api.errors import ApiError, bad_param
from shard.messages.bounds import BOUNDS, OutOfBounds

#: Stop strings one request may give (OpenAI allows 4; more costs nothing here), and the
#: characters each may have: the table's (``shard.messages.bounds``).
MAX_STOPS: Final = int(BOUNDS["stops"].high)
MAX_STOP_CHARS: Final = int(BOUNDS["stop_chars"].high)
#: A seed (any signed 64-bit integer) is taken modulo this: the sampler's seed space.
SEED_RANGE: Final = 1 << 63


@attrs.frozen
class ChatMessage:
    """One turn of a conversation: ``role`` is system, user or assistant."""

    role: str
    content: str


@attrs.frozen
class Generation:
    """A validated request. ``prompt`` is text or token ids (completions) and ``messages``
    the conversation (chat: rendered with the model's own template); ``max_tokens`` None
    means the rest of the context; ``seed`` None means a fresh random one."""

    chat: bool
    model: str
    prompt: str | tuple[int, ...] = ""
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _is_noop(*values: object) -> Callable[[object], bool]:
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


#: Parameters shard does not implement, each with the values that mean "not used".
_UNSUPPORTED: Final[Mapping[str, Callable[[object], bool]]] = {
    "n": _is_noop(1),
    "best_of": _is_noop(1),
    "logprobs": _is_noop(False),
    "top_logprobs": _is_noop(0),
    "echo": _is_noop(False),
    "suffix": _is_noop(""),
    "logit_bias": _is_noop({}),
    "presence_penalty": _is_noop(0, 0.0),
    "frequency_penalty": _is_noop(0, 0.0),
    "tools": _is_noop([]),
    "tool_choice": _is_noop("none"),
    "functions": _is_noop([]),
    "function_call": _is_noop("none"),
    "parallel_tool_calls": _is_noop(),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": _is_noop(["text"]),
    "audio": _is_noop(),
    "prediction": _is_noop(),
    "store": _is_noop(False),
    "metadata": _is_noop(),
    "reasoning_effort": _is_noop(),
    "web_search_options": _is_noop(),
    "service_tier": _is_noop("auto", "default"),
}
_COMMON: Final = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
)


def parse_completion(body: object) -> Generation:
    """Validate a ``POST /v1/completions`` body. Errors: ``ApiError`` (400)."""
    data = _object(body, known=(*_COMMON, "prompt"))
    common = _common(data, default_max_tokens=16)
    return attrs.evolve(common, chat=False, prompt=_prompt(data.get("prompt")))


def parse_chat(body: object) -> Generation:
    """Validate a ``POST /v1/chat/completions`` body. Errors: ``ApiError`` (400)."""
    data = _object(body, known=(*_COMMON, "messages"))
    common = _common(data, default_max_tokens=None)
    return attrs.evolve(common, chat=True, messages=_messages(data.get("messages")))


def _object(body: object, *, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for key, value in body.items():
        if key in _UNSUPPORTED:
            if not _UNSUPPORTED[key](value):
                raise bad_param(
                    key,
                    f"not supported by shard (got {_show(value)}); leave it out",
                    code="unsupported_parameter",
                )
        elif key not in known:
            raise bad_param(key, "unrecognized request argument", code="unrecognized_parameter")
    return body


def _common(data: dict[str, Any], *, default_max_tokens: int | None) -> Generation:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", f"expected the model id as a string, got {_show(model)}")
    max_tokens = _optional_int(data, "max_completion_tokens", bound="max_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(data, "max_tokens")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_param("stream", f"expected true or false, got {_show(stream)}")
    top_k = -1 if data.get("top_k") == -1 else _optional_int(data, "top_k")  # -1: all
    seed = _optional_int(data, "seed")
    _optional_str(data, "user")
    return Generation(
        chat=False,
        model=model,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=_number(data, "temperature", default=1.0),
        top_p=_number(data, "top_p", default=1.0),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        seed=None if seed is None else seed % SEED_RANGE,
        stop=_stops(data.get("stop")),
        stream=stream,
        include_usage=_stream_options(data.get("stream_options"), stream),
    )


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _optional_int(data: dict[str, Any], key: str, *, bound: str | None = None) -> int | None:
    """``data[key]`` (None when absent) within ``BOUNDS[bound or key]``; an integral float
    (``12.0``) counts as its integer."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(key, f"expected an integer, got {_show(value)}")
    _bounded(key, value, bound or key)
    return value


def _bounded(key: str, value: object, bound: str) -> None:
    try:
        BOUNDS[bound].check(key, value)
    except OutOfBounds as exc:
        raise bad_param(key, exc.message) from None


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_param(key, f"expected a string, got {_show(value)}")
    return value


def _number(data: dict[str, Any], key: str, *, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_param(key, f"expected a number, got {_show(value)}")
    _bounded(key, value, key)
    return float(value)


def _text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode; a lone surrogate (JSON's ``"\\ud800"``) cannot be
    encoded, tokenized or echoed back, so it is a 400 naming where it is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_param(
            param,
            f"not valid Unicode text: a lone surrogate {value[exc.start]!r} at index "
            f"{exc.start}; send UTF-8 text",
        ) from None
    return value


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", f"expected a string or a list of strings, got {_show(value)}")
    if len(stops) > MAX_STOPS:
        raise bad_param("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_param("stop", f"each stop string needs 1..{MAX_STOP_CHARS} characters")
        _text(s, "stop")
    return tuple(dict.fromkeys(stops))


def _stream_options(value: object, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise bad_param("stream_options", "only allowed with stream = true")
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise bad_param("stream_options", f"expected {{'include_usage': bool}}, got {_show(value)}")
    usage = value.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_param(
            "stream_options", f"include_usage must be true or false, got {_show(usage)}"
        )
    return usage


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # one prompt in a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_param("prompt", "the prompt is empty: nothing to condition on")
        return _text(value, "prompt")
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        raise bad_param("prompt", f"{len(value)} prompts in one request; send one per request")
    raise bad_param("prompt", f"expected a string or a list of token ids, got {_show(value)}")


_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad_param("messages", f"expected a non-empty list of messages, got {_show(value)}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_param(
                where, f"expected an object with role and content, got {_show(message)}"
            )
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad_param(f"{where}.{sorted(extra)[0]}", "not supported by shard; leave it out")
        role = message.get("role")
        if role not in _ROLES:
            known = ", ".join(_ROLES)
            raise bad_param(f"{where}.role", f"expected one of {known}, got {_show(role)}")
        out.append(ChatMessage(_ROLES[str(role)], _content(message.get("content"), where)))
    return tuple(out)


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return _text(value, f"{where}.content")
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_param(
                    f"{where}.content[{j}]", "only text parts are supported (type = 'text')"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_param(
                    f"{where}.content[{j}].text", f"expected a string, got {_show(text)}"
                )
            parts.append(_text(text, f"{where}.content[{j}].text"))
        return "".join(parts)
    raise bad_param(f"{where}.content", f"expected a string or text parts, got {_show(value)}")
