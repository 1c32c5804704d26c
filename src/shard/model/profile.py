"""What one layer of a model costs a node: its weight sizes, and its compute time measured on
this node's own device (the profile a node started with ``--join`` registers for placement).

``weight_bytes`` reads the sizes from the config alone (no weights). ``measure_layer_ms``
times one transformer layer of the model's shape, with random weights (a scratch layer: a
joining node need not hold any weights yet), for each chunk size asked: a median of a few
timed forwards after warm-up. It is a measurement, so it reads the wall clock
(``time.perf_counter``) and synchronises the GPU; nothing decides anything from it but the
planner.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Final

import torch

from shard.model.config import ModelConfig
from shard.model.kvcache import KVCache
from shard.model.llama import Block, rope_tables
from shard.model.quant import QuantLinear, quantize_int4, quantize_int8

__all__ = [
    "DTYPE_BYTES",
    "available_memory_bytes",
    "measure_layer_ms",
    "weight_bytes",
]

DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Positions already in the scratch cache when a chunk is timed (a decode mid-sequence).
_CONTEXT: Final = 32


def weight_bytes(config: ModelConfig, dtype: str) -> tuple[int, int, int]:
    """``(layer, embedding, head)`` bytes of ``config``'s weights in ``dtype`` (the head also
    holds the final norm), priced module by module (``shard.model.footprint``). Placement
    sees equal layers, so ``layer`` is the largest: a mixture-of-experts model's dense first
    layers are counted at their sparse neighbours' size, never the other way round."""
    from shard.model.footprint import predict

    footprint = predict(config, dtype, dtype=dtype)
    return max(footprint.layers), footprint.embedding, footprint.head


def available_memory_bytes(device: torch.device) -> int:
    """What this node can offer for weights by default: half of the free GPU memory, or half
    of the host's available memory on CPU (the rest is for KV caches and activations)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) // 2
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * os.sysconf("SC_PAGE_SIZE") // 2 if pages > 0 else 0


def _quantize_linears(module: torch.nn.Module, kind: str, device: torch.device) -> None:
    """Replace each linear of ``module`` (in groups of 32 columns) by its ``kind`` form."""
    for name, child in list(module.named_modules()):
        if isinstance(child, torch.nn.Linear) and child.in_features % 32 == 0:
            w = child.weight.detach().float().cpu()
            q = quantize_int8(w) if kind == "int8" else quantize_int4(w)
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, QuantLinear(q, device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_layer_ms(
    config: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    rows: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
    weights: str | None = None,
) -> tuple[float, ...]:
    """The median ms of one layer's forward for each chunk of ``rows`` tokens, on ``device``,
    its linears held as ``weights`` (``shard.model.weights``): ``"int8"``, and ``"int4"`` or
    ``"stored"`` (timed as int4 in groups of 32, what a Q4 GGUF's layers keep; other stored
    formats run other kernels), quantized; dense in ``dtype`` otherwise.

    Errors: ``ValueError`` for a chunk that does not fit the model's context."""
    generator = torch.Generator().manual_seed(0)
    layer = Block(config)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.02
    layer = layer.to(device=device, dtype=dtype)
    if weights in ("stored", "int4", "int8"):
        _quantize_linears(layer, "int8" if weights == "int8" else "int4", device)
    longest = _CONTEXT + max(rows)
    if longest > config.max_position_embeddings:
        raise ValueError(f"a {max(rows)}-token chunk does not fit the model's context")
    cos, sin = rope_tables(config, length=longest)
    heads, k_dim, v_dim = config.kv_widths
    cache = KVCache.empty(1, 1, heads, longest, k_dim, dtype=dtype, device=device, v_dim=v_dim)
    timings = []
    for s in rows:
        x = torch.randn(1, s, config.hidden_size, generator=generator).to(device, dtype)  # [1,S,D]
        rope = (
            cos[_CONTEXT : _CONTEXT + s].to(device, dtype),
            sin[_CONTEXT : _CONTEXT + s].to(device, dtype),
        )
        q_pos = torch.arange(_CONTEXT, _CONTEXT + s, device=device)[:, None]  # [S, 1]
        mask = torch.arange(_CONTEXT + s, device=device)[None, :] <= q_pos  # [S, CONTEXT+S]
        samples = []
        for i in range(warmup + repeats):
            _sync(device)
            began = time.perf_counter()
            layer(x, rope, mask, cache, 0, _CONTEXT)
            _sync(device)
            if i >= warmup:
                samples.append((time.perf_counter() - began) * 1000.0)
        timings.append(max(statistics.median(samples), 1e-3))  # never 0: the planner needs > 0
    return tuple(timings)
