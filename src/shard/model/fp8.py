"""FP8 weights with block scales, as DeepSeek-V3/R1, Kimi-K2 and MiniMax-M2 publish them.

A published FP8 checkpoint stores each large linear's ``weight`` as ``float8_e4m3fn``
``[N, K]`` beside ``weight_scale_inv``, float32 ``[ceil(N / bn), ceil(K / bk)]``: the weight is
``w[n, k] = float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]`` for the config's
``quantization_config.weight_block_size = [bn, bk]`` (128 x 128 in every published model).
That product in float32 is what transformers' dequantization computes (``Fp8Dequantize``,
the path it takes without an FP8 GPU), so ``dequantize`` here equals it bit for bit
(``tests/test_fp8.py``).

Kept as stored (``weights = "stored"``), such a weight becomes a ``Quantized`` of kind
``"fp8"``: its one-byte codes as published and the block scales repeated over each block's
rows (``[N, K / bk]`` float32, 4 bytes per 128 weights), run by ``QuantLinear``'s
dequantize-per-call path. A ``K`` that is not a multiple of ``bk`` (no published model has
one) is dequantized to a dense weight at load instead. Activations are not quantized: the
products run in the stage's compute dtype on the dequantized weight, as transformers does on
a machine without FP8 kernels (DeepSeek's own FP8 GEMM quantizes activations per 128-wide
group too; that is not what is reproduced here).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from shard.model.quant import Quantized

__all__ = ["dequantize_fp8", "fp8_weight", "quantize_fp8"]


def _check(codes: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> tuple[int, int]:
    n, k = codes.shape
    bn, bk = block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if codes.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != want:
        raise ValueError(
            f"an FP8 weight [{n}, {k}] in blocks of {bn}x{bk} needs float8_e4m3fn codes and "
            f"weight_scale_inv {list(want)}, got {codes.dtype} and {list(scale_inv.shape)}"
        )
    return n, k


def dequantize_fp8(codes: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """The float32 weight ``[N, K]`` (module docstring): codes times their block's scale."""
    n, k = _check(codes, scale_inv, block)
    bn, bk = block
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return codes.to(torch.float32) * scale


def fp8_weight(codes: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Quantized | Tensor:
    """A stored FP8 weight as ``Quantized`` (kind ``"fp8"``, group ``bk``), or dequantized to a
    float32 tensor when ``K`` is not a multiple of ``bk``."""
    n, k = _check(codes, scale_inv, block)
    bn, bk = block
    if k % bk:
        return dequantize_fp8(codes, scale_inv, block)
    rows = scale_inv.float().repeat_interleave(bn, 0)[:n].contiguous()  # [N, K / bk]
    return Quantized("fp8", codes.contiguous(), rows, None, bk)


def quantize_fp8(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``weight`` ``[N, K]`` as FP8 codes and ``weight_scale_inv`` in ``block``s, the way
    DeepSeek's converter makes them (each block's absmax mapped to e4m3's largest, 448): for
    building test checkpoints."""
    n, k = weight.shape
    bn, bk = block
    rn, rk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rn * bn, rk * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rn, bn, rk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rn, rk]
    scale_inv = amax / 448.0
    codes = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.view(rn * bn, rk * bk)[:n, :k].contiguous(), scale_inv
