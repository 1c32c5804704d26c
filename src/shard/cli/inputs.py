"""What an operator feeds the commands: a prompt argument (``-`` for standard input) and a
prompts file, each checked to be UTF-8 text.

The tokenizer and the wire need real text. An argument with bytes that are not UTF-8 reaches
Python as lone surrogates (``surrogateescape``) and would fail deep inside encoding; it is
refused here instead, in one line that says where the bad byte is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from shard.cli.errors import InputError

_FIX = "give UTF-8 text (e.g. convert it with iconv -f LATIN1 -t UTF-8)"


def prompt_arg(text: str, *, stdin: BinaryIO | None = None) -> str:
    """The prompt argument as text; ``-`` reads standard input (one trailing newline is
    dropped, as a shell's ``echo`` or an editor adds it).

    Errors: ``InputError`` when the text is not UTF-8, or empty (refused here, before any
    model loads or process starts, rather than after).
    """
    if text == "-":
        data = (stdin or sys.stdin.buffer).read()
        prompt = utf8(data, "standard input")
        return _not_empty(prompt[:-2] if prompt.endswith("\r\n") else prompt.removesuffix("\n"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # undo surrogateescape to report the operator's own bytes
        utf8(text.encode("utf-8", "surrogateescape"), "the prompt argument")
        raise  # not reached: the bytes were not UTF-8
    return _not_empty(text)


def _not_empty(prompt: str) -> str:
    if not prompt:
        raise InputError("the prompt is empty: nothing to condition on; give some text")
    return prompt


def read_prompts(path: Path) -> list[str]:
    """The non-blank lines of ``path``, stripped: one prompt per line.

    Errors: ``InputError`` when the file cannot be read or is not UTF-8.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--prompts {path}: cannot read it: {exc.strerror or exc}") from None
    lines = [line.strip() for line in utf8(data, f"--prompts {path}").splitlines()]
    return [line for line in lines if line]


def utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8. Errors: ``InputError`` naming ``where``, the line and the
    offending byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        byte = data[exc.start]
        raise InputError(
            f"{where} is not UTF-8 (byte 0x{byte:02x} at offset {exc.start}, line {line}); " + _FIX
        ) from None
