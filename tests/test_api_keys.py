"""API keys kept as hashes (``shard.api.keys``) and the ``[api]`` spec table
(``shard.spec.api``): what is accepted and the one-line errors for what is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shard.api.keys import ApiKeys, KeyFileError, add_key, hash_key
from shard.cli import main
from shard.spec.api import parse_api_address
from shard.spec.nodes import Address
from shard.spec.swarm import SpecError, SwarmSpec


def test_a_made_key_is_allowed_and_only_its_hash_is_stored(tmp_path: Path) -> None:
    """``add_key`` appends the hash; the file never holds the key; others are refused."""
    path = tmp_path / "keys.txt"
    key = add_key(path, "alice")
    other = add_key(path)
    text = path.read_text()
    assert key not in text and hash_key(key) in text and "alice" in text
    keys = ApiKeys.from_file(path)
    assert keys.allows(key) and keys.allows(other)
    assert not keys.allows(key + "x") and not keys.allows("")


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "no keys"), ("# only a comment\n", "no keys"), ("sk-plain-key\n", ":1: expected")],
)
def test_a_bad_keys_file_names_the_problem(tmp_path: Path, text: str, problem: str) -> None:
    """An empty file or a plain key instead of a hash is a ``KeyFileError`` naming it."""
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=problem):
        ApiKeys.from_file(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "missing.txt")


def spec(api: dict[str, Any], limits: dict[str, Any] | None = None) -> SwarmSpec:
    return SwarmSpec.from_dict(
        {
            "swarm": {"name": "t", "model": "smollm2", "insecure": True},
            "limits": limits or {},
            "coordinator": {"listen": "127.0.0.1:7700"},
            "stage": [{"name": "s0", "listen": "127.0.0.1:7701"}],
            "api": api,
        },
        source="t.toml",
        base_dir=Path("/srv"),
    )


def test_the_api_table_reads_into_its_record() -> None:
    """Every key lands typed; keys_file resolves against the spec's directory."""
    api = spec(
        {
            "listen": "127.0.0.1:8000",
            "keys_file": "keys.txt",
            "max_sessions": 4,
            "model_name": "tiny",
            "max_body_kib": 64,
            "body_timeout_s": 2,
        }
    ).api
    assert api.listen == Address("127.0.0.1", 8000)
    assert api.keys_file == Path("/srv/keys.txt")
    assert (api.max_sessions, api.model_name, api.max_body_kib, api.body_timeout_s) == (
        4,
        "tiny",
        64,
        2.0,
    )
    assert spec({}).api.listen is None  # absent: no API


@pytest.mark.parametrize(
    ("api", "key", "problem"),
    [
        ({"listen": "nowhere"}, "api.listen", "expected host:port"),
        ({"max_sessions": 17}, "api.max_sessions", "exceeds limits.max_sessions = 16"),
        ({"max_sessions": 0}, "api.max_sessions", ">= 1"),
        ({"body_timeout_s": 0}, "api.body_timeout_s", "> 0"),
        ({"keys": "x"}, "api.keys", "did you mean 'keys_file'"),
        ({"listen": "0.0.0.0:8000"}, "api.listen", "no keys_file"),
    ],
)
def test_a_bad_api_table_is_one_line(api: dict[str, Any], key: str, problem: str) -> None:
    """Each mistake is a ``SpecError`` naming ``api.KEY`` and what to do."""
    with pytest.raises(SpecError) as caught:
        spec(api)
    assert caught.value.key == key and problem in str(caught.value)
    assert "\n" not in str(caught.value)


def test_public_listening_needs_keys_or_saying_so() -> None:
    """A non-loopback listen is fine with keys_file, or with ``public = true``."""
    assert spec({"listen": "0.0.0.0:8000", "keys_file": "k"}).api.listen is not None
    assert spec({"listen": "0.0.0.0:8000", "public": True}).api.public


def test_api_flag_addresses() -> None:
    """``--api 8000`` is loopback; ``HOST:PORT`` is taken as given."""
    assert parse_api_address("8000") == Address("127.0.0.1", 8000)
    assert parse_api_address("[::1]:0") == Address("::1", 0)
    with pytest.raises(ValueError, match="port"):
        parse_api_address("127.0.0.1:http")


def test_shard_api_key_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``shard api-key --keys FILE`` prints a key that the file then allows."""
    path = tmp_path / "keys.txt"
    assert main(["api-key", "--keys", str(path), "--label", "ci"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-shard-") and key not in path.read_text()
    assert ApiKeys.from_file(path).allows(key)
