"""Request validation for the HTTP API (``shard.api.schema``): what is accepted, and that
every parameter shard cannot honour is refused with a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shard.api.errors import ApiError
from shard.api.schema import ChatMessage, parse_chat, parse_completion
from shard.messages.bounds import BOUNDS, INT64_MAX, INT64_MIN, MAX_COUNT


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def refused(parse: Any, body: object) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


def test_a_chat_request_reads_into_a_generation() -> None:
    """Messages, sampling, stop strings and stream options land in the typed record."""
    g = parse_chat(
        chat(
            max_completion_tokens=12,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=-1,
            stop="\n",
            stream=True,
            stream_options={"include_usage": True},
            n=1,
            logprobs=False,
            presence_penalty=0,
        )
    )
    assert g.chat and g.messages == (ChatMessage("user", "hi"),)
    assert (g.max_tokens, g.temperature, g.top_p, g.top_k) == (12, 0.5, 0.9, 40)
    assert g.seed == (1 << 63) - 1  # negative seeds wrap into the wire's range
    assert g.stop == ("\n",) and g.stream and g.include_usage


def test_defaults_follow_openai() -> None:
    """Temperature 1, no seed (a fresh one per request), chat to the end of the context,
    completions 16 tokens."""
    g = parse_chat(chat())
    assert (g.temperature, g.seed, g.max_tokens, g.stream) == (1.0, None, None, False)
    assert parse_completion({"model": "m", "prompt": "x"}).max_tokens == 16


def test_completion_prompts_are_text_or_token_ids() -> None:
    """A string, a batch of one, or token ids; a batch of several is refused."""
    assert parse_completion({"model": "m", "prompt": ["hello"]}).prompt == "hello"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    err = refused(parse_completion, {"model": "m", "prompt": ["a", "b"]})
    assert err.param == "prompt" and "one per request" in err.message


def test_content_parts_join_and_developer_is_system() -> None:
    """Text parts are concatenated; the ``developer`` role reads as ``system``."""
    g = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert g.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "ab"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n", 2),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("logit_bias", {"1": 5}),
        ("response_format", {"type": "json_object"}),
        ("parallel_tool_calls", True),
        ("audio", {"voice": "x"}),
    ],
)
def test_unsupported_parameters_are_named(key: str, value: object) -> None:
    """A parameter shard does not implement gets a 400 that names it."""
    err = refused(parse_chat, chat(**{key: value}))
    assert err.param == key and err.code == "unsupported_parameter"
    assert key in err.message


def test_unknown_parameters_are_refused() -> None:
    """A key OpenAI does not define either is refused, never ignored."""
    err = refused(parse_chat, chat(temprature=0))
    assert err.param == "temprature" and err.code == "unrecognized_parameter"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model", 3),
        ("max_tokens", "12"),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("temperature", "hot"),
        ("temperature", 100.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0),
        ("top_p", 1e309),
        ("top_k", -2),
        ("top_k", 1 << 63),  # past what the wire carries: refused here, not on the ring
        ("top_k", 1 << 64),
        ("max_tokens", 1 << 70),
        ("max_completion_tokens", 1 << 31),
        ("seed", 1.5),
        ("seed", 1 << 63),
        ("seed", -(1 << 63) - 1),
        ("seed", 1e300),
        ("stop", 7),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("stream", "yes"),
        ("user", 5),
    ],
)
def test_wrong_types_and_ranges_are_named(key: str, value: object) -> None:
    """Each malformed parameter is a 400 naming that parameter."""
    assert refused(parse_chat, chat(**{key: value})).param == key


def test_malformed_bodies_and_messages() -> None:
    """Not an object, no messages, a bad role, a non-text part: 400s that say where."""
    assert refused(parse_chat, [1, 2]).code == "invalid_json"
    assert refused(parse_chat, {"model": "m"}).param == "messages"
    bad_role = {"model": "m", "messages": [{"role": "tool", "content": "x"}]}
    assert refused(parse_chat, bad_role).param == "messages[0].role"
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert refused(parse_chat, image).param == "messages[0].content[0]"
    options = chat(stream_options={"include_usage": True})  # without stream = true
    assert refused(parse_chat, options).param == "stream_options"


def test_numbers_follow_the_one_table_of_bounds() -> None:
    """Each bound's edges: the last value inside is taken, the first outside is a 400; the
    table is the one the CLI and the coordinator's client port use."""
    for key, inside, outside in [
        ("top_k", MAX_COUNT, MAX_COUNT + 1),
        ("max_tokens", MAX_COUNT, MAX_COUNT + 1),
        ("seed", INT64_MAX, INT64_MAX + 1),
        ("seed", INT64_MIN, INT64_MIN - 1),
        ("temperature", 100.0, 100.000001),
        ("top_p", 1e-300, 0.0),
        ("top_p", 5e-324, -0.0),
    ]:
        parse_chat(chat(**{key: inside}))
        assert refused(parse_chat, chat(**{key: outside})).param == key
        assert BOUNDS[key].holds(inside) and not BOUNDS[key].holds(outside)


@pytest.mark.parametrize("where", ["prompt", "stop", "content", "part"])
def test_a_lone_surrogate_is_a_400_naming_where(where: str) -> None:
    """JSON's "\\ud800" decodes to a string no tokenizer can encode: a 400, never a 500."""
    bad = json.loads('"a\\ud800b"')
    if where == "prompt":
        err = refused(parse_completion, {"model": "m", "prompt": bad})
    elif where == "stop":
        err = refused(parse_chat, chat(stop=[bad]))
    elif where == "content":
        err = refused(parse_chat, {"model": "m", "messages": [{"role": "user", "content": bad}]})
    else:
        part = {"role": "user", "content": [{"type": "text", "text": bad}]}
        err = refused(parse_chat, {"model": "m", "messages": [part]})
    assert err.status == 400 and "surrogate" in err.message
