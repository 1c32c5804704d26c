"""Sibling products run as one (issue 42): a layer's q, k and v projections, and its gate and
up projections, read the same input; where all run on the CPU by the same kernel path
(``QuantLinear.path``: ``int4``, or ``int8-group``, the q8 product of ``shard.model.q8``),
they are joined into one product over the weights stacked by output row.

Both kernels compute each output column from its own weight row alone, so a joined product
gives every output the bytes the separate products gave (``tests/test_fused.py``
checks it for 1 to 17 rows and for whole stages). What it saves is the kernel's fixed cost per
call and the casts around each: on the AMX Xeon of session 25, one row, one thread, SmolLM2's
q/k/v took 70 us as three products and 42 us as one.

``join_siblings(stage)`` joins in place, after loading: the joined module (``attn.qkv``,
``mlp.gate_up``, a ``JoinedInt4``) holds the stacked kernel tensors, and each sibling keeps
its name, holds nothing and runs as its slice of the joined product. Memory is unchanged;
``shard.model.footprint.measured`` counts the joined tensors once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from torch import Tensor, nn

from shard.model.q8 import Int8Group
from shard.model.quant import QuantLinear, _Int4

__all__ = ["PACK_BLOCK", "JoinedInt4", "join_siblings", "joined_of"]

#: The CPU int4 packer lays rows out in blocks of this many: packed rows stack as they are
#: only at a multiple of it (``tests/test_fused.py`` checks the packer on the host), so every
#: int4 sibling but the last must have a multiple of 64 outputs (SmolLM2's k/v: 192; Gemma 3
#: 270M's: 256). ``int8-group`` keeps the codes as stored: any row counts stack.
PACK_BLOCK: Final = 64


class JoinedInt4(nn.Module):
    """The products of ``siblings`` (one path, ``int4`` or ``int8-group``; same input width,
    group and dtype; no bias) as one: ``forward`` returns each sibling's output, in order."""

    def __init__(self, siblings: Sequence[QuantLinear]) -> None:
        super().__init__()
        self.in_features = siblings[0].in_features
        self.compute = siblings[0].compute
        self.path = siblings[0].path
        self.sizes = [s.out_features for s in siblings]
        self.parts: list[_Int4] | list[Int8Group]
        if self.path == "int8-group":
            self.parts = [Int8Group.stacked([_q8(s) for s in siblings])]
        else:
            self.parts = [_Int4.stacked([_int4(s) for s in siblings])]

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        rows = x.reshape(-1, self.in_features).to(self.compute)  # [R, in]
        out = self.parts[0].mm(rows).to(x.dtype)  # as QuantLinear.forward: [R, sum of sizes]
        lead, pieces, at = x.shape[:-1], [], 0
        for size in self.sizes:
            pieces.append(out[:, at : at + size].contiguous().reshape(*lead, size))
            at += size
        return tuple(pieces)

    def tensors(self) -> list[Tensor]:
        """The stacked codes and scales (and zeros, or offsets)."""
        return [t for p in self.parts for t in p.tensors()]


def _q8(layer: QuantLinear) -> Int8Group:
    part = layer._parts[0]
    assert isinstance(part, Int8Group)
    return part


def _int4(layer: QuantLinear) -> _Int4:
    part = layer._parts[0]
    assert isinstance(part, _Int4)
    return part


def _joinable(siblings: Sequence[nn.Module | None]) -> bool:
    if not all(isinstance(s, QuantLinear) for s in siblings):
        return False
    lin = [s for s in siblings if isinstance(s, QuantLinear)]
    first = lin[0]
    if first.path != "int8-group" and any(s.out_features % PACK_BLOCK for s in lin[:-1]):
        return False
    offsets = {isinstance(p, Int8Group) and p.offset is not None for s in lin for p in s._parts}
    return (
        first.path in ("int4", "int8-group")
        and len(offsets) == 1  # int8-group: all with offsets or none
        and all(
            s.path == first.path
            and s.bias is None
            and s.joined is None
            and s.in_features == first.in_features
            and s.compute == first.compute
            and s._parts[0].group == first._parts[0].group
            and s._parts[0].device.type == "cpu"  # the CUDA packer's layout is not by row
            for s in lin
        )
    )


def _join(owner: nn.Module, name: str, sibling_names: Sequence[str]) -> bool:
    siblings: list[nn.Module | None] = [getattr(owner, n, None) for n in sibling_names]
    if not _joinable(siblings):
        return False
    lin = [s for s in siblings if isinstance(s, QuantLinear)]
    joined = JoinedInt4(lin)
    for i, s in enumerate(lin):
        s.join(joined, i)
    owner.add_module(name, joined)
    return True


def join_siblings(stage: nn.Module) -> int:
    """Join every attention's q/k/v and every dense feed-forward's gate/up in ``stage`` where
    all are CPU products of one kernel path (module docstring); how many groups were joined."""
    count = 0
    for module in list(stage.modules()):
        if hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            count += _join(module, "qkv", ("q_proj", "k_proj", "v_proj"))
        if hasattr(module, "gate_proj") and hasattr(module, "up_proj"):
            count += _join(module, "gate_up", ("gate_proj", "up_proj"))
    return count


def joined_of(module: nn.Module, name: str) -> JoinedInt4 | None:
    """``module``'s joined product ``name`` (``qkv``, ``gate_up``), if it has one."""
    joined = module._modules.get(name)
    return joined if isinstance(joined, JoinedInt4) else None
