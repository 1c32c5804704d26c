"""The parts of a manifest, their hashing, and strict parsing of manifest files.

``FileEntry`` and ``TensorEntry`` are the records a ``shard.weights.manifest.Manifest`` is made of;
``digest`` (BLAKE2b-256 with a domain prefix) and ``canonical_json`` are the only hashing
and encoding rules.

A manifest comes from anywhere (a seeder, a mirror, an e-mail), so parsing trusts nothing:
every field must be present with exactly the right JSON type, hashes are 64 lowercase hex
digits, paths are relative, normalised and never hidden (a fetcher writes files at them), and
unknown keys, keys given twice and nesting deeper than a manifest has are refused. Hash and
signature checks come after, in ``shard.weights.manifest``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import PurePosixPath
from typing import Any, Final

import attrs

from shard import strict_json

__all__ = [
    "FileEntry",
    "ManifestError",
    "ManifestInvalid",
    "ManifestMismatch",
    "TensorEntry",
    "canonical_json",
    "digest",
    "file_root",
    "parse_body",
    "parse_envelope",
]

_HEX64: Final = re.compile(r"[0-9a-f]{64}")
_MAX_CHUNK: Final = 16 << 20  # one chunk + header fits a default 64 MiB wire frame
_MIN_CHUNK: Final = 1 << 10
_HEADER_KEYS: Final = (
    "format",
    "hash",
    "model",
    "version",
    "architecture",
    "n_layers",
    "tie_word_embeddings",
    "tokenizer_hash",
    "chunk_size",
)
_BODY_KEYS: Final = (
    *_HEADER_KEYS,
    "header_hash",
    "files",
    "files_root",
    "tensors",
    "tensors_hash",
    "root",
)
_FILE_KEYS: Final = ("path", "size", "header", "chunks", "root")
_TENSOR_KEYS: Final = ("file", "start", "end", "dtype", "shape")


class ManifestError(Exception):
    """A manifest cannot be trusted; ``str()`` says what is wrong and what to do."""


class ManifestInvalid(ManifestError):
    """Malformed, unsigned, signed by the wrong key or not validly, or older than accepted."""


class ManifestMismatch(ManifestError):
    """A hash does not match what it covers: a chunk, a file's chunk list, the tensor map,
    the header or the root."""


def digest(data: bytes, domain: bytes = b"") -> str:
    """BLAKE2b-256 of ``domain + data`` as 64 lowercase hex digits."""
    h = hashlib.blake2b(digest_size=32)
    h.update(domain)
    h.update(data)
    return h.hexdigest()


def canonical_json(value: object) -> bytes:
    """The one byte encoding of a JSON value: sorted keys, no whitespace, ASCII only."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


@attrs.frozen
class FileEntry:
    """One file: relative POSIX ``path``, ``size``, chunk hashes, their ``root``.

    ``header`` is the byte length of a safetensors file's header (8 + JSON), 0 for other files.
    """

    path: str
    size: int
    chunks: tuple[str, ...]
    root: str
    header: int = 0

    def span(self, index: int, chunk_size: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index``."""
        start = index * chunk_size
        return start, min(start + chunk_size, self.size)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "header": self.header,
            "chunks": list(self.chunks),
            "root": self.root,
        }


@attrs.frozen
class TensorEntry:
    """Where one tensor's bytes live: ``file`` and the absolute range ``[start, end)``."""

    file: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "start": self.start,
            "end": self.end,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }


def file_root(size: int, chunks: tuple[str, ...]) -> str:
    """The root of one file: its size and the concatenation of its chunk hashes."""
    return digest(size.to_bytes(8, "big") + b"".join(bytes.fromhex(c) for c in chunks), b"file\0")


def parse_envelope(data: bytes, source: str) -> tuple[dict[str, Any], bytes | None, bytes | None]:
    """Split a manifest file into its body and the optional publisher key and signature.

    Parsed strictly (``shard.strict_json``): a key given twice anywhere (two signatures, two
    roots: which one was verified?), NaN, or nesting deeper than any manifest is refused."""
    try:
        top = strict_json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestInvalid(f"{source}: not a JSON manifest ({exc})") from None
    if not isinstance(top, dict):
        raise ManifestInvalid(f"{source}: a manifest is a JSON object")
    _known(top, ("manifest", "publisher", "signature"), source, "")
    body = top.get("manifest")
    if not isinstance(body, dict):
        raise ManifestInvalid(f"{source}: missing the 'manifest' object")
    if ("publisher" in top) != ("signature" in top):
        raise ManifestInvalid(f"{source}: publisher and signature come together or not at all")
    if "publisher" not in top:
        return body, None, None
    publisher = _hex_bytes(top["publisher"], 32, source, "publisher")
    signature = _hex_bytes(top["signature"], 64, source, "signature")
    return body, publisher, signature


def parse_body(body: dict[str, Any], source: str, fmt: str, hash_name: str) -> dict[str, Any]:
    """The body's fields as constructor arguments of ``Manifest`` (files and tensors as dicts)."""
    _known(body, _BODY_KEYS, source, "")
    if body.get("format") != fmt:
        raise ManifestInvalid(
            f"{source}: format is {body.get('format')!r}, this shard reads {fmt!r}; upgrade shard "
            "or rebuild the manifest"
        )
    if body.get("hash") != hash_name:
        raise ManifestInvalid(f"{source}: hash is {body.get('hash')!r}, expected {hash_name!r}")
    chunk_size = _int(body, "chunk_size", source, "")
    if not _MIN_CHUNK <= chunk_size <= _MAX_CHUNK:
        raise ManifestInvalid(
            f"{source}: chunk_size {chunk_size} is outside [{_MIN_CHUNK}, {_MAX_CHUNK}]"
        )
    files = _list(body, "files", source)
    tensors = body.get("tensors")
    if not isinstance(tensors, dict):
        raise ManifestInvalid(f"{source}: tensors must be an object of name -> range")
    parsed_files = [_file(f, source, i) for i, f in enumerate(files)]
    paths = [f["path"] for f in parsed_files]
    if paths != sorted(set(paths)):
        raise ManifestInvalid(f"{source}: files must be sorted by path, without duplicates")
    return {
        "model": _str(body, "model", source, ""),
        "version": _int(body, "version", source, "", minimum=1),
        "architecture": _str(body, "architecture", source, ""),
        "n_layers": _int(body, "n_layers", source, "", minimum=1),
        "tie_word_embeddings": _bool(body, "tie_word_embeddings", source),
        "tokenizer_hash": _hex(body, "tokenizer_hash", source, ""),
        "chunk_size": chunk_size,
        "files": parsed_files,
        "tensors": {str(n): _tensor(t, source, str(n)) for n, t in tensors.items()},
        "header_hash": _hex(body, "header_hash", source, ""),
        "files_root": _hex(body, "files_root", source, ""),
        "tensors_hash": _hex(body, "tensors_hash", source, ""),
        "root": _hex(body, "root", source, ""),
    }


def check_path(path: str) -> str | None:
    """Why ``path`` may not name a manifest file (None when it is fine)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or "\\" in path or "\x00" in path:
        return "must be a relative POSIX path"
    if str(pure) != path or any(part in ("", ".", "..") or part[0] == "." for part in pure.parts):
        return "must be normalised, without '.', '..' or hidden components"
    return None


def _file(value: object, source: str, index: int) -> dict[str, Any]:
    where = f"files[{index}]."
    if not isinstance(value, dict):
        raise ManifestInvalid(f"{source}: {where[:-1]} must be an object")
    _known(value, _FILE_KEYS, source, where)
    path = _str(value, "path", source, where)
    problem = check_path(path)
    if problem is not None:
        raise ManifestInvalid(f"{source}: {where}path {path!r} {problem}")
    chunks = _list(value, "chunks", source, where)
    for j, c in enumerate(chunks):
        if not isinstance(c, str) or not _HEX64.fullmatch(c):
            raise ManifestInvalid(f"{source}: {where}chunks[{j}] is not 64 lowercase hex digits")
    return {
        "path": path,
        "size": _int(value, "size", source, where),
        "header": _int(value, "header", source, where),
        "chunks": tuple(chunks),
        "root": _hex(value, "root", source, where),
    }


def _tensor(value: object, source: str, name: str) -> dict[str, Any]:
    where = f"tensors[{name!r}]."
    if not isinstance(value, dict):
        raise ManifestInvalid(f"{source}: {where[:-1]} must be an object")
    _known(value, _TENSOR_KEYS, source, where)
    shape = _list(value, "shape", source, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ManifestInvalid(f"{source}: {where}shape must be non-negative integers")
    return {
        "file": _str(value, "file", source, where),
        "start": _int(value, "start", source, where),
        "end": _int(value, "end", source, where),
        "dtype": _str(value, "dtype", source, where),
        "shape": tuple(shape),
    }


def _known(d: dict[str, Any], keys: tuple[str, ...], source: str, where: str) -> None:
    for key in d:
        if key not in keys:
            raise ManifestInvalid(f"{source}: {where}{key}: unknown field")


def _need(d: dict[str, Any], key: str, source: str, where: str) -> object:
    if key not in d:
        raise ManifestInvalid(f"{source}: {where}{key}: missing")
    return d[key]


def _int(d: dict[str, Any], key: str, source: str, where: str, *, minimum: int = 0) -> int:
    value = _need(d, key, source, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ManifestInvalid(f"{source}: {where}{key}: expected an integer >= {minimum}")
    return value


def _str(d: dict[str, Any], key: str, source: str, where: str) -> str:
    value = _need(d, key, source, where)
    if not isinstance(value, str) or not value:
        raise ManifestInvalid(f"{source}: {where}{key}: expected a non-empty string")
    return value


def _bool(d: dict[str, Any], key: str, source: str) -> bool:
    value = _need(d, key, source, "")
    if not isinstance(value, bool):
        raise ManifestInvalid(f"{source}: {key}: expected true or false")
    return value


def _hex(d: dict[str, Any], key: str, source: str, where: str) -> str:
    value = _need(d, key, source, where)
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise ManifestInvalid(f"{source}: {where}{key}: expected 64 lowercase hex digits")
    return value


def _list(d: dict[str, Any], key: str, source: str, where: str = "") -> list[Any]:
    value = _need(d, key, source, where)
    if not isinstance(value, list):
        raise ManifestInvalid(f"{source}: {where}{key}: expected an array")
    return value


def _hex_bytes(value: object, size: int, source: str, key: str) -> bytes:
    # One spelling only, as receipts: lowercase, exact length, nothing ``fromhex`` would skip.
    if not isinstance(value, str) or re.fullmatch(f"[0-9a-f]{{{2 * size}}}", value) is None:
        raise ManifestInvalid(
            f"{source}: {key}: expected {2 * size} lowercase hex digits (a manifest accepts "
            "one spelling only)"
        )
    return bytes.fromhex(value)
