"""Admission tokens: issue, encode, and one distinct rejection per reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from shard.trust.admission import (
    AdmissionError,
    AdmissionToken,
    BadTokenSignature,
    ForeignAuthority,
    ForeignSwarm,
    RoleNotAllowed,
    TokenExpired,
    TokenMalformed,
    TokenMissing,
    TokenNotYetValid,
    TokenRevoked,
    WrongIdentity,
    issue,
    parse_duration,
    verify,
)
from shard.trust.identity import short, told_apart
from trust_fixtures import AUTHORITY, NOW, OTHER_AUTHORITY, SWARM, forged, identity, token

S0 = identity("s0")


def check(tok: AdmissionToken, *, role: str = "stage", now: float = NOW, **kw: object) -> None:
    verify(
        tok,
        authority_pub=AUTHORITY.public,
        swarm=SWARM,
        role=role,
        now=now,
        node_pub=S0.public,
        **kw,  # type: ignore[arg-type]
    )


def test_an_honest_token_verifies_and_round_trips(tmp_path: Path) -> None:
    """A fresh token verifies, and survives encode/decode and its text file unchanged."""
    tok = token(S0, ("stage", "coordinator"), serial=9)
    check(tok)
    check(tok, role="coordinator")
    assert tok.roles == ("coordinator", "stage")  # canonical order
    assert AdmissionToken.decode(tok.encode()) == tok
    tok.save(tmp_path / "s0.token")
    assert AdmissionToken.load(tmp_path / "s0.token") == tok


@pytest.mark.parametrize(
    ("tok", "kw", "error", "words"),
    [
        (token(S0, authority=OTHER_AUTHORITY), {}, ForeignAuthority, "issued by authority"),
        (forged(token(S0), expires=int(NOW) + 10**8), {}, BadTokenSignature, "forged or altered"),
        (forged(token(S0), roles=("coordinator", "stage")), {}, BadTokenSignature, "forged"),
        (token(S0, swarm="other"), {}, ForeignSwarm, "admits to swarm 'other', not 'lab'"),
        (token(identity("s1")), {}, WrongIdentity, "but it was presented by key"),
        (token(S0, not_before=NOW + 60), {}, TokenNotYetValid, "not valid before"),
        (token(S0, expires=NOW), {}, TokenExpired, "expired at 2027-01-15T08:00:00Z"),
        (token(S0, serial=7), {"revoked": {7}}, TokenRevoked, "revoked"),
        (token(S0, ("client",)), {}, RoleNotAllowed, "allows the roles client, not 'stage'"),
    ],
)
def test_each_reason_has_its_own_error(
    tok: AdmissionToken, kw: dict[str, object], error: type[AdmissionError], words: str
) -> None:
    """Foreign authority, bad signature, foreign swarm, wrong key, not yet valid, expired,
    revoked and wrong role are each their own error, with a distinct reason code."""
    with pytest.raises(error, match=words) as caught:
        check(tok, **kw)
    assert caught.value.reason == error.reason
    assert type(caught.value) is error


def test_reason_codes_are_distinct() -> None:
    """Every admission error class has its own reason code."""
    classes = [
        TokenMissing,
        TokenMalformed,
        ForeignAuthority,
        BadTokenSignature,
        ForeignSwarm,
        WrongIdentity,
        TokenNotYetValid,
        TokenExpired,
        TokenRevoked,
        RoleNotAllowed,
    ]
    assert len({cls.reason for cls in classes}) == len(classes)


def test_expiry_message_says_what_to_do() -> None:
    """An expired token names the time and the `shard admit` command that fixes it."""
    with pytest.raises(TokenExpired) as caught:
        check(token(S0, expires=NOW - 1), whose="s0's token")
    text = str(caught.value)
    assert text.startswith("s0's token (serial 1, key ed25519:")
    assert "shard admit --authority" in text


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        token(S0).encode()[:-1],
        token(S0).encode() + b"\x00",
        b"\x9a" + b"\xc0" * 10,
    ],
)
def test_malformed_bytes_are_a_malformed_token(data: bytes) -> None:
    """Garbage, truncation, trailing bytes and wrong types all read as TokenMalformed."""
    with pytest.raises(TokenMalformed):
        AdmissionToken.decode(data)


def test_token_files_missing_or_foreign(tmp_path: Path) -> None:
    """A missing token file is TokenMissing; a file of another kind is TokenMalformed."""
    with pytest.raises(TokenMissing, match="no such token file"):
        AdmissionToken.load(tmp_path / "none.token")
    (tmp_path / "x.token").write_text("hello world\n")
    with pytest.raises(TokenMalformed, match="not a shard admission token"):
        AdmissionToken.load(tmp_path / "x.token")


def test_issue_refuses_meaningless_tokens() -> None:
    """Unknown roles, no roles, an empty window or a negative serial are refused at issue."""
    args = {"node_pub": S0.public, "swarm": SWARM, "not_before": 0, "expires": 10, "serial": 1}
    with pytest.raises(ValueError, match="roles must be"):
        issue(AUTHORITY, roles=("admin",), **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="roles must be"):
        issue(AUTHORITY, roles=(), **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must come after"):
        issue(AUTHORITY, roles=("stage",), **{**args, "expires": 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="serial"):
        issue(AUTHORITY, roles=("stage",), **{**args, "serial": -1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 2592000), ("12h", 43200), ("90m", 5400), ("5s", 5), ("2w", 1209600)],
)
def test_durations(text: str, seconds: int) -> None:
    """--expires accepts s/m/h/d/w."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["30", "d", "0d", "1y", "-1d", "1.5h"])
def test_bad_durations(text: str) -> None:
    """Anything else is a ValueError listing the accepted forms."""
    with pytest.raises(ValueError, match="like 30d, 12h"):
        parse_duration(text)


def test_keys_that_differ_past_their_short_form_are_written_whole() -> None:
    """A key altered after its 16th hex digit reads as different from the one it is not (a
    fuzzer's flipped bit once gave 'belongs to key X, but presented by key X')."""
    key = bytes(range(32))
    altered = key[:-1] + b"\xff"
    assert told_apart(key, identity("s1").public) == (short(key), short(identity("s1").public))
    owner, presenter = told_apart(key, altered)
    assert owner != presenter
    assert owner == f"ed25519:{key.hex()}" and presenter == f"ed25519:{altered.hex()}"
