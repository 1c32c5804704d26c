"""A safetensors file read tensor by tensor into memory torch owns, without mapping the file.

safetensors' ``safe_open`` maps the whole file, and every page a read touches counts in the
process's resident set until the file is closed: loading the bundled SmolLM2 held its 112 MB
file's pages beside the weights copied out of them, the largest part of the load's peak.
``TensorFile`` reads each tensor with ``pread`` straight into a fresh torch allocation: one
copy, no map, nothing resident but what the loader keeps (and the page cache, which the
kernel does not count against the process). A torch allocation is 64-byte aligned, which the
CPU kernels' summation order depends on (``shard.model.loader``).

The header is checked before any data is read: a JSON object of entries with a known dtype,
a shape and ``data_offsets`` that fit the file and agree with the shape. Errors:
``TensorFileError`` (a ``ValueError``) saying what is wrong; the loader turns it into its
"cannot read ... re-download" error.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

__all__ = ["TensorFile", "TensorFileError", "open_tensors"]

DTYPES: Final = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: A header larger than this is refused (safetensors' own limit is 100 MB).
MAX_HEADER: Final = 100 * 2**20
#: One ``pread`` at most this many bytes (Linux caps a read near 2 GiB).
CHUNK: Final = 1 << 30


class TensorFileError(ValueError):
    """A safetensors file whose header or data cannot be read; ``str()`` says what."""


class TensorFile:
    """An open safetensors file: ``keys``, ``metadata``, ``shape``, and ``get_tensor`` /
    ``rows`` that read a tensor (or a range of its leading index) with ``pread``."""

    def __init__(self, path: Path, device: torch.device | str = "cpu") -> None:
        self.path, self.device = Path(path), torch.device(device)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self._size = os.fstat(self._fd).st_size
            raw = self._read(0, 8)
            (length,) = struct.unpack("<Q", raw)
            if length > min(MAX_HEADER, self._size - 8):
                raise TensorFileError(f"header of {length} bytes in a {self._size}-byte file")
            header = json.loads(self._read(8, length))
            if not isinstance(header, dict):
                raise TensorFileError("header is not a JSON object")
            self._metadata = header.pop("__metadata__", None) or {}
            self._base = 8 + length
            self._entries = {str(k): self._entry(str(k), v) for k, v in header.items()}
        except BaseException:
            os.close(self._fd)
            raise

    def _entry(self, name: str, entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            start, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise TensorFileError(f"tensor {name!r} has a bad header entry: {e!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or stop - start != nbytes or start < 0:
            raise TensorFileError(f"tensor {name!r}: offsets {start}..{stop} for shape {shape}")
        if self._base + stop > self._size:
            raise TensorFileError(f"tensor {name!r} runs past the end of the file (truncated)")
        return dtype, shape, self._base + start, nbytes

    def _read(self, offset: int, n: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise TensorFileError(f"the file ends at {self._size} bytes, inside its header")
        return data

    def close(self) -> None:
        os.close(self._fd)

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get_tensor(self, name: str) -> Tensor:
        """Tensor ``name``, in its stored dtype, on this file's device."""
        return self.rows(name, 0, self._entries[name][1][0] if self._entries[name][1] else 1)

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """``tensor[start:stop]`` of tensor ``name`` (its leading index), reading only those
        bytes: one expert of a fused ``[E, in, out]`` weight."""
        dtype, shape, offset, nbytes = self._entries[name]
        if not shape:
            start, stop, row = 0, 1, nbytes
        else:
            row = nbytes // shape[0] if shape[0] else 0
            if not 0 <= start <= stop <= shape[0]:
                raise TensorFileError(f"rows {start}..{stop} of {name!r} of shape {shape}")
        buf = torch.empty((stop - start) * row, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]
        pos = offset + start * row
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done : done + CHUNK]], pos + done)
            if got <= 0:
                raise TensorFileError(f"tensor {name!r}: the file ends early (truncated)")
            done += got
        out = buf.view(dtype).reshape((stop - start, *shape[1:]) if shape else ())
        return out if self.device.type == "cpu" else out.to(self.device)


@contextmanager
def open_tensors(path: Path | str, device: torch.device | str = "cpu") -> Iterator[TensorFile]:
    """A ``TensorFile`` for ``path``, closed on exit."""
    f = TensorFile(Path(path), device)
    try:
        yield f
    finally:
        f.close()
