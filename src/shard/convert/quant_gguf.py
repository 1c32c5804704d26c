"""GGUF quantized blocks as ``Quantized`` weights, without going through floats.

Each format's block is split into its integer codes and per-group scale and offset so that
``scale * code + offset`` is the value ``gguf.quants.dequantize`` computes, the scale and
offset computed in float32 from the block's f16 fields as gguf does:

=======  ==========================  ======================================================
format   ``Quantized``               value
=======  ==========================  ======================================================
Q4_0     int4, groups of 32          ``d * q - 8 d``
Q4_1     int4, groups of 32          ``d * q + m``
Q4_K     int4, groups of 32          ``(d sc_j) * q - dmin m_j`` (6-bit ``sc_j``, ``m_j``)
Q8_0     int8, groups of 32          ``d * q``
Q5_0     int8, groups of 32          ``d * (q - 16)``
Q5_1     int8, groups of 32          ``d * q + m``
Q5_K     int8, groups of 32          ``(d sc_j) * q - dmin m_j``
Q6_K     int8, groups of 16          ``(d sc_j) * (q - 32)`` (8-bit signed ``sc_j``)
MXFP4    int8, groups of 32          ``2^(e - 128) * v`` (``v``: the e2m1 value doubled, one
                                     of 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12; ``e``: E8M0)
=======  ==========================  ======================================================

Every other type (F32, F16, BF16, Q2_K, Q3_K, the IQ formats, ...) returns None: the loader
dequantizes it. The representation is exact (``tests/test_quant_gguf.py`` checks
``dequantize()`` equals gguf's bit for bit); where a kernel then rounds the scales to bf16 is
``shard.model.quant``'s concern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

if TYPE_CHECKING:
    from shard.model.quant import Quantized

__all__ = ["STORED_FORMATS", "Decoded", "decode", "from_gguf", "stored_layout"]

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Parts = tuple[npt.NDArray[np.int16], F32, F32 | None]  # codes [B, 256|32], scale, offset [B, G]


def _f16(raw: U8) -> F32:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: U8, width: int) -> npt.NDArray[np.int16]:
    """gguf's layout: in each run of ``width`` bytes, low nibbles first, then high nibbles."""
    b = qs.shape[0]
    q = qs.reshape(b, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(b, -1).astype(np.int16)


def _high_bits(qh: U8, count: int) -> npt.NDArray[np.int16]:
    """Bit ``i`` of a little-endian 32-bit word, for ``i < count`` (Q5_0, Q5_1)."""
    words = qh.copy().view(np.uint32).reshape(-1, 1)
    return ((words >> np.arange(count, dtype=np.uint32)) & 1).astype(np.int16)


def _q4_0(b: U8) -> Parts:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8 * d


def _q4_1(b: U8) -> Parts:
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: U8) -> Parts:
    return b[:, 2:].copy().view(np.int8).astype(np.int16), _f16(b[:, :2]), None


def _q5_0(b: U8) -> Parts:
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return q - 16, _f16(b[:, :2]), None


def _q5_1(b: U8) -> Parts:
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return q, _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: U8) -> tuple[F32, F32]:
    """Q4_K/Q5_K: per sub-block scale ``d * sc_j`` and offset ``-dmin * m_j`` ``[B, 8]``."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q4_k(b: U8) -> Parts:
    scale, offset = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, offset


def _q5_k(b: U8) -> Parts:
    scale, offset = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & 1).astype(np.int16).reshape(n, -1)  # [B, 256]: sub-block j takes bit j
    return _nibbles(b[:, 48:], 32) | (high << 4), scale, offset


#: MXFP4's 4-bit codes as their e2m1 values doubled (ggml's ``kvalues_mxfp4``).
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)


def _mxfp4(b: U8) -> Parts:
    """gpt-oss's experts: one E8M0 exponent byte then 16 bytes of nibbles; the scale is
    ``2^(e - 128)`` (ggml's ``e8m0_to_fp32_half``: half of ``2^(e - 127)``, the code being the
    value doubled), a float32 exactly, subnormal for ``e < 2``."""
    e = b[:, :1].astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return _E2M1_DOUBLED[_nibbles(b[:, 1:], 16)], bits.astype(np.uint32).view(np.float32), None


def _q6_k(b: U8) -> Parts:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (
        qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    ) & 3
    q = low.reshape(n, -1).astype(np.int16) | (high.reshape(n, -1).astype(np.int16) << 4)
    return q - 32, d * sc, None


_DECODERS: dict[T, tuple[str, int, Callable[[U8], Parts]]] = {
    T.Q4_0: ("int4", 32, _q4_0),
    T.Q4_1: ("int4", 32, _q4_1),
    T.Q4_K: ("int4", 32, _q4_k),
    T.Q8_0: ("int8", 32, _q8_0),
    T.Q5_0: ("int8", 32, _q5_0),
    T.Q5_1: ("int8", 32, _q5_1),
    T.Q5_K: ("int8", 32, _q5_k),
    T.Q6_K: ("int8", 16, _q6_k),
    T.MXFP4: ("int8", 32, _mxfp4),
}

#: The GGUF types ``from_gguf`` keeps quantized.
STORED_FORMATS = frozenset(t.name for t in _DECODERS)


@attrs.frozen
class Decoded:
    """A GGUF tensor as integer codes ``[N, K]`` and float32 ``scale`` and ``offset``
    ``[N, K // group]`` (numpy: ``shard convert`` writes these without importing torch)."""

    kind: str
    group: int
    codes: npt.NDArray[np.int16]
    scale: F32
    offset: F32 | None

    def rows(self, order: npt.NDArray[np.intp]) -> Decoded:
        """The same weight with its rows taken in ``order`` (exact: groups run along K)."""
        offset = None if self.offset is None else self.offset[order]
        return attrs.evolve(self, codes=self.codes[order], scale=self.scale[order], offset=offset)

    def arrays(self) -> tuple[npt.NDArray[np.generic], F32, F32 | None]:
        """What a packed checkpoint stores: codes (uint8 nibbles, even column low, for int4;
        int8 for int8), scale, offset."""
        c = self.codes
        if self.kind == "int4":
            packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
            return packed, self.scale, self.offset
        return c.astype(np.int8), self.scale, self.offset


def decode(data: U8, qtype: T, shape: tuple[int, int]) -> Decoded | None:
    """Codes, scales and offsets of a GGUF tensor's raw blocks ``data`` (``[N, bytes per
    row]``) of logical ``shape`` ``[N, K]``; None for a type kept as floats."""
    if qtype not in _DECODERS:
        return None
    kind, group, fn = _DECODERS[qtype]
    n, k = shape
    _, block_bytes = GGML_QUANT_SIZES[qtype]
    codes, scale, offset = fn(np.ascontiguousarray(data).reshape(-1, block_bytes))
    return Decoded(
        kind,
        group,
        codes.reshape(n, k),
        scale.astype(np.float32).reshape(n, k // group),
        None if offset is None else offset.astype(np.float32).reshape(n, k // group),
    )


def stored_layout(qtype: T) -> tuple[str, int, bool] | None:
    """``(kind, group, has_offset)`` of the stored form of ``qtype`` (None: kept as floats),
    known without decoding, so a writer can lay out its header first."""
    if qtype not in _DECODERS:
        return None
    kind, group, _ = _DECODERS[qtype]
    return kind, group, qtype not in (T.Q8_0, T.Q5_0, T.Q6_K, T.MXFP4)


def from_gguf(data: U8, qtype: T, shape: tuple[int, int]) -> Quantized | None:
    """``decode`` as a torch ``Quantized`` (None for a type kept as floats)."""
    import torch

    from shard.model.quant import Quantized

    d = decode(data, qtype, shape)
    if d is None:
        return None
    codes, scale, offset = d.arrays()
    o = None if offset is None else torch.from_numpy(np.ascontiguousarray(offset))
    if d.kind == "int4":
        return Quantized("int4", torch.from_numpy(codes), torch.from_numpy(scale), o, d.group)
    return Quantized("int8", torch.from_numpy(codes), torch.from_numpy(scale), o, d.group)
