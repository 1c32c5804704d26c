"""The model's tokenizer: encode, decode, stream-decode, and render its own chat template.

Loaded from a model directory in the Hugging Face layout (``tokenizer.json``,
``tokenizer_config.json``, ``config.json``, ``generation_config.json``) with the
``tokenizers`` library, so encoding is exactly what the model was trained with. Chat
templates are the model's own Jinja, rendered in a sandbox the way ``transformers`` does,
and bounded in size, steps and time (``shard.model.chat_render``): a template is code from
the model's files, and one that renders without end is refused in one line, not run.
Nothing here imports torch: the coordinator tokenizes without loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from shard.model.chat_bounds import DEFAULT_LIMITS, RenderLimits
from shard.model.chat_render import compile_template, render
from shard.model.jsonfile import read_json

#: The largest tokenizer_config.json / config.json / generation_config.json read (real ones,
#: chat templates included, are under 200 KB).
MAX_SIDE_FILE = 16 << 20
#: The largest tokenizer.json read (Gemma 3's, the largest here, is 33 MB).
MAX_TOKENIZER_FILE = 256 << 20


class TokenizerError(Exception):
    """A tokenizer cannot be loaded or a chat cannot be rendered; says what to do."""


class Tokenizer:
    """Encode and decode text for one model; build with ``Tokenizer.from_dir``.

    ``eos_ids`` holds every id that ends generation (config, generation config and the
    tokenizer's own EOS token), ``bos_id`` the begin-of-sequence id or None, and
    ``vocab_size`` the number of token ids the tokenizer can produce (the model's
    embedding may have more rows).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_ids: tuple[int, ...],
        bos_id: int | None,
        chat_template: str | None,
        special_tokens: dict[str, str],
        chat_source: str = "the model's chat template",
    ) -> None:
        """``chat_source`` names where ``chat_template`` came from in errors (its file)."""
        self._backend = backend
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._chat_text = chat_template
        self._chat_source = chat_source
        self._special_tokens = special_tokens

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer:
        """Load the tokenizer of the model in ``model_dir``.

        Errors: ``TokenizerError`` when ``tokenizer.json`` is missing or unreadable.
        """
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json; is it a model directory?")
        if path.stat().st_size > MAX_TOKENIZER_FILE:
            raise TokenizerError(
                f"{path}: {path.stat().st_size} bytes, more than a tokenizer.json may have "
                f"({MAX_TOKENIZER_FILE}); re-download the model"
            )
        try:  # serde_json bounds nesting (128) itself
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            why = " ".join(str(exc).split())[:200]
            raise TokenizerError(f"{path} is not a valid tokenizer file: {why}") from exc
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        special = {
            key: name
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (name := _token_name(tokenizer_config.get(key))) is not None
        }
        config = _read_json(model_dir / "config.json")
        generation = _read_json(model_dir / "generation_config.json")
        eos = [*_ids(config.get("eos_token_id")), *_ids(generation.get("eos_token_id"))]
        if (
            "eos_token" in special
            and (eos_id := backend.token_to_id(special["eos_token"])) is not None
        ):
            eos.append(eos_id)
        bos_id = next(iter(_ids(config.get("bos_token_id"))), None)
        if bos_id is None and "bos_token" in special:
            bos_id = backend.token_to_id(special["bos_token"])
        chat_template, chat_source = _chat_template(model_dir, tokenizer_config)
        return cls(
            backend,
            eos_ids=tuple(dict.fromkeys(eos)),
            bos_id=bos_id,
            chat_template=chat_template,
            special_tokens=special,
            chat_source=chat_source,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; BOS/EOS are added only if the tokenizer's own post-processor
        does so (SmolLM2's does not). Special-token text such as ``<|im_end|>`` maps to its id."""
        # encode_batch releases the GIL while the Rust side works (encode does not), so a long
        # prompt tokenized in a worker thread leaves the event loop running (bench/loop_stall.py).
        (encoding,) = self._backend.encode_batch([text], add_special_tokens=True)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of the token spelled ``token`` (e.g. ``"<|im_end|>"``), or None."""
        return self._backend.token_to_id(token)

    def apply_chat(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        limits: RenderLimits = DEFAULT_LIMITS,
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) with the model's template,
        within ``limits`` (output size, steps, seconds: ``shard.model.chat_bounds``).

        The result is text to ``encode``; it already holds any BOS the template writes.

        Errors: ``TokenizerError``, one line naming the template's file, when the model has
        no chat template, the template does not compile, it fails or rejects the
        conversation (its ``raise_exception``), or it goes over ``limits``.
        """
        template = self._chat
        try:
            variables = {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                **self._special_tokens,
            }
            return render(template, variables, limits)
        except _TEMPLATE_FAILURES as exc:  # the template is the model's code: any of its errors
            raise TokenizerError(
                f"{self._chat_source}: the chat template failed: {_one_line(exc)}"
            ) from None

    @property
    def has_chat_template(self) -> bool:
        """Whether the model has a chat template (a base model has none: plain text only)."""
        return bool(self._chat_text)

    @cached_property
    def _chat(self) -> jinja2.Template:
        """The compiled chat template; compiled on first use so a broken template does not
        stop plain encoding."""
        if not self._chat_text:
            raise TokenizerError(
                "this model has no chat template (tokenizer_config.json has no chat_template); "
                "send a plain prompt instead of chat messages"
            )
        try:
            return compile_template(self._chat_text)
        except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
            raise TokenizerError(
                f"{self._chat_source}: the chat template does not compile: {_one_line(exc)}; "
                "fix the template or send a plain prompt"
            ) from None


class StreamDecoder:
    """Turns a stream of token ids into text as soon as the text is complete.

    A multi-byte UTF-8 character can be split across byte-level tokens; decoding the first
    part alone yields U+FFFD. ``push`` holds such a tail back until a later token completes
    it. Each push decodes a short window (the previous and the pending tokens) rather than
    everything so far, and diffs it against the previous text, so decoders that treat a
    leading token specially (SentencePiece's leading space) still join correctly. The
    concatenation of all pushes and a final ``flush`` equals ``decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this one have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        new = self._pending()
        if new.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new

    def flush(self) -> str:
        """Return whatever is pending (an incomplete character decodes as U+FFFD)."""
        new = self._pending()
        self._prefix = self._read = len(self._ids)
        return new

    def _pending(self) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        window = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        return window[len(before) :]


def _read_json(path: Path) -> dict[str, Any]:
    """A small JSON file of the model (``{}`` when absent), read bounded and strictly
    (``shard.model.jsonfile``: size, nesting, duplicate keys)."""
    if not path.exists():
        return {}
    data = read_json(path, max_bytes=MAX_SIDE_FILE, error=TokenizerError, what="a model file")
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} should hold a JSON object")
    return data


def _ids(value: object) -> list[int]:
    """A config's token id entry, which may be absent, one id or a list of ids."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _token_name(value: object) -> str | None:
    """tokenizer_config.json spells special tokens as strings or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> tuple[str | None, str]:
    """The default chat template and the file it is in: ``chat_template.jinja`` (newer
    layout) or the config entry, which may be a string or a list of named templates."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    source = str(model_dir / "tokenizer_config.json")
    return (template if isinstance(template, str) else None), source


#: What a template's render can raise: its own errors and Python's from the operations it
#: runs ('a' + 1, 1 / 0, a missing key, an int too large to print, recursion in macros).
_TEMPLATE_FAILURES = (
    jinja2.TemplateError,
    ArithmeticError,
    LookupError,
    TypeError,
    ValueError,
    AttributeError,
    RecursionError,
    MemoryError,
)


def _one_line(exc: BaseException) -> str:
    """``exc`` in one line (a syntax error's message says its line, not the source)."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"{exc.message} (line {exc.lineno})"
    text = " ".join(str(exc).split())
    return text if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {text}"
