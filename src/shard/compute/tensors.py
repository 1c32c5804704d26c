"""``torch.Tensor`` <-> ``shard.messages.Tensor``: raw row-major bytes, never pickle.

The wire carries a dtype name, a shape and the bytes. ``from_wire`` validates all three before
building anything, because the bytes come from a peer: an unknown dtype or a length that does
not match the shape is a ``ValueError``, not a crash deep inside torch.
"""

from __future__ import annotations

import torch

from shard.messages import TENSOR_DTYPES
from shard.messages import Tensor as WireTensor

__all__ = ["from_wire", "to_wire"]

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in TENSOR_DTYPES}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _TORCH_DTYPES.items()}


def to_wire(t: torch.Tensor) -> WireTensor:
    """Copy ``t`` (any device, any layout) into a wire payload of its row-major bytes."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot travel on the wire; use one of {list(_NAMES)}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # A uint8 view is dtype-agnostic (numpy has no bfloat16), and .numpy().tobytes() copies once.
    data = flat.view(torch.uint8).numpy().tobytes()
    return WireTensor(dtype=name, shape=tuple(int(d) for d in t.shape), data=data)


def from_wire(w: WireTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Build a tensor on ``device`` from a wire payload; ``ValueError`` if dtype, shape or size
    is wrong (checked before anything is allocated, on the CPU or the GPU).

    The result owns its memory (writable, independent of ``w.data``).
    """
    if w.dtype not in TENSOR_DTYPES or w.dtype not in _TORCH_DTYPES:
        raise ValueError(f"unknown tensor dtype {w.dtype!r}; expected one of {list(_TORCH_DTYPES)}")
    if any(not isinstance(d, int) or d < 0 for d in w.shape):
        raise ValueError(f"bad tensor shape {w.shape!r}: dimensions must be non-negative ints")
    if len(w.data) != w.nbytes:
        raise ValueError(
            f"tensor payload is {len(w.data)} bytes but {w.dtype} {w.shape} needs {w.nbytes}"
        )
    dtype = _TORCH_DTYPES[w.dtype]
    if w.nbytes == 0:
        return torch.empty(w.shape, dtype=dtype, device=device)
    buf = bytearray(w.data)  # writable copy: torch.frombuffer warns on read-only buffers
    # Copied into torch's own 64-byte aligned memory (on ``device``): CPU matmul kernels sum
    # in an order that depends on their operands' alignment, and a bytearray's is the
    # allocator's whim.
    return torch.frombuffer(buf, dtype=dtype).reshape(w.shape).to(device=device, copy=True)
