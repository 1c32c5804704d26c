"""What one conversion writes, tensor by tensor (``shard.convert.gguf_import``): a ``Planned``
output tensor names its source GGUF tensor and how it is undone on the way out, and the expert
tensors llama.cpp stores fused are planned here — split per expert (Mixtral, Qwen3-MoE, GLM)
or put back into gpt-oss's fused layout, per expert where the stored format is kept. This
module imports neither torch nor safetensors.
"""

from __future__ import annotations

from typing import Any

import attrs
import gguf
import numpy.typing as npt

from shard.convert.gguf_common import ConvertError
from shard.convert.gguf_moe import FUSED_EXPERTS
from shard.convert.quant_gguf import stored_layout

__all__ = ["Planned", "fuse_experts", "split_experts"]


@attrs.frozen
class Planned:
    """One output tensor: its HF name and shape, where it comes from, its head count when it
    is a Q/K projection whose rows llama.cpp permuted (None otherwise), whether it is a
    norm weight stored as ``1 + w``, and which slice of a fused 3-D expert tensor it is.
    gpt-oss: ``up`` is interleaved with ``source`` (the gate) along the expert's output axis,
    gate first; ``transpose`` swaps the last two axes (``[E, out, in]`` -> ``[E, in, out]``).
    ``latent``: MLA's ``kv_b_proj`` joined from ``deepseek2``'s split ``attn_k_b`` (``source``)
    and ``attn_v_b`` (``up``; ``shard.convert.gguf_mla``). qwen3next (``shard.convert.gguf_next``):
    ``a_log``: ``A_log`` read back from ``ssm_a``; ``qkvz``: ``in_proj_qkvz`` regrouped from
    ``attn_qkv`` (``source``) and ``attn_gate`` (``up``), ``(key heads, key head size, value
    rows per key head)``."""

    name: str
    shape: tuple[int, ...]
    source: gguf.ReaderTensor
    heads: int | None
    plus_one: bool = False
    expert: int | None = None
    up: gguf.ReaderTensor | None = None
    transpose: bool = False
    latent: bool = False
    a_log: bool = False
    qkvz: tuple[int, int, int] | None = None

    def data(self, source: gguf.ReaderTensor | None = None) -> npt.NDArray[Any]:
        """``source``'s (default: the source's) raw data, its expert's slice when this is one
        expert's (blocks run along the last axis)."""
        data: npt.NDArray[Any] = (source or self.source).data
        return data if self.expert is None else data[self.expert]

    @property
    def dense_only(self) -> bool:
        """Written as float32 whatever the source's format (a rebuilt fused tensor, a norm)."""
        rebuilt = self.up is not None or self.transpose
        undone = self.latent or self.a_log or self.qkvz is not None
        return self.plus_one or undone or (self.expert is None and rebuilt)


def split_experts(
    t: gguf.ReaderTensor, shape: tuple[int, ...], prefix: str, proj: str
) -> list[Planned]:
    """One planned 2-D tensor per expert of the fused ``[E, out, in]`` tensor ``t``."""
    if len(shape) != 3:
        raise ConvertError(f"tensor {t.name!r} has shape {shape}; expected [experts, out, in]")
    return [
        Planned(f"{prefix}.{e}.{proj}.weight", shape[1:], t, None, expert=e)
        for e in range(shape[0])
    ]


def fuse_experts(
    layer: int, suffix: str, parts: dict[str, gguf.ReaderTensor], *, stored: bool
) -> list[Planned]:
    """gpt-oss's expert tensors of one layer (weights or biases) as its fused layout
    (module docstring): per expert where ``stored`` keeps their format, else whole."""
    missing = sorted(set(FUSED_EXPERTS) - set(parts))
    if missing:
        raise ConvertError(f"layer {layer} has no {', '.join(missing)}.{suffix}; incomplete")
    gate, up, down = (parts[k] for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    g_shape, d_shape = (tuple(int(d) for d in reversed(t.shape.tolist())) for t in (gate, down))
    rank = 3 if suffix == "weight" else 2
    if tuple(up.shape.tolist()) != tuple(gate.shape.tolist()) or len(g_shape) != rank:
        raise ConvertError(f"layer {layer}: ffn_gate_exps and ffn_up_exps shapes disagree")
    if len(d_shape) != rank or d_shape[0] != g_shape[0]:
        raise ConvertError(f"layer {layer}: ffn_down_exps.{suffix} has shape {list(d_shape)}")
    prefix = f"model.layers.{layer}.mlp.experts"
    if suffix == "bias":  # [E, F] each -> [E, 2F]; down [E, D] as is
        e, f = g_shape
        return [
            Planned(f"{prefix}.gate_up_proj_bias", (e, 2 * f), gate, None, up=up),
            Planned(f"{prefix}.down_proj_bias", d_shape, down, None),
        ]
    e, f, d = g_shape
    same = stored_layout(gate.tensor_type) == stored_layout(up.tensor_type)
    plan: list[Planned] = []
    if stored and same and stored_layout(gate.tensor_type) is not None:
        name = f"{prefix}.gate_up_proj"
        plan += [Planned(f"{name}.{i}", (2 * f, d), gate, None, expert=i, up=up) for i in range(e)]
    else:
        plan.append(
            Planned(f"{prefix}.gate_up_proj", (e, d, 2 * f), gate, None, up=up, transpose=True)
        )
    if stored and stored_layout(down.tensor_type) is not None:
        plan += [
            Planned(f"{prefix}.down_proj.{i}", d_shape[1:], down, None, expert=i) for i in range(e)
        ]
    else:
        plan.append(
            Planned(f"{prefix}.down_proj", (e, d_shape[2], d_shape[1]), down, None, transpose=True)
        )
    return plan
