"""A new ``Eagle3Head`` for a target, its training loop, and its files in the published
layout (SpecForge's ``config.json`` + ``model.safetensors``, without ``embed_tokens``: the
loader takes the target's).

The head starts where the target ends: ``lm_head`` is the target's own head restricted to
the draft vocabulary and ``norm`` its final norm, so a ``g`` near the target's last hidden
state already reads out the target's guess; ``fc`` and the decoder layer start random.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.eagle3_files import CONFIG_FILE, WEIGHTS_FILE, Eagle3Config
from shard.training.eagle3.data import Batch
from shard.training.eagle3.train import Eagle3Recipe, loss_mask, step_loss, unrolled
from shard.training.head.train import lr_at

__all__ = ["draft_vocabulary", "head_config", "new_head", "save_head", "train"]

_TARGET_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
)


def draft_vocabulary(batch: Batch, size: int, always: tuple[int, ...]) -> Tensor:
    """The ``size`` tokens the target writes most often in ``batch`` (``always`` included),
    ascending: draft id ``d`` is the ``d``-th of them."""
    counts = torch.bincount(batch.ids[batch.valid], minlength=int(batch.ids.max()) + 1)
    counts = counts.float()
    counts[list(always)] = float("inf")
    top = torch.topk(counts, min(size, int((counts > 0).sum()))).indices
    return top.sort().values


def head_config(
    target: dict[str, Any], draft_vocab: int, layers: tuple[int, ...]
) -> dict[str, Any]:
    """The head's ``config.json``: the target's shape for its one layer, as SpecForge writes."""
    d = {k: target[k] for k in _TARGET_KEYS if k in target}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **d,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }


def new_head(
    config: dict[str, Any],
    draft_ids: Tensor,
    embedding: Tensor,
    head_rows: Tensor,
    final_norm: Tensor,
    seed: int,
) -> Eagle3Head:
    """A head of ``config`` with the target's ``embedding`` (frozen), its head's rows for
    ``draft_ids`` as ``lm_head`` and its ``final_norm`` weight as ``norm``."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_json(config))
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embedding)
        head.lm_head.weight.copy_(head_rows[draft_ids])
        head.norm.weight.copy_(final_norm)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    return head


def train(
    head: Eagle3Head,
    data: Batch,
    target_rows: Tensor,
    stop_ids: tuple[int, ...],
    recipe: Eagle3Recipe,
    seconds: float,
    log_every: int = 25,
) -> dict[str, Any]:
    """AdamW on ``step_loss`` for ``seconds`` of training; returns the record."""
    gen = torch.Generator().manual_seed(recipe.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    n = data.ids.shape[0]
    began, step, losses = time.perf_counter(), 0, []
    head.train()
    while (spent := time.perf_counter() - began) < seconds:
        for group in opt.param_groups:
            group["lr"] = lr_at(spent / seconds, recipe.lr)
        rows = torch.randint(n, (recipe.rows,), generator=gen)
        ids, valid = data.ids[rows], data.valid[rows]
        states = data.states[rows, :-1].float()
        if recipe.noise:  # relative to each layer's state at each position: position 0's
            # state (the attention sink) is hundreds of times larger than the others
            seg = states.view(*states.shape[:-1], head.config.n_aux, -1)
            scale = seg.pow(2).mean(-1, keepdim=True).sqrt() * recipe.noise
            states = (seg + (torch.rand(seg.shape, generator=gen) * 2 - 1) * scale).flatten(-2)
        mask = loss_mask(ids, valid, stop_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = unrolled(head, states, ids[:, 1:], recipe.depth)
            final = data.final[rows, 1:]
            loss, agree = step_loss(head, outs, target_rows, final, mask, recipe, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        if step % log_every == 0:
            print(
                f"step {step} {spent:.0f}s loss {sum(losses[-log_every:]) / log_every:.3f} "
                f"agree {' '.join(f'{a:.2f}' for a in agree)}",
                flush=True,
            )
    head.eval()
    return {
        "steps": step,
        "seconds": round(time.perf_counter() - began, 1),
        "loss_last": losses[-1] if losses else None,
    }


def save_head(head: Eagle3Head, config: dict[str, Any], out: Path, extra: dict[str, Any]) -> None:
    """The head's files (fp16 weights, no ``embed_tokens``) in a temporary sibling of
    ``out``, renamed into place; ``extra`` goes to ``train.json`` beside them."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        tensors = {
            k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
            for k, v in head.state_dict().items()
            if k != "embed_tokens.weight" and not k.startswith("rope_")
        }
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "train.json").write_text(json.dumps(extra, indent=2) + "\n", encoding="utf-8")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
