"""The ``weights`` option: how a stage holds its weights, and how it combines with ``dtype``.

``weights`` is one of ``WEIGHTS``. ``"float32"``, ``"bfloat16"`` and ``"float16"`` hold
dense weights in that dtype (a quantized checkpoint is dequantized at load, exactly: the
values ``gguf`` computes); they must equal ``dtype``, the activations' dtype, since a dense
product runs in its weights' dtype. ``"stored"`` keeps a quantized checkpoint's tensors as
stored (``shard.model.quant``; a float tensor stays float, in ``dtype``); ``"int8"`` and
``"int4"`` quantize every linear and embedding weight at load (int8 per channel, int4 in
groups of 32). These three combine with any ``dtype``: their products run in the kernel's
dtype (``shard.model.quant.kernel_dtype``) and hand back ``dtype``.

``None`` (no choice made) means ``dtype``'s own float weights, as before this option existed.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["QUANTIZED_WEIGHTS", "WEIGHTS", "WeightsError", "check_weights"]

WEIGHTS: Final = ("stored", "float32", "bfloat16", "float16", "int8", "int4")
QUANTIZED_WEIGHTS: Final = frozenset({"stored", "int8", "int4"})


class WeightsError(ValueError):
    """A ``weights`` value that is unknown or contradicts ``dtype``; ``str()`` is one line."""


def check_weights(weights: str | None, dtype: torch.dtype) -> None:
    """Refuse an unknown ``weights`` or a float ``weights`` other than ``dtype``."""
    if weights is None or weights in QUANTIZED_WEIGHTS:
        return
    if weights not in WEIGHTS:
        raise WeightsError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    if getattr(torch, weights) is not dtype:
        name = str(dtype).removeprefix("torch.")
        raise WeightsError(
            f"weights = {weights!r} contradicts dtype = {name!r}: dense weights compute in "
            f'their own dtype; set both to {weights!r}, or weights = "stored"/"int8"/"int4"'
        )
