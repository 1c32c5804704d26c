"""Single-process reference generation: the whole model on one machine.

Every distributed mode is compared with this. It chunks exactly as the ring does — the prompt
in ``prefill_chunk`` pieces, then one position per step — and draws from the same seeded
per-position draws (``shard.decode.verify``), so greedy (and seeded sampled) output through the ring
is token-identical to this on the same weights and dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
    on_tokens: Callable[[list[int]], None] | None = None,
    gaps: list[float] | None = None,
) -> ReferenceResult:
    """Generate with a model holding every layer (``model.is_first and model.is_last``).

    ``gaps``, when given, receives the gap between the top two logits at every step: where
    another computation order may flip a near-tie, tests check the gap was tiny.
    """
    if not (model.is_first and model.is_last):
        raise ValueError("the reference needs a model holding every layer")
    state = DecodeState.start(len(prompt_ids), max_tokens, eos_ids, max_len=max_len)
    cache = model.new_cache(max_len)
    began = time.perf_counter()
    laps: list[float] = []
    with torch.inference_mode():
        logits = torch.empty(0)
        for start in range(0, len(prompt_ids), prefill_chunk):
            chunk = torch.tensor([list(prompt_ids[start : start + prefill_chunk])])  # [1, S]
            logits = model(chunk, start, cache, head_rows=1)  # [1, 1, V]: the last row's
        prefill_s = time.perf_counter() - began
        while True:
            if gaps is not None:
                top2 = torch.topk(logits[0, -1], 2).values
                gaps.append(float(top2[0] - top2[1]))
            token = choose_token(logits[0, -1], sampling, state.position)
            emitted = state.commit([token])
            if emitted and on_tokens is not None:
                on_tokens(emitted)
            if state.done:
                break
            t0 = time.perf_counter()
            logits = model(torch.tensor([[token]]), state.position - 1, cache)  # [1, 1, V]
            laps.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - began
    tokens = len(state.output)
    assert state.finish_reason is not None
    return ReferenceResult(
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
