"""A GGUF file opened for conversion: its checked header (``shard.convert.gguf_scan``) and its
tensors as views of a read-only map.

``GgufFile`` answers what the converter asked of ``gguf.GGUFReader`` — ``get_field(key)``
(``types``, ``contents()``) and ``tensors`` (``gguf.ReaderTensor``s, with the data views
``GGUFReader`` gives: float and integer types as their elements in numpy order, every other
type as its raw bytes, ``[..., row bytes]``) — from one bounded read of the header, so the
reader's per-element parse (a minute for a 2-million-element vocabulary) is never run. This
module imports neither torch nor safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import gguf
import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as T

from shard.convert.gguf_scan import ConvertError, GgufField, GgufLayout, TensorInfo, scan

__all__ = ["GgufFile"]

#: The types whose tensors are viewed as their elements (the rest as raw bytes), as
#: ``gguf.GGUFReader._build_tensors`` views them.
_ELEMENTS: Final[dict[T, type[np.generic]]] = {
    T.F16: np.float16,
    T.F32: np.float32,
    T.F64: np.float64,
    T.I8: np.int8,
    T.I16: np.int16,
    T.I32: np.int32,
    T.I64: np.int64,
}


class GgufFile:
    """The GGUF at ``path``, its header checked (``scan``) and its tensors mapped read-only.

    Errors: ``ConvertError`` when the header fails a check (``gguf_scan``), or the file
    changed size between the scan and the map.
    """

    def __init__(self, path: Path) -> None:
        layout = scan(path)
        data = np.memmap(path, mode="r")
        if data.size != layout.file_size:
            raise ConvertError("the file changed while it was read; try again")
        self.layout: GgufLayout = layout
        self.fields: dict[str, GgufField] = layout.fields
        self.tensors: list[gguf.ReaderTensor] = [
            _tensor(data, layout.data_offset, info) for info in layout.tensors
        ]

    def get_field(self, key: str) -> GgufField | None:
        """The metadata value under ``key``, or None."""
        return self.fields.get(key)


def _tensor(data: npt.NDArray[np.uint8], start: int, info: TensorInfo) -> gguf.ReaderTensor:
    """``info``'s tensor over the mapped file (``start``: where the data section begins)."""
    n_elements = int(np.prod(info.dims, dtype=object))
    shape: tuple[int, ...] = tuple(reversed(info.dims))
    begin = start + info.offset
    view: npt.NDArray[Any] = data[begin : begin + info.nbytes]
    if info.qtype in _ELEMENTS:
        view = view.view(_ELEMENTS[info.qtype])
    else:
        shape = gguf.quants.quant_shape_to_byte_shape(shape, info.qtype)
    return gguf.ReaderTensor(
        name=info.name,
        tensor_type=info.qtype,
        shape=np.array(info.dims, dtype=np.uint64),
        n_elements=n_elements,
        n_bytes=info.nbytes,
        data_offset=begin,
        data=view.reshape(shape),
        field=gguf.ReaderField(begin, info.name),
    )
