"""GGUF files built field by field with ``struct``, to say what ``gguf.GGUFWriter`` never
writes: a declared array length that lies, an unaligned or overlapping tensor offset, a count
stored as a string or a type GGUF does not define (``tests/test_gguf_hostile.py``).

``read_doc`` turns a valid GGUF into plain records (``Doc``); ``encode`` writes records back,
byte for byte what the gguf package writes when nothing was changed.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import attrs
import gguf
from gguf import GGUFValueType as V

__all__ = ["FORMATS", "Doc", "Field", "Tensor", "encode", "read_doc"]


@attrs.frozen
class Field:
    """One metadata key: its value type, value, and for an array its item type (``length``:
    the declared length when it should lie)."""

    key: str
    kind: int
    value: Any
    item: int | None = None
    length: int | None = None


@attrs.frozen
class Tensor:
    """One tensor: dims innermost first, ggml type, raw data (``offset``: a lie, if set)."""

    name: str
    dims: tuple[int, ...]
    qtype: int
    data: bytes
    offset: int | None = None


@attrs.frozen
class Doc:
    fields: tuple[Field, ...]
    tensors: tuple[Tensor, ...]

    def field(self, key: str, **changes: Any) -> Doc:
        """This file with ``key`` changed (added when absent; ``kind=None`` removes it)."""
        fields = [f for f in self.fields if f.key != key]
        if changes.get("kind", 0) is not None:
            old = next((f for f in self.fields if f.key == key), Field(key, V.UINT32, 0))
            fields.append(attrs.evolve(old, **changes))
        return attrs.evolve(self, fields=tuple(fields))

    def tensor(self, which: str, **changes: Any) -> Doc:
        """This file with tensor ``which`` changed (``drop=True`` removes it)."""
        drop = changes.pop("drop", False)
        tensors = [
            t if t.name != which else attrs.evolve(t, **changes)
            for t in self.tensors
            if not (drop and t.name == which)
        ]
        return attrs.evolve(self, tensors=tuple(tensors))


FORMATS = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.BOOL: "?",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
}


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _scalar(kind: int, value: Any) -> bytes:
    if kind == V.STRING:
        return _string(value)
    if kind not in FORMATS:
        return b""  # a type GGUF does not define: no payload to write
    return struct.pack("<" + FORMATS[V(kind)], value)


def encode(doc: Doc, *, version: int = 3, counts: tuple[int, int] | None = None) -> bytes:
    """``doc`` as GGUF bytes, tensors laid out one after another (32-byte alignment, or
    ``general.alignment`` when it is a plain uint32); ``counts`` lies about (tensors, keys)."""
    n_tensors, n_kv = counts or (len(doc.tensors), len(doc.fields))
    out = [b"GGUF", struct.pack("<IQQ", version, n_tensors, n_kv)]
    align = 32
    for f in doc.fields:
        out.append(_string(f.key) + struct.pack("<I", f.kind))
        if f.kind == V.ARRAY:
            assert f.item is not None
            n = len(f.value) if f.length is None else f.length
            out.append(struct.pack("<IQ", f.item, n))
            out += [_scalar(f.item, v) for v in f.value]
        else:
            out.append(_scalar(f.kind, f.value))
        if f.key == "general.alignment" and f.kind == V.UINT32 and f.value in (8, 16, 32, 64):
            align = f.value
    offset = 0
    placed = []
    for t in doc.tensors:
        at = offset if t.offset is None else t.offset
        out.append(_string(t.name) + struct.pack("<I", len(t.dims)))
        out.append(struct.pack(f"<{len(t.dims)}QIQ", *t.dims, t.qtype, at))
        placed.append((at, t.data))
        offset += -(-len(t.data) // align) * align
    head = b"".join(out)
    head += bytes(-len(head) % align)
    body = bytearray(max((at + len(d) for at, d in placed), default=0))
    for at, data in placed:
        body[at : at + len(data)] = data
    return head + bytes(body) + bytes(-len(body) % align)


def read_doc(path: Path) -> Doc:
    """``path`` (a valid GGUF) as plain records."""
    reader = gguf.GGUFReader(path)
    fields = []
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        if f.types[0] == V.ARRAY:
            fields.append(Field(f.name, V.ARRAY, f.contents(), f.types[-1]))
        else:
            fields.append(Field(f.name, f.types[0], f.contents()))
    tensors = tuple(
        Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data.tobytes())
        for t in reader.tensors
    )
    return Doc(tuple(fields), tensors)
