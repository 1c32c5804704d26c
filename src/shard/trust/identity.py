"""Node identity: one Ed25519 key per node, in a file only its owner can read.

``shard keygen --out PATH`` writes ``PATH`` (the 32-byte secret seed as hex, mode 0600) and
``PATH.pub`` (the public key as 64 hex digits: what ``shard admit --node-pub`` and a spec's
``[trust] authority`` take). Neither is ever overwritten. There is no shared secret: a node
proves who it is by signing its handshake with this key, and the swarm's authority (itself
such a key) vouches for it with an admission token (``shard.trust.admission``).

Errors: ``IdentityError`` for a key file that is missing, malformed, readable by others, or
already there when writing; each says which file and what to do.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs
import nacl.exceptions
import nacl.signing

#: First word of a secret key file, so a public key or a token is never mistaken for one.
SECRET_PREFIX = "shard-ed25519-secret-v1"
KEY_BYTES = 32
SIGNATURE_BYTES = 64


class IdentityError(Exception):
    """A key file is missing, malformed, too widely readable, or would be overwritten."""


@attrs.frozen
class NodeIdentity:
    """An Ed25519 signing key. Build with ``generate``, ``from_seed`` or ``load``."""

    signing_key: nacl.signing.SigningKey = attrs.field(repr=False)

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh key from the OS's random source."""
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeIdentity:
        """The key whose 32-byte seed is ``seed`` (tests use fixed seeds)."""
        if len(seed) != KEY_BYTES:
            raise ValueError(f"an Ed25519 seed is {KEY_BYTES} bytes, got {len(seed)}")
        return cls(nacl.signing.SigningKey(seed))

    @property
    def public(self) -> bytes:
        """The 32-byte public key."""
        return bytes(self.signing_key.verify_key)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte detached signature of ``message``."""
        return self.signing_key.sign(message).signature

    def __repr__(self) -> str:
        return f"NodeIdentity({short(self.public)})"

    @classmethod
    def load(cls, path: Path) -> NodeIdentity:
        """Read a secret key file written by ``save`` / ``shard keygen``.

        Errors: ``IdentityError`` when it is missing, readable by group or others (like ssh,
        a key anyone can read is refused), or not a shard secret key.
        """
        try:
            mode = path.stat().st_mode
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            raise IdentityError(
                f"{path}: no such key file; create one with `shard keygen --out {path}`"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise IdentityError(f"{path}: cannot read key file: {exc}") from None
        if mode & 0o077:
            raise IdentityError(
                f"{path}: secret key is readable by others (mode {stat.S_IMODE(mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        words = text.split()
        if len(words) != 2 or words[0] != SECRET_PREFIX:
            raise IdentityError(
                f"{path}: not a shard secret key (expected '{SECRET_PREFIX} <64 hex digits>'); "
                "pass the file `shard keygen --out` wrote, not its .pub"
            )
        try:
            return cls.from_seed(bytes.fromhex(words[1]))
        except ValueError:
            raise IdentityError(f"{path}: the key is not 64 hex digits") from None

    def save(self, path: Path) -> Path:
        """Write the secret to ``path`` (mode 0600) and the public key to ``path.pub``.

        Returns the ``.pub`` path. Errors: ``IdentityError`` when either file exists (a key is
        never overwritten: losing one means re-admitting the node) or cannot be written.
        """
        pub = public_path(path)
        for target in (path, pub):
            if target.exists():
                raise IdentityError(
                    f"{target}: already exists; refusing to overwrite a key "
                    "(remove it first if you really mean to replace this node's identity)"
                )
        seed = bytes(self.signing_key).hex()
        write_new(path, f"{SECRET_PREFIX} {seed}\n".encode(), mode=0o600)
        write_new(pub, f"{self.public.hex()}\n".encode(), mode=0o644)
        return pub


def public_path(secret: Path) -> Path:
    """Where ``shard keygen --out secret`` puts the public key: ``secret`` + ``.pub``."""
    return secret.with_name(secret.name + ".pub")


def write_new(path: Path, data: bytes, *, mode: int) -> None:
    """Create ``path`` with ``data`` and permissions ``mode``; never replaces a file.

    Errors: ``IdentityError`` when it exists or cannot be created.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise IdentityError(f"{path}: already exists; refusing to overwrite it") from None
    except OSError as exc:
        raise IdentityError(f"{path}: cannot create: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # the umask may have narrowed it; say exactly what we mean
        f.write(data)


def parse_public_key(text: str) -> bytes:
    """64 hex digits -> the 32-byte key. Errors: ``ValueError`` saying what is wrong."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is 64 hex digits, got {text[:70]!r}")
    return key


def read_public_key(text_or_path: str, base_dir: Path | None = None) -> bytes:
    """A public key given inline (64 hex digits) or as the path of a ``.pub`` file.

    A relative path resolves against ``base_dir`` (default: the working directory).
    Errors: ``IdentityError`` naming the file, or the text when it is neither.
    """
    try:
        return parse_public_key(text_or_path)
    except ValueError:
        pass
    path = Path(text_or_path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise IdentityError(
            f"{path}: no such public key file (give 64 hex digits or the .pub that "
            "`shard keygen` wrote)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise IdentityError(f"{path}: cannot read public key: {exc}") from None
    try:
        return parse_public_key(text)
    except ValueError as exc:
        raise IdentityError(f"{path}: {exc}") from None


def verify_signature(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``message``."""
    try:
        nacl.signing.VerifyKey(public).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError):
        return False
    return True


def short(public: bytes) -> str:
    """A key as people compare it in logs: ``ed25519:`` and its first 16 hex digits."""
    return f"ed25519:{public.hex()[:16]}"


def told_apart(a: bytes, b: bytes) -> tuple[str, str]:
    """Two different keys as ``short`` writes them, or whole when their short forms are the
    same (a key altered past its 16th digit must not read as equal to the one it differs from)."""
    if short(a) != short(b):
        return short(a), short(b)
    return f"ed25519:{a.hex()}", f"ed25519:{b.hex()}"
