"""``shard.model.tensorfile``: safetensors read by ``pread`` into torch memory, never mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shard.model.tensorfile import TensorFileError, open_tensors

TENSORS = {
    "f32": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(3, 4, 2).to(torch.bfloat16),
    "f16": torch.randn(9).to(torch.float16),
    "i8": torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4),
    "u8": torch.arange(12, dtype=torch.uint8),
    "i64": torch.arange(4, dtype=torch.int64),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
}


@pytest.fixture
def file(tmp_path: Path) -> Path:
    path = tmp_path / "t.safetensors"
    save_file(TENSORS, str(path), metadata={"k": "v"})
    return path


def test_reads_what_safetensors_reads(file: Path) -> None:
    """Every dtype and shape (scalar, empty) reads equal to safetensors' own reader, each in
    64-byte aligned memory of its own; rows read a slice of the leading index."""
    with open_tensors(file) as f, safe_open(str(file), framework="pt") as ref:
        assert sorted(f.keys()) == sorted(TENSORS) and f.metadata() == {"k": "v"}
        for name in TENSORS:
            got = f.get_tensor(name)
            assert got.dtype == ref.get_tensor(name).dtype and got.data_ptr() % 64 == 0
            assert torch.equal(got, ref.get_tensor(name)), name
            assert f.shape(name) == tuple(TENSORS[name].shape)
        assert torch.equal(f.rows("bf16", 1, 3), TENSORS["bf16"][1:3])


def test_the_file_is_never_mapped(file: Path) -> None:
    """While open and reading, the file is not among the process's mappings."""
    with open_tensors(file) as f:
        f.get_tensor("f32")
        maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
        assert str(file) not in maps


def test_bad_files_are_refused(file: Path, tmp_path: Path) -> None:
    """A truncated file, a header past the end or an unknown dtype: TensorFileError."""
    data = file.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:-8])  # the last tensor's data cut short
    with pytest.raises(TensorFileError, match="past the end"):
        open_tensors(bad).__enter__()
    bad.write_bytes(data[:20])
    with pytest.raises(TensorFileError, match="header"):
        open_tensors(bad).__enter__()
    bad.write_bytes(data.replace(b'"I64"', b'"X64"'))
    with pytest.raises(TensorFileError, match="i64"):
        open_tensors(bad).__enter__()
