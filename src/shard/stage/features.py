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

**Layer states** (``OpenSession.feature_layers``, what an EAGLE-3 head reads): a session's
features are then the residual stream *entering* each of those layers, side by side in layer
order. Those rows are not all at the tail: the stage holding layer ``l`` captures what enters
it (``capturing``: a forward pre-hook on the layer's input norm, which every forward path
feeds the residual stream entering the layer; it reads the activation and changes nothing the
forward computes), appends it to what arrived with the chunk
(``Prefill.states`` / ``Verify.states``, ``[1, F, c x D]``, checked by ``incoming_states``)
and sends the wider rows on. A chunk carries the rows a verdict may need (``carried_rows``):
every row of a verify chunk, the last ``W`` of a prompt chunk, none of a replayed one. The
tail's window then keeps and returns them exactly as it does final-norm features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch
from torch import nn

from shard.compute.tensors import from_wire
from shard.messages import Prefill, Tensor, Verify

__all__ = [
    "FeatureWindow",
    "StatesError",
    "capturing",
    "carried_rows",
    "incoming_states",
    "wire_dtype",
]


class StatesError(ValueError):
    """A chunk's ``states`` do not have the shape its session's layers give."""


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


def carried_rows(msg: Prefill | Verify, window: int, rows: int) -> int:
    """Rows of a chunk of ``rows`` positions whose features a session with a feature
    ``window`` keeps (its last ones): every row of a verify chunk (which of them a verdict
    carries depends on how many drafts hold), up to the window of a prompt chunk, none of a
    replayed one (or when no features were asked)."""
    if not window or (isinstance(msg, Prefill) and msg.replay):
        return 0
    return rows if isinstance(msg, Verify) else min(window, rows)


def incoming_states(
    states: Tensor | None, *, before: int, rows: int, dim: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """A chunk's ``states`` as ``[rows, before x dim]`` (CPU, ``dtype``), checked: None when
    no feature layer lies upstream (``before`` 0) or no rows are carried. ``StatesError``
    when they are missing, unasked, or of another shape or dtype."""
    if not before or not rows:
        if states is not None:
            raise StatesError("layer states arrived where none lie upstream")
        return None
    if states is None:
        raise StatesError(f"no layer states where {before} layers upstream captured them")
    try:
        t = from_wire(states)
    except ValueError as exc:
        raise StatesError(f"bad layer states payload: {exc}") from exc
    want = (1, rows, before * dim)
    if tuple(t.shape) != want or t.dtype != dtype:
        raise StatesError(
            f"layer states {states.dtype} {tuple(t.shape)}, not "
            f"{str(dtype).removeprefix('torch.')} {want}"
        )
    return t[0]


@contextlib.contextmanager
def capturing(layers: Sequence[nn.Module]) -> Iterator[list[torch.Tensor | None]]:
    """While open, ``taken[i]`` is a copy of the input of ``layers[i]`` in the latest forward
    (its first argument). A pre-hook only reads; the forward
    computes exactly what it computes without it."""
    taken: list[torch.Tensor | None] = [None] * len(layers)

    def keeper(i: int) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def keep(module: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0]
            assert isinstance(x, torch.Tensor)
            taken[i] = x.clone()  # a later in-place write into it would change what was read

        return keep

    handles = [layer.register_forward_pre_hook(keeper(i)) for i, layer in enumerate(layers)]
    try:
        yield taken
    finally:
        for handle in handles:
            handle.remove()
