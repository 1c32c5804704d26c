"""Each weight of a stored checkpoint as its safetensors header describes it, for
``shard.model.footprint.stored`` to price as the loader installs it: a quantized weight's
logical shape, kind and group with its scales and offsets folded into its bytes (``shard.quant``
metadata), a published FP8 weight with its block scales (``shard.model.fp8``).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from shard.model.safetensors_header import Entry, quant_entries, read_header

__all__ = ["StoredTensor", "stored_tensors"]


@attrs.frozen
class StoredTensor:
    """One weight of a checkpoint as its header describes it: ``shape`` its logical shape,
    ``nbytes`` its bytes in the file (codes, scales and offsets of a quantized one), ``kind``
    None for a dense tensor."""

    shape: tuple[int, ...]
    nbytes: int
    kind: str | None = None
    group: int = 0
    offset: bool = False
    scale_dtype: str = "F32"


def stored_tensors(path: Path, block: tuple[int, int] | None) -> dict[str, StoredTensor]:
    """Every weight of one safetensors file, a quantized one with its ``.scale`` and
    ``.offset`` folded in (``shard.quant`` metadata), a published FP8 one with its
    ``weight_scale_inv`` (``block``: the config's, ``shard.model.fp8``), from the checked
    header alone (``shard.model.safetensors_header``, as strict as the loader). Errors:
    ``SafetensorsError``."""
    header = read_header(path)
    quant = quant_entries(header)
    fp8 = {n: _fp8(e, block) for n, e in header.entries.items() if e.dtype == "F8_E4M3"}
    scales = {n.removesuffix("weight") + "weight_scale_inv" for n in fp8}
    out = {}
    for name, entry in header.entries.items():
        base, _, part = name.rpartition(".")
        if (part in ("scale", "offset") and base in quant) or name in scales:
            continue  # folded into its codes' entry
        if name in fp8:
            out[name] = fp8[name]
            continue
        q = quant.get(name)
        if q is None:
            out[name] = StoredTensor(entry.shape, entry.nbytes)
            continue
        extra = [header.entries.get(f"{name}.{e}") for e in ("scale", "offset")]
        out[name] = StoredTensor(
            q.shape,
            entry.nbytes + sum(e.nbytes for e in extra if e is not None),
            q.kind,
            q.group,
            q.has_offset,
            q.scale_dtype,
        )
    return out


def _fp8(entry: Entry, block: tuple[int, int] | None) -> StoredTensor:
    """An FP8 weight as the loader installs it (``shard.model.fp8.fp8_weight``): its codes
    and a float32 scale per row and column block, or dense when ``K`` is not a multiple of
    the block (or the config names no block: the loader then refuses it)."""
    n, k = entry.shape if len(entry.shape) == 2 else (0, 0)
    if block is None or not n or k % block[1]:
        return StoredTensor(entry.shape, entry.nbytes)
    return StoredTensor(entry.shape, n * k + 4 * n * (k // block[1]), "fp8", block[1], False, "F32")
