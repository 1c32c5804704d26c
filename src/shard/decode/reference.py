"""Single-process reference generation: the whole model on one machine.

Every distributed mode is compared with this. It chunks exactly as the ring does — the prompt
in ``prefill_chunk`` pieces, then one position per step — and draws from the same seeded
per-position draws (``shard.decode.verify``), so greedy (and seeded sampled) output through the ring
is token-identical to this on the same weights and dtype.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import attrs
import torch

from shard.decode.state import DecodeState
from shard.decode.verify import choose_token
from shard.messages import RunStats, Sampling
from shard.model.llama import StageModel


@attrs.frozen
class ReferenceResult:
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: RunStats


def generate_reference(
    model: StageModel,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: Sequence[int],
    sampling: Sampling = Sampling(),
    max_len: int = 2048,
    prefill_chunk: int = 128,
    gaps: list[float] | None = None,
) -> ReferenceResult:
    """Generate with a model holding every layer (``model.is_first and model.is_last``).

    ``gaps``, when given, receives the gap between the top two logits at every step: where
    another computation order may flip a near-tie, tests check the gap was tiny.
    """
    steps = reference_steps(
        model,
        prompt_ids,
        max_tokens=max_tokens,
        eos_ids=eos_ids,
        sampling=sampling,
        max_len=max_len,
        prefill_chunk=prefill_chunk,
        gaps=gaps,
    )
    for _ in steps:
        pass
    return steps.result


@attrs.define
class ReferenceSteps:
    """``generate_reference`` one commit at a time: iterating yields each step's emitted ids
    (held-back stop text comes later or never, as ``DecodeState`` decides); ``result`` is
    set once the iteration ends."""

    model: StageModel
    prompt_ids: Sequence[int]
    state: DecodeState
    sampling: Sampling
    max_len: int
    prefill_chunk: int
    gaps: list[float] | None
    _result: ReferenceResult | None = attrs.field(default=None, init=False)

    @property
    def result(self) -> ReferenceResult:
        if self._result is None:
            raise RuntimeError("the reference run has not finished: iterate it first")
        return self._result

    def __iter__(self) -> Iterator[list[int]]:
        model, state, prompt_ids = self.model, self.state, self.prompt_ids
        cache = model.new_cache(self.max_len)
        began = time.perf_counter()
        laps: list[float] = []
        with torch.inference_mode():
            logits = torch.empty(0)
            for start in range(0, len(prompt_ids), self.prefill_chunk):
                chunk = torch.tensor([list(prompt_ids[start : start + self.prefill_chunk])])
                logits = model(chunk, start, cache, head_rows=1)  # [1, 1, V]: the last row's
            prefill_s = time.perf_counter() - began
            while True:
                if self.gaps is not None:
                    top2 = torch.topk(logits[0, -1], 2).values
                    self.gaps.append(float(top2[0] - top2[1]))
                token = choose_token(logits[0, -1], self.sampling, state.position)
                emitted = state.commit([token])
                if emitted:
                    yield emitted
                if state.done:
                    break
                t0 = time.perf_counter()
                logits = model(torch.tensor([[token]]), state.position - 1, cache)  # [1, 1, V]
                laps.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - began
        tokens = len(state.output)
        assert state.finish_reason is not None
        self._result = ReferenceResult(
            token_ids=tuple(state.output),
            finish_reason=state.finish_reason,
            stats=RunStats(
                tokens=tokens,
                seconds=seconds,
                tok_s=tokens / seconds if seconds > 0 else 0.0,
                prefill_s=prefill_s,
                laps=len(laps) + 1,
                mean_lap_s=sum(laps) / len(laps) if laps else 0.0,
            ),
        )


def reference_steps(
    model: StageModel,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: Sequence[int],
    sampling: Sampling = Sampling(),
    max_len: int = 2048,
    prefill_chunk: int = 128,
    gaps: list[float] | None = None,
) -> ReferenceSteps:
    """``generate_reference``'s run as a ``ReferenceSteps`` to iterate (its arguments)."""
    if not (model.is_first and model.is_last):
        raise ValueError("the reference needs a model holding every layer")
    state = DecodeState.start(len(prompt_ids), max_tokens, eos_ids, max_len=max_len)
    return ReferenceSteps(model, prompt_ids, state, sampling, max_len, prefill_chunk, gaps)
