"""Signed, content-addressed model manifests: what a stage may load, chunk by chunk.

A manifest lists every file of a checkpoint split into fixed-size chunks with each chunk's
BLAKE2b-256, a root per file over its chunk hashes, a map from tensor name to file and byte
range, and a header (model id, version, architecture, layer count, tokenizer hash, chunk size).
Sub-hashes chain into one ``root``; the publisher signs the canonical JSON of the whole body
(sorted keys, no whitespace), so the signature covers exact bytes. Format: docs/manifests.md.

``verify(manifest, publisher_pub)`` checks, in order: the structure, each file's root against
its chunk hashes, the files root, the tensor map's hash, the header's hash, the root, then the
signature; the first failure is raised with a reason saying which part does not match.
``verify_chunk`` checks one chunk's bytes. ``check_newer`` refuses rollbacks. Building from a
model directory lives in ``shard.weights.build``; this module is pure (no torch, no I/O but
``from_file``/``save``).

Errors: ``ManifestInvalid`` (malformed, wrong or missing signature, rollback) and
``ManifestMismatch`` (a hash does not match what it covers); both subclass ``ManifestError``.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from shard.trust.identity import NodeIdentity, short, verify_signature
from shard.weights.schema import (
    FileEntry,
    ManifestError,
    ManifestInvalid,
    ManifestMismatch,
    TensorEntry,
    canonical_json,
    digest,
    file_root,
    parse_body,
    parse_envelope,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FORMAT",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "ManifestInvalid",
    "ManifestMismatch",
    "TensorEntry",
    "canonical_json",
    "check_newer",
    "digest",
    "verify",
    "verify_chunk",
]

FORMAT: Final = "shard-manifest/1"
HASH: Final = "blake2b-256"
DEFAULT_CHUNK_SIZE: Final = 1 << 20
#: Prefix of the signed bytes, so a manifest signature can never be replayed as anything else.
SIGNING_DOMAIN: Final = b"shard manifest v1\x00"
#: Tokenizer files whose bytes ``tokenizer_hash`` covers, in this order.
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json")


@attrs.frozen(eq=True, hash=False)
class Manifest:
    """A model manifest. Build from parts then ``sealed()`` (computes the hashes), or read
    with ``from_file`` / ``from_json``; sign with ``signed`` (``publisher`` and ``signature``
    are None while unsigned).
    """

    model: str
    version: int
    architecture: str
    n_layers: int
    tie_word_embeddings: bool
    tokenizer_hash: str
    chunk_size: int
    files: tuple[FileEntry, ...]
    tensors: Mapping[str, TensorEntry]
    header_hash: str = ""
    files_root: str = ""
    tensors_hash: str = ""
    root: str = ""
    publisher: bytes | None = None
    signature: bytes | None = None

    def sealed(self) -> Manifest:
        """This manifest with files sorted and every derived hash computed, unsigned.

        Build a manifest by giving the parts (hashes left empty), then seal it.
        """
        draft = attrs.evolve(
            self,
            files=tuple(sorted(self.files, key=lambda f: f.path)),
            tensors=dict(sorted(self.tensors.items())),
            publisher=None,
            signature=None,
        )
        draft = attrs.evolve(
            draft,
            header_hash=draft.computed_header_hash(),
            files_root=draft.computed_files_root(),
            tensors_hash=draft.computed_tensors_hash(),
        )
        return attrs.evolve(draft, root=draft.computed_root())

    # --- encoding ----------------------------------------------------------------------------

    def header_json(self) -> dict[str, Any]:
        """The header fields (what ``header_hash`` covers)."""
        return {
            "format": FORMAT,
            "hash": HASH,
            "model": self.model,
            "version": self.version,
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "tokenizer_hash": self.tokenizer_hash,
            "chunk_size": self.chunk_size,
        }

    def body_json(self) -> dict[str, Any]:
        """Everything the signature covers."""
        return {
            **self.header_json(),
            "header_hash": self.header_hash,
            "files": [f.to_json() for f in self.files],
            "files_root": self.files_root,
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "tensors_hash": self.tensors_hash,
            "root": self.root,
        }

    def signed_bytes(self) -> bytes:
        """What the publisher signs: a domain prefix and the canonical body."""
        return SIGNING_DOMAIN + canonical_json(self.body_json())

    def to_json(self) -> bytes:
        """The manifest file's bytes: canonical JSON of body (+ publisher and signature)."""
        envelope: dict[str, Any] = {"manifest": self.body_json()}
        if self.publisher is not None and self.signature is not None:
            envelope["publisher"] = self.publisher.hex()
            envelope["signature"] = self.signature.hex()
        return canonical_json(envelope) + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, source: str = "<manifest>") -> Manifest:
        """Parse a manifest file's bytes. Only the structure is checked here; call ``verify``.

        Errors: ``ManifestInvalid`` naming ``source`` and the bad field.
        """
        body, publisher, signature = parse_envelope(data, source)
        fields = parse_body(body, source, FORMAT, HASH)
        files = tuple(FileEntry(**f) for f in fields.pop("files"))
        tensors = {n: TensorEntry(**t) for n, t in fields.pop("tensors").items()}
        return cls(files=files, tensors=tensors, publisher=publisher, signature=signature, **fields)

    @classmethod
    def from_file(cls, path: Path) -> Manifest:
        """Read a manifest file (structure checked; call ``verify`` before trusting it).

        Errors: ``ManifestInvalid`` when it is missing, unreadable or malformed.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ManifestInvalid(f"{path}: cannot read manifest: {exc.strerror}") from None
        return cls.from_json(data, source=str(path))

    def save(self, path: Path) -> None:
        """Write ``to_json()`` to ``path``, atomically: a reader never sees half of it."""
        replace_file(Path(path), self.to_json())

    def signed(self, publisher: NodeIdentity) -> Manifest:
        """This manifest signed by ``publisher`` (any earlier signature replaced)."""
        return attrs.evolve(
            self, publisher=publisher.public, signature=publisher.sign(self.signed_bytes())
        )

    # --- derived hashes ----------------------------------------------------------------------

    def computed_header_hash(self) -> str:
        return digest(canonical_json(self.header_json()), b"header\0")

    def computed_files_root(self) -> str:
        listing = [[f.path, f.size, f.header, f.root] for f in self.files]
        return digest(canonical_json(listing), b"files\0")

    def computed_tensors_hash(self) -> str:
        table = {name: t.to_json() for name, t in self.tensors.items()}
        return digest(canonical_json(table), b"tensors\0")

    def computed_root(self) -> str:
        parts = [self.header_hash, self.files_root, self.tensors_hash]
        return digest(canonical_json(parts), b"root\0")

    # --- queries -----------------------------------------------------------------------------

    def file(self, path: str) -> FileEntry:
        """The entry of ``path``. Errors: ``KeyError`` naming it."""
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(f"{path!r} is not a file of manifest {self.model} v{self.version}")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def describe(self) -> str:
        """One line for logs and ``shard manifest verify``."""
        chunks = sum(len(f.chunks) for f in self.files)
        who = "unsigned" if self.publisher is None else f"publisher={short(self.publisher)}"
        return (
            f"model={self.model} version={self.version} arch={self.architecture} "
            f"layers={self.n_layers} files={len(self.files)} chunks={chunks} "
            f"bytes={self.total_bytes} root={self.root[:16]} {who}"
        )


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (a unique temporary file, then a rename), so
    concurrent writers on one host never trip over each other's temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it 0600; manifests are public
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- checks ----------------------------------------------------------------------------------


def verify(manifest: Manifest, publisher_pub: bytes) -> None:
    """Check ``manifest`` completely and that ``publisher_pub`` signed it.

    Errors: ``ManifestInvalid`` / ``ManifestMismatch`` with the first problem found.
    """
    check_structure(manifest)
    check_hashes(manifest)
    check_signature(manifest, publisher_pub)


def check_structure(m: Manifest) -> None:
    """Chunk counts fit sizes; every tensor lies in the data section of a listed file."""
    for f in m.files:
        want = math.ceil(f.size / m.chunk_size)
        if len(f.chunks) != want:
            raise ManifestInvalid(
                f"file {f.path}: {len(f.chunks)} chunk hashes for {f.size} bytes in chunks of "
                f"{m.chunk_size} (need {want}); the manifest is corrupt, get it again"
            )
        if f.header > f.size:
            raise ManifestInvalid(f"file {f.path}: header of {f.header} bytes exceeds its size")
    sizes = {f.path: f for f in m.files}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for name, t in m.tensors.items():
        entry = sizes.get(t.file)
        if entry is None:
            raise ManifestInvalid(f"tensor map: {name} is in {t.file!r}, not a listed file")
        if not entry.header <= t.start <= t.end <= entry.size:
            raise ManifestInvalid(
                f"tensor map: {name} claims bytes [{t.start}, {t.end}) of {t.file}, outside its "
                f"data section [{entry.header}, {entry.size})"
            )
        spans.setdefault(t.file, []).append((t.start, t.end, name))
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(ranges):
            if start < end:
                raise ManifestInvalid(f"tensor map: {a} and {b} overlap in {file}")


def check_hashes(m: Manifest) -> None:
    """Every derived hash matches what it covers, from the chunk lists up to the root."""
    for f in m.files:
        if file_root(f.size, f.chunks) != f.root:
            raise ManifestMismatch(
                f"file {f.path}: its chunk hashes do not match its root {f.root[:16]} "
                "(a chunk hash was altered); do not use this manifest"
            )
    checks = (
        ("files root", m.files_root, m.computed_files_root(), "the file list or a file's root"),
        ("tensor map", m.tensors_hash, m.computed_tensors_hash(), "a tensor's file or range"),
        (
            "header",
            m.header_hash,
            m.computed_header_hash(),
            "model, version, architecture, layers, tokenizer or chunk size",
        ),
        ("root", m.root, m.computed_root(), "the root (or a hash under it)"),
    )
    for what, stated, actual, changed in checks:
        if stated != actual:
            raise ManifestMismatch(
                f"{what}: hash {stated[:16]} does not match the manifest ({actual[:16]}): "
                f"{changed} was altered; do not use this manifest"
            )


def check_signature(m: Manifest, publisher_pub: bytes) -> None:
    """The manifest carries a valid signature by ``publisher_pub`` over its canonical body."""
    if m.publisher is None or m.signature is None:
        raise ManifestInvalid(
            f"signature: manifest {m.model} v{m.version} is unsigned; the publisher signs it "
            "with `shard manifest sign`"
        )
    if m.publisher != publisher_pub:
        raise ManifestInvalid(
            f"signature: signed by {short(m.publisher)}, not by the expected publisher "
            f"{short(publisher_pub)}; get the manifest from its publisher"
        )
    if not verify_signature(publisher_pub, m.signed_bytes(), m.signature):
        raise ManifestInvalid(
            f"signature: not a valid signature of this manifest by {short(publisher_pub)} "
            "(the signature or the signed bytes were altered); do not use it"
        )


def verify_chunk(m: Manifest, file: str, index: int, data: bytes) -> None:
    """Check one chunk's bytes against the manifest.

    Errors: ``ManifestMismatch`` (wrong length or hash), ``ManifestInvalid`` (no such chunk).
    """
    try:
        entry = m.file(file)
    except KeyError as exc:
        raise ManifestInvalid(str(exc.args[0])) from None
    if not 0 <= index < len(entry.chunks):
        raise ManifestInvalid(f"{file} has {len(entry.chunks)} chunks, no chunk {index}")
    start, end = entry.span(index, m.chunk_size)
    if len(data) != end - start:
        raise ManifestMismatch(
            f"{file} chunk {index}: {len(data)} bytes, the manifest says {end - start}"
        )
    if digest(data) != entry.chunks[index]:
        raise ManifestMismatch(f"{file} chunk {index}: hash does not match the manifest")


def check_newer(old: Manifest, new: Manifest) -> None:
    """Whether ``new`` may replace ``old`` (already accepted): same model, higher version.

    The same manifest again (equal roots) is fine. Errors: ``ManifestInvalid`` on a rollback
    or replay of an older manifest, a conflicting one of the same version, or another model.
    """
    if new.model != old.model:
        raise ManifestInvalid(
            f"manifest is for model {new.model!r}, not {old.model!r} accepted before"
        )
    if new.root == old.root:
        return
    if new.version <= old.version:
        raise ManifestInvalid(
            f"version {new.version} of {new.model} is not newer than version {old.version} "
            "accepted before (a rollback or a replayed old manifest); the publisher must "
            "increase the version for every new manifest"
        )
