"""Build a manifest from a checkpoint directory (``shard manifest build``).

Every regular, non-hidden file of the directory is hashed in chunks of ``chunk_size`` bytes;
each ``*.safetensors`` file's header gives its tensors' byte ranges (``8 + header_len +
data_offsets``). The header fields come from ``config.json`` (architecture, layer count, tied
embeddings) and the tokenizer files. Reads each file once, a chunk at a time.

Errors: ``ManifestInvalid`` for a directory that is not a usable checkpoint, naming the file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from shard import strict_json
from shard.model.config import ModelConfig, ModelLoadError
from shard.weights.manifest import DEFAULT_CHUNK_SIZE, TOKENIZER_FILES, Manifest
from shard.weights.schema import (
    FileEntry,
    ManifestInvalid,
    TensorEntry,
    check_path,
    digest,
    file_root,
)

__all__ = ["build_manifest", "hash_file", "safetensors_tensors", "tokenizer_hash"]

#: A safetensors header larger than this is refused (real ones are well under a few MiB).
MAX_SAFETENSORS_HEADER = 100 << 20


def build_manifest(
    model_dir: Path, *, model: str, version: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Manifest:
    """An unsigned manifest of ``model_dir`` for model id ``model`` at ``version``.

    Errors: ``ManifestInvalid`` (no config.json, unreadable safetensors, bad arguments).
    """
    model_dir = Path(model_dir)
    if version < 1:
        raise ManifestInvalid(f"version must be >= 1, got {version}")
    try:
        config = ModelConfig.from_dir(model_dir)
    except ModelLoadError as exc:
        raise ManifestInvalid(f"{model_dir}: not a checkpoint: {exc}") from None
    files: list[FileEntry] = []
    tensors: dict[str, TensorEntry] = {}
    for path in _listing(model_dir):
        rel = path.relative_to(model_dir).as_posix()
        header = 0
        if path.suffix == ".safetensors":
            header, found = safetensors_tensors(path, rel)
            tensors.update(found)
        files.append(hash_file(path, rel, chunk_size, header=header))
    return Manifest(
        model=model,
        version=version,
        architecture=config.architecture,
        n_layers=config.n_layers,
        tie_word_embeddings=config.tie_word_embeddings,
        tokenizer_hash=tokenizer_hash(model_dir),
        chunk_size=chunk_size,
        files=tuple(files),
        tensors=tensors,
    ).sealed()


def _listing(model_dir: Path) -> list[Path]:
    found = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir).as_posix()
        if check_path(rel) is not None or not path.is_file():
            continue  # hidden files (a fetch's own state, editor droppings) are not the model
        found.append(path)
    return found


def hash_file(path: Path, rel: str, chunk_size: int, *, header: int = 0) -> FileEntry:
    """The entry of one file: its size and the hash of each ``chunk_size`` chunk."""
    chunks: list[str] = []
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            chunks.append(digest(block))
            size += len(block)
    hashes = tuple(chunks)
    return FileEntry(rel, size, hashes, file_root(size, hashes), header)


def safetensors_tensors(path: Path, rel: str) -> tuple[int, dict[str, TensorEntry]]:
    """Header length (8 + JSON) and each tensor's absolute byte range in one safetensors file.

    Errors: ``ManifestInvalid`` for a file whose header is not safetensors.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ManifestInvalid(f"{path}: too short to be safetensors")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_SAFETENSORS_HEADER:
            raise ManifestInvalid(f"{path}: header of {length} bytes; not a safetensors file")
        raw = f.read(length)
    try:  # strictly: a tensor named twice has two byte ranges; nesting cannot recurse deep
        header: dict[str, Any] = strict_json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestInvalid(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ManifestInvalid(f"{path}: safetensors header is not a JSON object")
    base = 8 + length
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(
                rel,
                base + begin,
                base + end,
                str(info["dtype"]),
                tuple(int(d) for d in info["shape"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestInvalid(
                f"{path}: tensor {name!r} has a bad header entry ({exc})"
            ) from None
        tensors[name] = entry
    return base, tensors


def tokenizer_hash(model_dir: Path) -> str:
    """BLAKE2b-256 over the tokenizer files: name, length and bytes of each (length 2^64-1
    for one that is absent, so absent and empty differ)."""
    parts = []
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        data = path.read_bytes() if path.is_file() else b""
        size = len(data) if path.is_file() else (1 << 64) - 1
        parts.append(name.encode() + b"\0" + size.to_bytes(8, "big") + data)
    return digest(b"".join(parts), b"tokenizer\0")
