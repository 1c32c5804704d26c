"""Tensor payloads: a small descriptor in the header, the raw bytes after it.

A ``Tensor`` is packed into the msgpack header as extension type ``TENSOR_EXT`` whose body is
``[dtype, [dim, ...], nbytes]``; its bytes follow the header, in the order the descriptors
appear. Hidden states are therefore never msgpack'd or compressed, and the receiver checks
dtype, shape and byte length against the limits before it copies a single payload byte.
"""

from __future__ import annotations

from typing import cast

import msgpack

from shard.messages import TENSOR_DTYPES, Tensor
from shard.wire.errors import WireError
from shard.wire.limits import WireLimits

#: msgpack extension code of a tensor descriptor; any other extension code is rejected.
TENSOR_EXT = 1

# A descriptor is a dtype name, up to max_dims small ints and a length: far under 256 bytes.
_MAX_DESCRIPTOR_BYTES = 256


def _needed_bytes(index: int, dtype: object, shape: object, limits: WireLimits) -> int:
    """Return prod(shape) * itemsize after checking dtype and every dim; raise ``WireError``."""
    if type(dtype) is not str or dtype not in TENSOR_DTYPES:
        raise WireError(f"tensor {index}: unknown dtype {dtype!r}")
    if type(shape) is not tuple:
        raise WireError(f"tensor {index}: shape must be a tuple, got {type(shape).__name__}")
    if len(shape) > limits.max_dims:
        raise WireError(f"tensor {index}: {len(shape)} dims, max_dims is {limits.max_dims}")
    need = TENSOR_DTYPES[dtype]
    for dim in shape:
        # Bounding each dim first keeps the product small even for hostile shapes.
        if type(dim) is not int or not 0 <= dim <= limits.max_tensor_bytes:
            raise WireError(f"tensor {index}: bad dim {dim!r} in shape {shape}")
        need *= dim
    if need > limits.max_tensor_bytes:
        raise WireError(
            f"tensor {index}: shape {shape} {dtype} needs {need} bytes, "
            f"max_tensor_bytes is {limits.max_tensor_bytes}"
        )
    return need


def check_tensor(index: int, tensor: Tensor, limits: WireLimits) -> None:
    """Check a tensor about to be sent: known dtype, sane shape, data length matches."""
    need = _needed_bytes(index, tensor.dtype, tensor.shape, limits)
    have = memoryview(tensor.data).nbytes
    if have != need:
        raise WireError(
            f"tensor {index}: {have} bytes of data, shape {tensor.shape} {tensor.dtype} "
            f"needs {need}"
        )


def pack_descriptor(tensor: Tensor) -> msgpack.ExtType:
    """The header's stand-in for a tensor (already checked by ``check_tensor``)."""
    body = msgpack.packb([tensor.dtype, list(tensor.shape), memoryview(tensor.data).nbytes])
    return msgpack.ExtType(TENSOR_EXT, body)


class PayloadReader:
    """msgpack ``ext_hook`` that turns each descriptor into a ``Tensor`` over the payload.

    Descriptors claim consecutive slices of ``payload``; ``finish`` checks that every payload
    byte was claimed. One reader serves one frame.
    """

    def __init__(self, payload: memoryview, limits: WireLimits) -> None:
        self._payload = payload
        self._limits = limits
        self._offset = 0
        self._count = 0

    def __call__(self, code: int, body: bytes) -> Tensor:
        index = self._count
        self._count += 1
        if code != TENSOR_EXT:
            raise WireError(f"header: unknown msgpack extension type {code}")
        dtype, shape, declared = self._parse(index, body)
        need = _needed_bytes(index, dtype, shape, self._limits)
        if type(declared) is not int or declared != need:
            raise WireError(
                f"tensor {index}: {declared!r} bytes declared, shape {shape} {dtype} needs {need}"
            )
        left = self._payload.nbytes - self._offset
        if need > left:
            raise WireError(f"tensor {index}: {need} bytes declared, only {left} left in frame")
        start, self._offset = self._offset, self._offset + need
        data = bytes(self._payload[start : self._offset])
        # _needed_bytes has checked that dtype is a str and shape a tuple of ints.
        return Tensor(dtype=cast(str, dtype), shape=cast(tuple[int, ...], shape), data=data)

    def finish(self) -> None:
        """Raise ``WireError`` if payload bytes follow the last tensor."""
        extra = self._payload.nbytes - self._offset
        if extra:
            raise WireError(f"payload: {extra} trailing bytes not claimed by any tensor")

    def _parse(self, index: int, body: bytes) -> tuple[object, object, object]:
        if len(body) > _MAX_DESCRIPTOR_BYTES:
            raise WireError(f"tensor {index}: descriptor of {len(body)} bytes is too long")
        try:
            fields = msgpack.unpackb(
                body,
                use_list=False,
                raw=False,
                max_array_len=_MAX_DESCRIPTOR_BYTES,  # body size bounds it; dims checked next
                max_map_len=0,
                max_ext_len=0,
                max_bin_len=0,
                max_str_len=32,
            )
        except Exception as exc:
            raise WireError(f"tensor {index}: malformed descriptor ({exc})") from exc
        if type(fields) is not tuple or len(fields) != 3:
            raise WireError(f"tensor {index}: descriptor must be [dtype, shape, nbytes]")
        dtype, shape, declared = fields
        return dtype, shape, declared
