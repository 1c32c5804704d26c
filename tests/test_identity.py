"""Node identity: key files (mode 0600, never overwritten), public keys, signatures."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shard.trust.identity import (
    IdentityError,
    NodeIdentity,
    parse_public_key,
    public_path,
    read_public_key,
    verify_signature,
)


def test_save_writes_secret_0600_and_public_hex(tmp_path: Path) -> None:
    """save() writes PATH with mode 0600 and PATH.pub with the 64-hex public key."""
    me = NodeIdentity.generate()
    pub = me.save(tmp_path / "node.key")
    assert pub == tmp_path / "node.key.pub" == public_path(tmp_path / "node.key")
    assert stat.S_IMODE(os.stat(tmp_path / "node.key").st_mode) == 0o600
    assert pub.read_text().strip() == me.public.hex()
    assert NodeIdentity.load(tmp_path / "node.key").public == me.public


def test_save_refuses_to_overwrite_either_file(tmp_path: Path) -> None:
    """An existing secret or .pub is never replaced, and nothing is written."""
    NodeIdentity.generate().save(tmp_path / "a.key")
    with pytest.raises(IdentityError, match="already exists; refusing to overwrite"):
        NodeIdentity.generate().save(tmp_path / "a.key")
    (tmp_path / "b.key.pub").write_text("x")
    with pytest.raises(IdentityError, match=r"b\.key\.pub: already exists"):
        NodeIdentity.generate().save(tmp_path / "b.key")
    assert not (tmp_path / "b.key").exists()


def test_load_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    """A secret key readable by group or others is refused with the chmod to run."""
    NodeIdentity.generate().save(tmp_path / "k")
    os.chmod(tmp_path / "k", 0o644)
    with pytest.raises(IdentityError, match=r"readable by others \(mode 0644\); run `chmod 600"):
        NodeIdentity.load(tmp_path / "k")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("ab" * 32 + "\n", "not a shard secret key"),
        ("shard-ed25519-secret-v1 zz\n", "not 64 hex digits"),
    ],
)
def test_load_refuses_what_is_not_a_secret_key(tmp_path: Path, content: str, match: str) -> None:
    """A .pub or a corrupt file passed as a secret key is named and explained."""
    path = tmp_path / "k"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError, match=match):
        NodeIdentity.load(path)


def test_load_missing_key_says_how_to_make_one(tmp_path: Path) -> None:
    """A missing key file error names `shard keygen`."""
    with pytest.raises(IdentityError, match="shard keygen --out"):
        NodeIdentity.load(tmp_path / "nope.key")


def test_public_key_inline_or_from_file(tmp_path: Path) -> None:
    """A public key is read from 64 hex digits or from a .pub path (relative to a base)."""
    me = NodeIdentity.generate()
    me.save(tmp_path / "n.key")
    assert read_public_key(me.public.hex()) == me.public
    assert read_public_key("n.key.pub", tmp_path) == me.public
    with pytest.raises(IdentityError, match="no such public key file"):
        read_public_key("missing.pub", tmp_path)
    with pytest.raises(ValueError, match="64 hex digits"):
        parse_public_key("abcd")


def test_signatures_verify_only_for_the_signer_and_message() -> None:
    """A signature verifies under its key and message only."""
    a, b = NodeIdentity.from_seed(b"a" * 32), NodeIdentity.from_seed(b"b" * 32)
    sig = a.sign(b"hello")
    assert verify_signature(a.public, b"hello", sig)
    assert not verify_signature(b.public, b"hello", sig)
    assert not verify_signature(a.public, b"hellO", sig)
    assert not verify_signature(a.public, b"hello", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert "ed25519:" in repr(a) and bytes(a.signing_key).hex() not in repr(a)
