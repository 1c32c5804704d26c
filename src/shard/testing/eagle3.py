"""``write_eagle3_head``: a tiny random EAGLE-3 head in its published layout, for tests.

What SpecForge writes after training a Llama EAGLE-3 head (the file names, the config keys,
the tensor names, ``d2t`` as int64 offsets and ``t2d`` as a bool mask), with random weights
from a seeded generator, scaled so the drafts depend on their inputs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["eagle3_config", "write_eagle3_head"]


def eagle3_config(
    *,
    vocab_size: int,
    hidden_size: int,
    draft_vocab_size: int,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    intermediate_size: int = 128,
    target_hidden_size: int | None = None,
    layer_ids: Sequence[int] | None = None,
    max_position_embeddings: int = 512,
) -> dict[str, Any]:
    """A ``config.json`` with the keys SpecForge's Llama EAGLE-3 configs carry."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
    }
    if target_hidden_size is not None:
        config["target_hidden_size"] = target_hidden_size
    if layer_ids is not None:
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(layer_ids),
            "use_aux_hidden_state": True,
        }
    return config


def write_eagle3_head(
    path: Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    embedding: torch.Tensor | None = None,
    with_embedding: bool = True,
    dtype: torch.dtype = torch.float32,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``path`` (created); return it.

    Weights are random (``seed``) unless ``tensors`` gives them (by published name). The
    draft vocabulary is a seeded random subset of the target's, in increasing order.
    ``embedding`` (the target's) is stored as ``embed_tokens`` when ``with_embedding``;
    without it a random one is.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    v, d, n = config["vocab_size"], config["hidden_size"], config["draft_vocab_size"]
    dt = config.get("target_hidden_size", d)
    n_aux = len(config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [0] * 3))
    h, kv, i = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["intermediate_size"],
    )
    hd = config.get("head_dim", d // h)

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    used = torch.randperm(v, generator=gen)[:n].sort().values
    out: dict[str, torch.Tensor] = {
        "fc.weight": lin(d, n_aux * dt),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": lin(h * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": lin(kv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": lin(kv * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": lin(d, h * hd),
        "midlayer.mlp.gate_proj.weight": lin(i, d),
        "midlayer.mlp.up_proj.weight": lin(i, d),
        "midlayer.mlp.down_proj.weight": lin(d, i),
        "norm.weight": norm(),
        "lm_head.weight": lin(n, d) * 4.0,
        "d2t": used - torch.arange(n),
        "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, used, True),
    }
    if with_embedding:
        emb = embedding if embedding is not None else 0.1 * torch.randn(v, d, generator=gen)
        out["embed_tokens.weight"] = emb.detach().clone()
    out.update(tensors or {})
    out = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous() for k, t in out.items()}
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path
