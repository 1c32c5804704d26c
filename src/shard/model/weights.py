"""The ``weights`` option: how a stage holds its weights, and how it combines with ``dtype``.

``weights`` is one of ``WEIGHTS``. ``"float32"``, ``"bfloat16"`` and ``"float16"`` hold
dense weights in that dtype (a quantized checkpoint is dequantized at load, exactly: the
values ``gguf`` computes); they must equal ``dtype``, the activations' dtype, since a dense
product runs in its weights' dtype. ``"stored"`` keeps a quantized checkpoint's tensors as
stored (``shard.model.quant``; a float tensor stays float, in ``dtype``); ``"int8"`` and
``"int4"`` quantize every linear and embedding weight at load (int8 per channel, int4 in
groups of 32). These three combine with any ``dtype``: their products run in the kernel's
dtype (``shard.model.quant.kernel_dtype``) and hand back ``dtype``.

No choice (``None``) is resolved from the checkpoint, in one place (``resolve_weights``, which
``shard.model.loader.load_stage`` and every swarm node apply, the latter through
``checkpoint_weights``): ``"stored"`` for a checkpoint that keeps quantized tensors (its
safetensors header lists them under ``shard.quant``), else ``dtype``'s own float weights. Every
node of a ring reads the same checkpoint (its manifest's), so every node and the local
reference resolve alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch

from shard.model.safetensors_header import SafetensorsError, quant_entries, read_header

__all__ = [
    "QUANTIZED_WEIGHTS",
    "WEIGHTS",
    "WeightsError",
    "check_weights",
    "checkpoint_weights",
    "resolve_weights",
]

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


def checkpoint_weights(model_dir: Path) -> str | None:
    """``"stored"`` when a safetensors file in ``model_dir`` keeps quantized tensors (its
    header's ``shard.quant`` metadata lists any), else None (a float checkpoint, or no
    safetensors here: a GGUF file, a directory not fetched yet). Reads headers only, so a
    joining node's fetched headers answer as the whole checkpoint does."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    return "stored" if any(_lists_quantized(f) for f in files) else None


def resolve_weights(weights: str | None, model_dir: Path, dtype: torch.dtype) -> str:
    """``weights`` if chosen, else the checkpoint's default: ``"stored"`` for a quantized
    checkpoint (``checkpoint_weights``), ``dtype``'s own floats for a float one."""
    if weights is not None:
        return weights
    return checkpoint_weights(model_dir) or str(dtype).removeprefix("torch.")


def _lists_quantized(path: Path) -> bool:
    """Whether the safetensors header of ``path`` lists quantized tensors (``shard.quant``, or
    published FP8 weights: ``shard.model.fp8``); False for a file
    too short or malformed to say (the loader refuses those, in one line, when it reads the
    file)."""
    try:
        header = read_header(path)
    except SafetensorsError:
        return False
    try:
        fp8 = any(e.dtype == "F8_E4M3" for e in header.entries.values())
        return fp8 or bool(quant_entries(header))
    except SafetensorsError:
        return False
