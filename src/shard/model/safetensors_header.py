"""The one reader of a safetensors header, its index and shard's quantization metadata.

A safetensors file and its ``model.safetensors.index.json`` come from whoever published the
checkpoint. Every part of shard that looks at them (the loader's ``TensorFile``, ``shard plan``'s
footprint, the manifest builder, the weights resolver) reads them here, so one set of checks
holds everywhere and the rest of the code receives only what passed:

- the header: its declared length within the file and ``MAX_HEADER``; bounded JSON (no deep
  nesting); an object whose entries each have exactly a known ``dtype``, a ``shape`` of at most
  ``MAX_DIMS`` non-negative integers and ``data_offsets`` ``[start, stop]`` with
  ``stop - start`` equal to the shape's bytes; every region inside the file and no two regions
  overlapping; ``__metadata__`` a table of strings;
- the index: a JSON object whose ``weight_map`` maps tensor names to file names that stay inside
  the model's folder (no absolute path, no ``..``, no folder separators) and are regular files;
- the quantization metadata (``shard.quant``): each entry's ``kind`` is ``int4``/``int8``, its
  ``group`` a positive divisor of its ``[N, K]`` shape's ``K``, and its codes, ``.scale`` and
  ``.offset`` tensors present with exactly the shapes and dtypes that layout needs.

A refusal is one ``SafetensorsError`` (a ``ValueError``) line naming the file and the field.
This module imports neither torch nor safetensors.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from shard.model.jsonfile import loads_bounded, read_json

__all__ = [
    "DTYPE_BYTES",
    "INDEX_FILE",
    "MAX_HEADER",
    "Entry",
    "Header",
    "QuantEntry",
    "SafetensorsError",
    "quant_entries",
    "read_header",
    "read_index",
]

#: Bytes per element of each dtype safetensors names.
DTYPE_BYTES: Final[dict[str, int]] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
#: A header larger than this is refused (safetensors' own limit is 100 MB).
MAX_HEADER: Final = 100 << 20
#: The most dimensions a tensor may have (weights have 1 to 3).
MAX_DIMS: Final = 8
#: The largest index file read (real ones are well under 1 MB even for 1,000-file models).
MAX_INDEX_BYTES: Final = 64 << 20
INDEX_FILE: Final = "model.safetensors.index.json"
QUANT_METADATA: Final = "shard.quant"  # as shard.convert.gguf_import writes it


class SafetensorsError(ValueError):
    """A safetensors file, index or quantization table that cannot be used; ``str()`` says
    which file, which field and what was wrong."""


@attrs.frozen
class Entry:
    """One tensor: its dtype name, shape and absolute byte range ``[start, stop)`` in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@attrs.frozen
class Header:
    """A checked header: the file's ``size``, where its data starts (``base``: 8 + the
    header's length), its tensors and its ``__metadata__``."""

    path: Path
    size: int
    base: int
    entries: dict[str, Entry]
    metadata: dict[str, str]


@attrs.frozen
class QuantEntry:
    """A stored quantized weight ``[N, K]`` (``shard.model.quant.Quantized``'s layout)."""

    kind: str
    group: int
    shape: tuple[int, int]
    has_offset: bool
    scale_dtype: str


def read_header(path: Path, fd: int | None = None) -> Header:
    """The checked header of the safetensors file ``path`` (read through ``fd`` when given).

    Errors: ``SafetensorsError`` (module docstring)."""
    own = fd is None
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER, size - 8):
            raise SafetensorsError(
                f"{path}: header of {length} bytes in a {size}-byte file (the file is truncated "
                "or not safetensors)"
            )
        text = os.pread(fd, length, 8)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read it ({e.strerror or e})") from None
    finally:
        if own and fd is not None:
            os.close(fd)
    if len(text) != length:
        raise SafetensorsError(f"{path}: the file ends inside its header")
    data = loads_bounded(text, error=SafetensorsError, what=f"{path} header")
    if not isinstance(data, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    base = 8 + length
    metadata = _metadata(path, data.pop("__metadata__", None))
    entries = {name: _entry(path, name, v, base, size) for name, v in data.items()}
    _no_overlap(path, entries)
    return Header(path, size, base, entries, metadata)


def _metadata(path: Path, meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SafetensorsError(f"{path}: __metadata__ must map names to strings")
    return dict(meta)


def _entry(path: Path, name: str, v: Any, base: int, size: int) -> Entry:
    where = f"{path}: tensor {name[:80]!r}"
    if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{where}: an entry has exactly dtype, shape and data_offsets")
    dtype, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise SafetensorsError(f"{where}: unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(n) for n in shape):
        raise SafetensorsError(f"{where}: shape must be at most {MAX_DIMS} integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)):
        raise SafetensorsError(f"{where}: data_offsets must be two integers >= 0")
    start, stop = offsets
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if stop < start or stop - start != nbytes:
        raise SafetensorsError(
            f"{where}: data_offsets {start}..{stop} do not hold shape {shape} of {dtype} "
            f"({nbytes} bytes)"
        )
    if base + stop > size:
        raise SafetensorsError(f"{where}: runs past the end of the file (truncated)")
    return Entry(str(dtype), tuple(shape), base + start, base + stop)


def _count(n: Any) -> bool:
    return type(n) is int and n >= 0


def _no_overlap(path: Path, entries: dict[str, Entry]) -> None:
    spans = sorted((e.start, e.stop, name) for name, e in entries.items() if e.nbytes)
    for (_, stop, a), (start, _, b) in itertools.pairwise(spans):
        if start < stop:
            raise SafetensorsError(f"{path}: tensors {a[:80]!r} and {b[:80]!r} overlap")


def quant_entries(header: Header) -> dict[str, QuantEntry]:
    """``header``'s ``shard.quant`` table, each entry checked against its tensors."""
    raw = header.metadata.get(QUANT_METADATA)
    if not raw:
        return {}
    where = f"{header.path}: {QUANT_METADATA}"
    table = loads_bounded(raw, error=SafetensorsError, what=where)
    if not isinstance(table, dict):
        raise SafetensorsError(f"{where}: must be a JSON object")
    return {name: _quant(header, where, name, meta) for name, meta in table.items()}


def _quant(header: Header, where: str, name: str, meta: Any) -> QuantEntry:
    where = f"{where} {name[:80]!r}"
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{where}: must be a JSON object")
    kind, group, shape = meta.get("kind"), meta.get("group"), meta.get("shape")
    if kind not in ("int4", "int8"):
        raise SafetensorsError(f"{where}: kind must be 'int4' or 'int8', got {str(kind)[:20]!r}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_count(n) for n in shape)):
        raise SafetensorsError(f"{where}: shape must be two integers [N, K]")
    n, k = shape
    if type(group) is not int or group < 1 or k % group or (kind == "int4" and group % 2):
        raise SafetensorsError(f"{where}: group {group!r} must be a positive divisor of K={k}")
    codes = header.entries.get(name)
    scale = header.entries.get(f"{name}.scale")
    offset = header.entries.get(f"{name}.offset")
    want_codes = ("U8", (n, k // 2)) if kind == "int4" else ("I8", (n, k))
    if codes is None or (codes.dtype, codes.shape) != want_codes:
        raise SafetensorsError(f"{where}: codes must be {want_codes[0]} {list(want_codes[1])}")
    for part in (scale, offset):
        if part is scale and part is None:
            raise SafetensorsError(f"{where}: its .scale tensor is missing")
        if part is not None and (
            part.dtype not in ("F32", "F16", "BF16") or part.shape != (n, k // group)
        ):
            raise SafetensorsError(
                f"{where}: .scale/.offset must be float [{n}, {k // group}], got "
                f"{part.dtype} {list(part.shape)}"
            )
    assert scale is not None
    return QuantEntry(str(kind), group, (n, k), offset is not None, scale.dtype)


def read_index(model_dir: Path) -> dict[str, str]:
    """``model_dir``'s index: tensor name -> file name, each file a regular file inside
    ``model_dir``. Errors: ``SafetensorsError`` naming the index and the entry."""
    index = model_dir / INDEX_FILE
    data = read_json(index, max_bytes=MAX_INDEX_BYTES, error=SafetensorsError, what="an index")
    where = str(index)
    if not isinstance(data, Mapping) or not isinstance(data.get("weight_map"), Mapping):
        raise SafetensorsError(f"{where}: must be a JSON object with a weight_map object")
    weight_map: Mapping[str, Any] = data["weight_map"]
    files = set()
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise SafetensorsError(f"{where}: {name[:80]!r} maps to a non-string file name")
        files.add(file)
    for file in sorted(files):
        _check_shard_name(model_dir, where, file)
    return {str(k): str(v) for k, v in weight_map.items()}


def _check_shard_name(model_dir: Path, where: str, file: str) -> None:
    """A shard named by an index is a plain file name in ``model_dir``: no absolute path, no
    ``..``, no folder, no device or other special file, and present."""
    plain = file and "/" not in file and "\\" not in file and file not in (".", "..")
    if not plain or "\0" in file:
        raise SafetensorsError(
            f"{where}: shard name {file[:80]!r} is not a plain file name inside the model's "
            "folder (absolute paths, '..' and folders are refused)"
        )
    try:
        mode = (model_dir / file).stat().st_mode
    except OSError:
        raise SafetensorsError(
            f"{where}: names shard {file[:80]!r} which is missing; re-download the checkpoint"
        ) from None
    if not stat.S_ISREG(mode):
        raise SafetensorsError(f"{where}: shard {file[:80]!r} is not a regular file")
