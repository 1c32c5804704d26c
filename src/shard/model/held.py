"""Weights held dequantized: a stored weight whose groups no kernel takes (int4 in groups of
16; on CUDA also int8 in groups of 16, GGUF's Q6_K, which a CPU runs on the q8 kernel,
``shard.model.q8``) is dequantized on every call (``QuantLinear``'s ``dequantize`` path),
which cost Gemma 3 270M about a quarter of its decode step here when its Q6_K weights took
it. A stage holds such weights dequantized instead: the very tensor each call would
have made, so every output keeps its bytes (``tests/test_held.py``). Only where the call
multiplies in bf16 (a CPU with bf16 instructions, CUDA: ``quant.dense_dtype``), as the plan
prices them; a CPU without bf16 keeps them as stored.

The rule is per layer, so that a layer's bytes do not depend on the stage it lands in:
``holds`` a layer's such weights, all of them, when together they add at most
``HOLD_LAYER_BYTES``. The loader applies it (``hold_small_groups``, from
``shard.model.loader.load_stage``) and ``shard.model.footprint.stored`` prices each layer by
it, so a stage holds to the byte what the plan says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from torch import nn

from shard.model.quant import QuantLinear

__all__ = ["HOLD_LAYER_BYTES", "hold_small_groups", "holds"]

#: Bytes one layer may add by holding its K-quant weights dequantized: Gemma 3 270M's (one
#: 640 x 2048 Q6_K weight, ~1 MB more in bf16) and a 1-2B model's fit; a 7B model's Q6_K
#: projections (~44 MB more each) stay as stored, dequantized per call.
HOLD_LAYER_BYTES: Final = 16 << 20


def holds(cost: int) -> bool:
    """Whether a layer whose holdable weights would add ``cost`` bytes holds them."""
    return 0 < cost <= HOLD_LAYER_BYTES


def hold_small_groups(layers: Sequence[nn.Module]) -> int:
    """Hold dequantized (``QuantLinear.hold``) the holdable weights of each of ``layers`` that
    ``holds`` says; returns the bytes added. The output keeps its bytes."""
    added = 0
    for layer in layers:
        mods = [m for m in layer.modules() if isinstance(m, QuantLinear) and m.holdable]
        cost = sum(m.hold_cost() for m in mods)
        if holds(cost):
            for m in mods:
                m.hold()
            added += cost
    return added
