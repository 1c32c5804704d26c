"""Which target layers feed an EAGLE-3 head, and the check that catches a head fed the wrong ones.

The convention (vLLM's and SGLang's, and what SpecForge trains against): the head reads the
residual stream *entering* target layers ``l1 < l2 < l3`` (0-based), side by side in that
order, by default ``(2, L // 2, L - 3)``. The same tensors have a second name: SpecForge's
trainer takes Hugging Face's ``hidden_states[i + 1]``, the *output* of layer ``i``, with
defaults ``(1, L // 2 - 1, L - 4)``, and SGLang adds the 1 back when it captures; vLLM adds 1
to DFlash's ids for the same reason. A config that declares its ids in the other convention,
or a stage that captures a layer's output instead of its input, feeds the head every state
one layer off. Nothing breaks loudly — verification stays lossless — but few drafts are
accepted. The file does not say which convention its ids use, so this module measures:

- ``target_states``: the target's states entering the given layers, and its greedy tokens;
- ``check_layers``: on a few prompts, the head's mean log-probability of the target's own
  next token when fed the states of the declared layers, of the layers one below and of the
  layers one above. A head trained on its declared layers scores best there; one whose ids
  are off by one scores best one layer over (``LayerCheck.ok``; ``require_layers`` raises
  ``Eagle3LayerMismatch`` naming the layers that fit).

It needs the whole target (embedding to head) in this process: it is an offline check, run
where the weights are, not at a coordinator that holds no layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.eagle3_files import Eagle3Error
from shard.model.llama import StageModel
from shard.model.masks import causal_mask

__all__ = ["Eagle3LayerMismatch", "LayerCheck", "check_layers", "require_layers", "target_states"]


class Eagle3LayerMismatch(Eagle3Error):
    """The head fits the target's states better at other layers than those it declares."""


@attrs.frozen
class LayerCheck:
    """Mean log-probability of the target's greedy token, per candidate set of layers."""

    declared: tuple[int, ...]
    scores: tuple[tuple[tuple[int, ...], float], ...]  # (layers, score), declared first
    positions: int  # scored positions (the target's token in the draft vocabulary)

    @property
    def best(self) -> tuple[int, ...]:
        return max(self.scores, key=lambda item: item[1])[0]

    @property
    def ok(self) -> bool:
        """The declared layers score best (ties go to them)."""
        return dict(self.scores)[self.declared] >= max(score for _, score in self.scores)


@torch.no_grad()
def target_states(model: StageModel, ids: Tensor, layers: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The residual stream entering each of ``layers``, side by side, ``[S, len * D]``, and
    the target's greedy token after each position ``[S]``, for ids ``[S]`` from position 0."""
    if not (model.is_first and model.is_last):
        raise Eagle3Error("the layer check runs the whole target (embedding to head)")
    s = int(ids.shape[0])
    cache = model.new_cache(s)
    h = model.embed(ids[None].to(model.device))  # [1, S, D]
    ropes = model.ropes_at(slice(0, s), h.dtype)
    masks = {w: causal_mask(0, s, h.device, w) for w in model.windows()}
    taken: dict[int, Tensor] = {}
    for j, layer in enumerate(model.blocks()):
        if j in layers:
            taken[j] = h[0]  # [S, D]: what enters layer j
        h = layer(h, ropes[layer.local_rope], masks[layer.window], cache, model.cache_slot(j), 0)
    greedy = model.head(h)[0].argmax(-1)  # [S]
    return torch.cat([taken[j] for j in layers], dim=-1), greedy


@torch.no_grad()
def score(head: Eagle3Head, states: Tensor, ids: Tensor, greedy: Tensor) -> tuple[float, int]:
    """The head's summed log-probability of the target's greedy tokens along one prompt,
    teacher-forced (position ``t`` reads ``states[t]`` and ``ids[t+1]`` and is scored on
    ``greedy[t+1]``), and how many positions were scored (those whose token the draft
    vocabulary holds)."""
    w = head.lm_head.weight
    g = head(states[None, :-1].to(w.device, w.dtype), ids[None, 1:].to(w.device))  # [1, S-1, D]
    logp = torch.log_softmax(head.logits(g)[0].float(), dim=-1)  # [S-1, N]
    n = int(head.d2t.shape[0])
    to_draft = torch.full((head.config.model.vocab_size,), -1, dtype=torch.long)
    to_draft[torch.arange(n) + head.d2t.cpu()] = torch.arange(n)
    want = to_draft[greedy[1:].cpu()]  # [S-1]
    kept = (want >= 0).nonzero().flatten()
    picked = logp.cpu()[kept, want[kept]]
    return float(picked.sum()), int(kept.numel())


def check_layers(
    head: Eagle3Head,
    target: StageModel,
    prompts: Sequence[Sequence[int]],
    layers: Sequence[int] | None = None,
) -> LayerCheck:
    """Score the declared layers (``layers``, or those the head's config gives for this
    target) against the same layers shifted one down and one up, on ``prompts`` (token ids,
    at least 2 each)."""
    head.config.check_target(target.config)
    n_layers = target.config.n_layers
    declared = tuple(layers) if layers is not None else head.config.layers_for(n_layers)
    candidates = [declared] + [
        shifted
        for shift in (-1, 1)
        if all(0 <= i + shift < n_layers for i in declared)
        for shifted in [tuple(i + shift for i in declared)]
    ]
    totals = {c: 0.0 for c in candidates}
    positions = 0
    for prompt in prompts:
        ids = torch.tensor(list(prompt), dtype=torch.long)
        if ids.numel() < 2:
            raise Eagle3Error("each prompt of the layer check needs at least 2 tokens")
        every = sorted({i for c in candidates for i in c})
        states, greedy = target_states(target, ids, every)
        width = target.config.hidden_size
        for c in candidates:
            cols = [every.index(i) for i in c]
            picked = torch.cat([states[:, k * width : (k + 1) * width] for k in cols], dim=-1)
            total, n = score(head, picked, ids, greedy)
            totals[c] += total
        positions += n
    if positions == 0:
        raise Eagle3Error("no position of the prompts has its token in the draft vocabulary")
    return LayerCheck(declared, tuple((c, totals[c] / positions) for c in candidates), positions)


def require_layers(
    head: Eagle3Head,
    target: StageModel,
    prompts: Sequence[Sequence[int]],
    layers: Sequence[int] | None = None,
) -> LayerCheck:
    """``check_layers``, raising ``Eagle3LayerMismatch`` unless the declared layers win."""
    result = check_layers(head, target, prompts, layers)
    if any(math.isnan(s) for _, s in result.scores):
        raise Eagle3Error("the layer check scored NaN: the head or the target is broken")
    if not result.ok:
        scores = ", ".join(f"{c}: {s:.3f}" for c, s in result.scores)
        raise Eagle3LayerMismatch(
            f"the EAGLE-3 head fits the target's states best at layers {result.best}, not at "
            f"its declared {result.declared} (mean log-probability of the target's token: "
            f"{scores}). Its layer ids are likely off by one: SpecForge names a layer by its "
            "output, vLLM and SGLang by its input. Set eagle_aux_hidden_state_layer_ids to "
            f"{list(result.best)} in its config.json if that is what it was trained on."
        )
    return result
