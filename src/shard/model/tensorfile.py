"""A safetensors file read tensor by tensor into memory torch owns, without mapping the file.

safetensors' ``safe_open`` maps the whole file, and every page a read touches counts in the
process's resident set until the file is closed: loading the bundled SmolLM2 held its 112 MB
file's pages beside the weights copied out of them, the largest part of the load's peak.
``TensorFile`` reads each tensor with ``pread`` straight into a fresh torch allocation: one
copy, no map, nothing resident but what the loader keeps (and the page cache, which the
kernel does not count against the process). A torch allocation is 64-byte aligned, which the
CPU kernels' summation order depends on (``shard.model.loader``).

The header is checked before any data is read, by ``shard.model.safetensors_header`` (the one
reader of safetensors headers): known dtypes, shapes and ``data_offsets`` that fit the file,
agree with each other and do not overlap. Errors: ``TensorFileError`` (``SafetensorsError``, a
``ValueError``) saying what is wrong; the loader turns it into its "cannot read ...
re-download" error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import torch
from torch import Tensor

from shard.model.safetensors_header import Header, SafetensorsError, read_header

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
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
#: One ``pread`` at most this many bytes (Linux caps a read near 2 GiB).
CHUNK: Final = 1 << 30


TensorFileError = SafetensorsError  # a ValueError whose message names the file and field


class TensorFile:
    """An open safetensors file: ``keys``, ``metadata``, ``shape``, and ``get_tensor`` /
    ``rows`` that read a tensor (or a range of its leading index) with ``pread``."""

    def __init__(self, path: Path, device: torch.device | str = "cpu") -> None:
        self.path, self.device = Path(path), torch.device(device)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise TensorFileError(f"{self.path}: cannot open it ({e.strerror or e})") from None
        try:
            header = read_header(self.path, self._fd)
            self._size = header.size
            self._metadata = header.metadata
            self._entries = {
                name: (DTYPES[e.dtype], e.shape, e.start, e.nbytes)
                for name, e in header.entries.items()
            }
            self._header = header
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def header(self) -> Header:
        """The checked header (``shard.model.safetensors_header``)."""
        return self._header

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
