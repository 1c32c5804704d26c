"""The tail's side of features on the return path: which rows of the target's features a
verdict carries (``Verdict.features``), and in which dtype.

A feature is the target's final hidden state after the final RMSNorm at one position: the
vector its tied head multiplies into logits there. A session that opened with
``OpenSession.features = W > 0`` gets, with each verdict, the features of the last rows it
committed, at most ``W``:

- a verify chunk: rows ``0 .. accepted`` (its inputs at ``start .. start+accepted``, all
  committed once the verdict is folded in), the last ``W`` of them;
- the prompt's final chunk: the prompt's last ``W`` positions. A long prompt arrives in
  several chunks, and only the final one is answered, so the tail keeps each prompt chunk's
  last rows (``FeatureWindow.prompt_chunk``): the final verdict carries the whole window, not
  just what its own chunk holds. Kept rows must join the next chunk's rows without a gap;
  after one (a prompt re-sent from 0, a tail that joined mid-prompt) the window restarts.

On the wire a feature is bfloat16 when the tail computes in bfloat16, else float16: the draft
head that reads it needs far less than fp32's precision, and it halves the bytes.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["FeatureWindow", "wire_dtype"]


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype features travel in from a tail computing in ``dtype``."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


@attrs.define
class FeatureWindow:
    """One session's features at the tail: its window ``size`` and the prompt's last rows
    seen so far (positions ``[prompt_end - len(prompt), prompt_end)``)."""

    size: int
    prompt: torch.Tensor | None = None  # [m <= size, D]
    prompt_end: int = 0

    def verify(self, start: int, accepted: int, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The rows a verify chunk's verdict carries, of its features ``rows`` ``[K+1, D]``
        (row ``i`` at position ``start + i``), and the position of the first."""
        kept = rows[: accepted + 1][-self.size :]  # [<= size, D]
        return start + accepted + 1 - int(kept.shape[0]), kept

    def prompt_chunk(self, start: int, n: int, rows: torch.Tensor) -> None:
        """A prompt chunk of ``n`` positions from ``start`` ran; ``rows`` ``[f, D]`` are its
        last ``f`` positions' features. Keeps the window's last ``size`` rows."""
        old = self.prompt
        if old is not None and self.prompt_end >= start:  # no gap: keep the rows before it
            before = start - (self.prompt_end - int(old.shape[0]))  # old rows at < start
            rows = torch.cat([old[: max(before, 0)], rows])
        self.prompt, self.prompt_end = rows[-self.size :], start + n

    def take_prompt(self) -> tuple[int, torch.Tensor]:
        """The prompt's window for its final verdict (position of the first row, rows), then
        forgotten: it is never needed again."""
        rows = self.prompt
        assert rows is not None, "take_prompt before any prompt chunk"
        self.prompt = None
        return self.prompt_end - int(rows.shape[0]), rows
