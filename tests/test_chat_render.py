"""Chat templates render in a bounded sandbox (``shard.model.chat_render``): a template that
would render without end — huge output, loops within loops, a value doubled until memory
runs out — is refused in one line, fast and without the large allocation; a syntax error is
one line naming the file; and a real template renders exactly as the plain sandbox
(``transformers``' environment) renders it.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
import trio

from shard.coordinator.text import TextAdapter
from shard.model.chat_bounds import RenderLimits, TemplateRefused
from shard.model.chat_render import compile_template, render
from shard.model.tokenizer import Tokenizer, TokenizerError
from shard.testing import make_tiny_checkpoint

HOSTILE = {
    "range-output": "{% for i in range(10**8) %}xxxxxxxxxx{% endfor %}",
    "nested-output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    ),
    "nested-empty": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "string-times": "{{ 'x' * 10**9 }}",
    "list-times": "{{ ['x' * 4000000] * 1000 }}",
    "namespace-doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}"
    ),
    "plus-doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s }}"
    ),
    "macro-doubling": (
        "{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n > 0 else s }}{% endmacro %}{{ f('x', 60) }}"
    ),
    "captured-block": (
        "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx"
        "{% endfor %}{% endfor %}{% endset %}{{ x }}"
    ),
    "center": "{{ 'x'|center(1000000000) }}",
    "replace": "{{ ('x' * 1000000)|replace('', 'yyyyyyyy') }}",
    "percent-width": "{{ '%0999999999d' % 1 }}",
    "format-width": "{{ '{:>999999999}'.format(1) }}",
    "join": "{% set s = 'x' * 3000000 %}{{ [s, s, s, s, s, s, s, s]|join }}",
    "indent": "{{ ('\\n' * 1000000)|indent(4000000) }}",
    "int-squaring": (
        "{% set ns = namespace(n=10) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}{{ ns.n }}"
    ),
    "sum-lists": "{{ range(100000)|batch(1)|sum(start=[]) }}",
    "tojson-indent": "{{ range(10000)|list|tojson(indent=4000000) }}",
    "lipsum": "{{ lipsum(100000) }}",
    "tilde-many": "{% set s = 'x' * 4000000 %}{{ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s ~ s }}",
    "urlize": "{{ ('x ' * 1000000)|urlize }}",
    "select": "{{ ('x' * 2000000)|select('equalto', 'y')|list }}",
    "map": "{{ ('x' * 2000000)|map('upper')|list }}",
    "batch": "{{ ('x' * 2000000)|batch(1)|list }}",
}

#: Far above what a refused render allocates (a few MiB), far below what it asked for (GiBs).
PEAK_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chat"), n_layers=1, seed=2)


def with_template(model_dir: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the tiny model's tokenizer files with ``template`` as chat_template.jinja."""
    copy = tmp_path / "model"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (copy / name).write_bytes((model_dir / name).read_bytes())
    (copy / "chat_template.jinja").write_text(template)
    return copy


@pytest.fixture
def peak() -> Iterator[Callable[[], int]]:
    """The peak traced allocation (bytes) since the test began."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_template_that_would_render_without_end_is_refused(
    source: str, peak: Callable[[], int]
) -> None:
    """Each hostile template is refused (TemplateRefused) within seconds, before it has
    allocated anything near what it asked for."""
    began = time.monotonic()
    with pytest.raises(TemplateRefused) as refused:
        render(compile_template(source), {"messages": []})
    assert time.monotonic() - began < 5
    assert peak() < PEAK_BYTES
    assert "\n" not in str(refused.value)


def test_steps_and_time_are_limits_of_their_own() -> None:
    """A loop within a loop ends at max_steps; a render whose clock passes max_seconds ends
    then (the clock is injected: no waiting)."""
    nested = compile_template(HOSTILE["nested-empty"])
    with pytest.raises(TemplateRefused, match="over 1000 steps"):
        render(nested, {}, RenderLimits(max_steps=1000))
    ticks = iter(range(10**9))
    with pytest.raises(TemplateRefused, match="over 50 s"):
        render(nested, {}, RenderLimits(max_seconds=50), clock=lambda: float(next(ticks)))


def test_a_long_conversation_renders_well_within_the_bounds() -> None:
    """3000 turns, with the whole conversation passed to a macro on every turn (a value is
    measured once per render, not once per use), render in a fraction of the time bound."""
    source = (
        "{% macro last(ms) %}{{ ms[-1]['role'] }}{% endmacro %}{% for m in messages %}"
        "{{ m['role'] }}: {{ m['content'] }} ({{ last(messages) }}){% endfor %}"
    )
    turns = [{"role": ("user", "assistant")[i % 2], "content": "hello " * 10} for i in range(3000)]
    text = render(compile_template(source), {"messages": turns})
    assert text.count("(assistant)") == 3000


def test_the_output_is_bounded_while_it_streams() -> None:
    """Output of small pieces is stopped once it passes max_chars, not rendered whole."""
    many = compile_template("{% for i in range(1000) %}{{ i }},{% endfor %}")
    with pytest.raises(TemplateRefused, match="rendered over 1000 characters"):
        render(many, {}, RenderLimits(max_chars=1000))
    assert render(many, {}) == ",".join(map(str, range(1000))) + ","


#: A template in the style of today's tool-calling ones: namespace, macros, loop.last,
#: tojson, filters, tests, string methods, raise_exception, strftime_now.
RICH = """{%- set ns = namespace(system='', tools=0) -%}
{%- macro render_tool(t) -%}{{ t.name | upper }}: {{ t | tojson(indent=2) }}{%- endmacro -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'].strip() -%}
{%- endif -%}
<|system|>{{ ns.system or 'You are helpful.' }} (today {{ strftime_now('%Y') | length }})
{%- if tools is defined %}
{%- for t in tools %}{% set ns.tools = ns.tools + 1 %}
{{ loop.index }}/{{ loop.length }} {{ render_tool(t) }}{{ ',' if not loop.last }}
{%- endfor %}
{{ ns.tools }} tools: {{ tools | map(attribute='name') | join(', ') }}
{%- endif %}
{%- for m in messages if m['role'] != 'system' %}
{%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ '%s/%d' % ('#', loop.index0) }}
{{ '{0}-{1}'.format(m['role'][:1], m['content'] | length) }}{% if loop.last %}<|end|>{% endif %}
{{ m['role'] ~ ':' ~ loop.index ~ [1] }}
{%- autoescape true %}{{ '<' ~ m['content'][:3] }}{% endautoescape %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{{ ' ' * 2 }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}{{ (messages | length) * 3 }}
{%- endif %}"""


def reference_render(source: str, variables: dict[str, object]) -> str:
    """What transformers' environment (the plain sandbox) renders."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(
        jinja2.TemplateError(message)
    )
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return env.from_string(source).render(**variables)


def test_a_real_template_renders_exactly_as_the_plain_sandbox() -> None:
    """Bounds change nothing for a template within them: the same text, byte for byte."""
    variables: dict[str, object] = {
        "messages": [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "What is 2+2? " * 50},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": 'And <b>3+3</b> & "more"?'},
        ],
        "tools": [
            {"name": "calc", "parameters": {"type": "object", "properties": {"x": {}}}},
            {"name": "search", "parameters": {"q": "ü"}},
        ],
        "add_generation_prompt": True,
        "eos_token": "<|end|>",
    }
    ours = render(compile_template(RICH), variables)
    assert ours == reference_render(RICH, variables)
    assert "2 tools: calc, search" in ours and "<|end|>" in ours


@pytest.mark.parametrize("name", ["nested-output", "string-times", "macro-doubling"])
def test_the_tokenizer_refuses_in_one_line_naming_the_file(
    name: str, model_dir: Path, tmp_path: Path, peak: Callable[[], int]
) -> None:
    """``apply_chat`` with a hostile template is one TokenizerError line naming the file."""
    model = with_template(model_dir, tmp_path, HOSTILE[name])
    tokenizer = Tokenizer.from_dir(model)
    began = time.monotonic()
    with pytest.raises(TokenizerError) as refused:
        tokenizer.apply_chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - began < 5 and peak() < PEAK_BYTES
    message = str(refused.value)
    assert message.startswith(f"{model / 'chat_template.jinja'}: the chat template failed: ")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("{% for m in messages %}{{ m.content }", "unexpected '}'"),
        ("{% for x in %}{% endfor %}", "Expected an expression"),
        ("{% if messages %}never closed", "Unexpected end of template"),
    ],
)
def test_a_syntax_error_is_one_line_naming_the_file(
    source: str, says: str, model_dir: Path, tmp_path: Path
) -> None:
    """A template that does not compile is one TokenizerError line naming the file and the
    line; plain encoding still works."""
    tokenizer = Tokenizer.from_dir(with_template(model_dir, tmp_path, source))
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    with pytest.raises(TokenizerError) as refused:
        tokenizer.apply_chat([{"role": "user", "content": "hi"}])
    message = str(refused.value)
    assert "chat_template.jinja: the chat template does not compile" in message
    assert says in message and "(line " in message and "\n" not in message


def test_a_template_config_entry_is_named_by_its_file(model_dir: Path, tmp_path: Path) -> None:
    """A template from tokenizer_config.json is named by that file; Python errors it raises
    ('a' + 1) are one line too."""
    copy = with_template(model_dir, tmp_path, "")
    (copy / "chat_template.jinja").unlink()
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'a' + 1 }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: .* TypeError: "):
        Tokenizer.from_dir(copy).apply_chat([{"role": "user", "content": "hi"}])


async def test_the_text_adapter_refuses_it_off_the_event_loop(
    model_dir: Path, tmp_path: Path
) -> None:
    """Through the coordinator's text adapter (worker thread) a hostile chat is a
    TokenizerError, and the event loop keeps running meanwhile."""
    adapter = TextAdapter(
        Tokenizer.from_dir(with_template(model_dir, tmp_path, HOSTILE["nested-empty"]))
    )
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            with pytest.raises(TokenizerError, match="the chat template failed"):
                await adapter.encode([{"role": "user", "content": "hi"}])
            nursery.cancel_scope.cancel()
    assert ticks > 0
