"""Bearer API keys, kept as SHA-256 hashes in a file the spec names (``[api] keys_file``).

The file has one key per line: ``sha256:<64 hex digits>``, optionally followed by a label;
``#`` starts a comment. Keys are random 32-byte tokens (``new_key``), so a plain hash is
enough to keep them secret at rest; checking compares digests in constant time. ``shard
api-key`` makes a key, prints it once and appends its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Final

PREFIX: Final = "sha256:"
KEY_PREFIX: Final = "sk-shard-"


class KeyFileError(Exception):
    """The keys file is missing or malformed; the message names the file and the line."""


def new_key() -> str:
    """A fresh API key (what a client sends as ``Authorization: Bearer KEY``)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The line that stands for ``key`` in a keys file."""
    return PREFIX + hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The hashes of the keys that may use the API."""

    def __init__(self, hashes: Iterable[str]) -> None:
        self._digests = tuple(bytes.fromhex(h.removeprefix(PREFIX)) for h in hashes)

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        """Read a keys file. Errors: ``KeyFileError`` naming the file (and line)."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"{path}: cannot read the API keys file ({exc})") from None
        hashes = []
        for number, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].split()
            if not entry:
                continue
            digest = entry[0]
            hexpart = digest.removeprefix(PREFIX)
            if not digest.startswith(PREFIX) or len(hexpart) != 64 or not _is_hex(hexpart):
                raise KeyFileError(
                    f"{path}:{number}: expected sha256:<64 hex digits> (from `shard api-key`), "
                    f"got {digest[:20]!r}"
                )
            hashes.append(digest)
        if not hashes:
            raise KeyFileError(f"{path}: no keys; add one with `shard api-key --keys {path}`")
        return cls(hashes)

    def allows(self, key: str) -> bool:
        """Whether ``key`` is one of the keys (constant time in the key's content)."""
        digest = hashlib.sha256(key.encode()).digest()
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def add_key(path: Path, label: str = "") -> str:
    """Make a key, append its hash (and ``label``) to ``path``, return the key itself."""
    key = new_key()
    line = hash_key(key) + (f"  {label}" if label else "")
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
    return key
