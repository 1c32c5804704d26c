"""The bounded read of a GGUF file's header: its metadata and where its tensors lie.

A GGUF comes from strangers. ``gguf.GGUFReader`` trusts every count it reads: it loops over a
declared array length (2^40 elements: minutes and gigabytes; even the 2 million a real file
may declare cost it a minute, a numpy view each), builds every tensor it is told of, and
accepts tensor offsets that are unaligned, overlapping or past the end. ``scan`` reads the
same layout with ``struct`` over a read-only map of the file and checks each declared count
and length against the bytes left and a maximum *before* looping or allocating:

- the magic, version 2 or 3, little-endian;
- ``n_tensors`` <= ``MAX_TENSORS``, ``n_kv`` <= ``MAX_KEYS``; key and string lengths, array
  lengths (``MAX_ARRAY`` each, ``MAX_ELEMENTS`` in all), no nested arrays, known value types,
  no key twice;
- per tensor: a UTF-8 name shorter than 64 bytes (llama.cpp's ``GGML_MAX_NAME``) and not
  seen before, 1 to 4 positive dims, a known ggml type whose block divides the row, and a
  byte size ``product(dims) / block_size * type_size``;
- the data section as llama.cpp's ``gguf_init_from_file`` requires it: each tensor starts
  where the one before ends, padded to ``general.alignment`` (default 32, a power of two,
  a ``uint32``), so offsets are aligned and no two tensors overlap; the last ends inside the
  file.

It returns the layout (``GgufLayout``): every metadata value, typed as stored
(``GgufField``), and every tensor's place; ``shard.convert.gguf_file`` maps the tensors. The
metadata *values* the converter uses are checked where it reads them
(``shard.convert.gguf_common``). Errors: ``ConvertError`` naming the field and what is wrong
(the caller adds the file). Nothing here imports torch or numpy.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Final

import attrs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = [
    "MAX_ARRAY",
    "MAX_ELEMENTS",
    "MAX_KEYS",
    "MAX_TENSORS",
    "ConvertError",
    "GgufField",
    "GgufLayout",
    "TensorInfo",
    "scan",
]


class ConvertError(Exception):
    """A GGUF file cannot be converted; the message says why and what to do. Defined here, in
    the first reader of a file, which imports no other module of the converter: every other
    one raises it too (``gguf_common`` and ``gguf_arch`` re-export it)."""


MAGIC: Final = b"GGUF"
MAX_TENSORS: Final = 1 << 16
"""Tensors per file; the largest real checkpoints (DeepSeek, GLM-4.5) have under 2,000."""
MAX_KEYS: Final = 1 << 12
"""Metadata keys per file; real files have under 100."""
MAX_KEY_BYTES: Final = 1 << 10
MAX_STRING: Final = 1 << 24
"""Bytes in one string value (a chat template is tens of KiB)."""
MAX_ARRAY: Final = 1 << 20
"""Elements in one metadata array (the largest vocabularies have 262,144 tokens)."""
MAX_ELEMENTS: Final = 1 << 21
"""Array elements in all (one Python object each once read); Gemma 3's tokens, scores and
types are 786,432."""
MAX_NAME_BYTES: Final = 63  # llama.cpp's GGML_MAX_NAME (64) less its NUL
MAX_DIMS: Final = 4
MAX_ELEMENTS_PER_TENSOR: Final = 1 << 48
MAX_ALIGNMENT: Final = 1 << 16

_SCALARS: Final = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_TYPES: Final = {int(t): t for t in GGUFValueType}
_GGML_TYPES: Final = {int(t): t for t in GGML_QUANT_SIZES}


@attrs.frozen
class GgufField:
    """One metadata value as stored: ``types`` is ``[kind]``, or ``[ARRAY, item kind]`` for a
    non-empty array (``[ARRAY]`` for an empty one), as ``gguf.ReaderField.types`` has it."""

    name: str
    types: list[GGUFValueType]
    value: Any

    def contents(self) -> Any:
        """The value: a Python scalar or string, or a list of them."""
        return self.value


@attrs.frozen
class TensorInfo:
    """One tensor's header entry: ``dims`` innermost first (as stored), ``offset`` into the
    data section, ``nbytes`` its data's size."""

    name: str
    dims: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int


@attrs.frozen
class GgufLayout:
    """A GGUF's checked layout: version, alignment, where the data section starts (bytes into
    the file), the file's size and the tensors in header order."""

    version: int
    alignment: int
    data_offset: int
    file_size: int
    fields: dict[str, GgufField]
    tensors: tuple[TensorInfo, ...]


def scan(path: Path) -> GgufLayout:
    """The checked layout of the GGUF at ``path`` (module docstring for what is checked).

    Errors: ``ConvertError`` on the first check that fails, naming the field.
    """
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ConvertError(f"header: {size} bytes is too short for a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Cursor(data, size).layout()


class _Cursor:
    """A read position over the mapped file; every read checks the bytes left first."""

    def __init__(self, data: mmap.mmap, size: int) -> None:
        self.data = data
        self.size = size
        self.at = 0
        self.elements = 0

    def skip(self, n: int, what: str) -> int:
        """Move past ``n`` bytes, returning where they start."""
        if n > self.size - self.at:
            raise ConvertError(
                f"{what}: needs {n} bytes at offset {self.at} but the file ends at {self.size}"
            )
        start, self.at = self.at, self.at + n
        return start

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        start = self.skip(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from("<" + fmt, self.data, start)
        return value  # type: ignore[no-any-return]

    def uint(self, fmt: str, what: str) -> int:
        return int(self.unpack(fmt, what))

    def string(self, what: str, limit: int) -> str:
        n = self.uint("Q", f"{what} length")
        if n > limit:
            raise ConvertError(f"{what}: declares {n} bytes; at most {limit} are read")
        start = self.skip(n, what)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ConvertError(f"{what}: not UTF-8") from None

    def count(self, what: str, limit: int, min_bytes: int) -> int:
        """A declared count, checked against ``limit`` and the bytes left (``min_bytes`` the
        least one item can take) before anything loops over it."""
        n = self.uint("Q", what)
        if n > limit:
            raise ConvertError(f"{what}: declares {n}; at most {limit} are read")
        if n * min_bytes > self.size - self.at:
            raise ConvertError(f"{what}: declares {n} but the file has room for fewer")
        return n

    def layout(self) -> GgufLayout:
        if self.data[self.skip(4, "magic") : 4] != MAGIC:
            raise ConvertError("magic: not a GGUF file (it does not start with 'GGUF')")
        version = self.uint("I", "version")
        if version not in (2, 3):
            swapped = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ConvertError(
                f"version: {version} is not a GGUF version read here (2 or 3, little-endian)"
                f"{swapped}"
            )
        n_tensors = self.count("tensor count", MAX_TENSORS, 8 + 1 + 4 + 8 + 4 + 8)
        n_kv = self.count("metadata key count", MAX_KEYS, 8 + 1 + 4 + 1)
        fields: dict[str, GgufField] = {}
        for _ in range(n_kv):
            key = self.string("metadata key", MAX_KEY_BYTES)
            if key in fields:
                raise ConvertError(f"{_show(key)}: the key appears twice")
            types, value = self.value(_show(key))
            fields[key] = GgufField(key, types, value)
        alignment = _alignment(fields.get("general.alignment"))
        infos = [self.tensor_info(i) for i in range(n_tensors)]
        data_offset = -(-self.at // alignment) * alignment
        tensors = self._place(infos, data_offset, alignment)
        return GgufLayout(version, alignment, data_offset, self.size, fields, tensors)

    def value(self, key: str) -> tuple[list[GGUFValueType], Any]:
        """Read one value: its types (``GgufField.types``) and the value."""
        kind = self.value_type(key)
        if kind in _SCALARS:
            return [kind], self.unpack(_SCALARS[kind], key)
        if kind == GGUFValueType.STRING:
            return [kind], self.string(key, MAX_STRING)
        item = self.value_type(f"{key} (array item type)")
        if item == GGUFValueType.ARRAY:
            raise ConvertError(f"{key}: an array of arrays; not read here")
        width = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
        n = self.count(f"{key} (array length)", MAX_ARRAY, width)
        self.elements += n
        if self.elements > MAX_ELEMENTS:
            raise ConvertError(f"{key}: the metadata arrays exceed {MAX_ELEMENTS} elements")
        types: list[GGUFValueType] = [kind, item] if n else [kind]
        if item in _SCALARS:
            start = self.skip(n * width, key)
            return types, list(struct.unpack_from(f"<{n}{_SCALARS[item]}", self.data, start))
        return types, [self.string(key, MAX_STRING) for _ in range(n)]

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.uint("I", f"{what} type")
        if raw not in _TYPES:
            raise ConvertError(f"{what}: unknown value type {raw}")
        return _TYPES[raw]

    def tensor_info(self, index: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string(f"tensor {index} name", MAX_NAME_BYTES)
        n_dims = self.uint("I", f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ConvertError(f"tensor {name!r} n_dims: {n_dims}; expected 1 to {MAX_DIMS}")
        dims = tuple(self.uint("Q", f"tensor {name!r} dims") for _ in range(n_dims))
        raw = self.uint("I", f"tensor {name!r} type")
        if raw not in _GGML_TYPES:
            raise ConvertError(f"tensor {name!r} type: {raw} is not a known ggml type")
        return name, dims, _GGML_TYPES[raw], self.uint("Q", f"tensor {name!r} offset")

    def _place(
        self,
        infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]],
        data_offset: int,
        alignment: int,
    ) -> tuple[TensorInfo, ...]:
        """The tensors, each checked to start where the one before ends (padded)."""
        names: set[str] = set()
        tensors: list[TensorInfo] = []
        expected = 0
        for name, dims, qtype, offset in infos:
            if name in names:
                raise ConvertError(f"tensor {name!r}: the name appears twice")
            names.add(name)
            nbytes = _nbytes(name, dims, qtype)
            if offset % alignment:
                raise ConvertError(
                    f"tensor {name!r} offset: {offset} is not a multiple of general.alignment "
                    f"{alignment}"
                )
            if offset != expected:
                raise ConvertError(_misplaced(name, offset, expected, tensors))
            end = data_offset + offset + nbytes
            if end > self.size:
                raise ConvertError(
                    f"tensor {name!r}: its {nbytes} bytes at {data_offset + offset} run past "
                    f"the end of the file ({self.size} bytes)"
                )
            tensors.append(TensorInfo(name, dims, qtype, offset, nbytes))
            expected = offset + -(-nbytes // alignment) * alignment
        return tuple(tensors)


def _misplaced(name: str, offset: int, expected: int, before: list[TensorInfo]) -> str:
    """Why ``name`` at ``offset`` is not where the tensors ``before`` it end (``expected``)."""
    if not before:
        return f"tensor {name!r} offset: {offset}; the first tensor starts the data section (0)"
    prev = before[-1]
    how = "overlaps" if offset < expected else "leaves a gap after"
    return (
        f"tensor {name!r} offset: {offset} {how} tensor {prev.name!r}, whose dims "
        f"{list(prev.dims)} of {prev.qtype.name} take {prev.nbytes} bytes (padded, up to "
        f"{expected}); one of the two lies about its offset or size"
    )


def _show(key: str) -> str:
    """A key as a message shows it: as is, or quoted and escaped when it has characters that
    are not printable (a refusal stays one line)."""
    return key if key.isprintable() else repr(key)


def _alignment(field: GgufField | None) -> int:
    """``general.alignment`` (default 32): a uint32, a power of two."""
    if field is None:
        return 32
    align = field.value
    if field.types != [GGUFValueType.UINT32] or not isinstance(align, int):
        kind = " of ".join(t.name for t in field.types)
        raise ConvertError(f"general.alignment: must be a uint32, not {kind}")
    if align < 1 or align > MAX_ALIGNMENT or align & (align - 1):
        raise ConvertError(
            f"general.alignment: {align} is not a power of two up to {MAX_ALIGNMENT}"
        )
    return align


def _nbytes(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    """The tensor's data size, from positive dims whose product is bounded."""
    n = 1
    for d in dims:
        if d < 1:
            raise ConvertError(f"tensor {name!r} dims: {list(dims)} has a dimension below 1")
        n *= d
        if n > MAX_ELEMENTS_PER_TENSOR:
            raise ConvertError(f"tensor {name!r} dims: {list(dims)} is too many elements")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise ConvertError(
            f"tensor {name!r} dims: a row of {dims[0]} is not a whole number of "
            f"{qtype.name} blocks ({block} values each)"
        )
    return n // block * type_size
