"""Admission tokens: the swarm's authority vouches that a node's key may join, and as what.

A token binds a node's Ed25519 public key to a swarm name, the roles it may take (``stage``,
``coordinator``, ``client``, ``monitor``; and ``trusted``, never claimed on a connection: the
authority trusts a stage with the boundary blocks of a ``[formation]`` swarm that pins them),
a validity window and a serial, under the
authority's signature (``shard admit``). Specs name the authority's public key and may list
revoked serials. ``verify`` is a plain function: it checks one token against what this swarm
expects and raises one specific ``AdmissionError`` subclass per reason, each saying what
happened and what to do. Byte layout: ``docs/security.md``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Collection, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import attrs
import msgpack

from shard.errors import HandshakeError
from shard.trust.identity import (
    KEY_BYTES,
    SIGNATURE_BYTES,
    NodeIdentity,
    short,
    told_apart,
    verify_signature,
    write_new,
)

ROLES: Final = ("stage", "coordinator", "client", "monitor", "trusted")
#: The role a token grants beside ``stage`` for its node to hold the first or last block
#: where ``[formation] pin_boundaries`` asks (``shard.formation``).
TRUSTED_ROLE: Final = "trusted"
TOKEN_PREFIX: Final = "shard-token-v1"
#: Prepended to what the authority signs, so a token signature is never valid as anything else.
SIGNED_CONTEXT: Final = b"shard admission token v1\x00"
_TAG: Final = "shard-token"
_MAX_TOKEN_BYTES: Final = 1024
_MAX_SERIAL: Final = (1 << 63) - 1
_FIX: Final = (
    "ask the swarm's authority for a new token: shard admit --authority AUTHORITY.key "
    "--node-pub NODE.pub --swarm SWARM --roles ROLE --expires 30d --out NODE.token"
)


class AdmissionError(HandshakeError):
    """A token does not admit this key to this swarm in this role, now. See subclasses."""

    reason = "admission"


class TokenMissing(AdmissionError):
    """No token: the node (or peer) presented none."""

    reason = "no-token"


class TokenMalformed(AdmissionError):
    """The bytes are not a shard admission token."""

    reason = "malformed-token"


class ForeignAuthority(AdmissionError):
    """The token was issued by another authority than this swarm's."""

    reason = "foreign-authority"


class BadTokenSignature(AdmissionError):
    """The authority's signature does not match the token's contents (forged or altered)."""

    reason = "bad-signature"


class ForeignSwarm(AdmissionError):
    """The token admits its key to another swarm."""

    reason = "foreign-swarm"


class WrongIdentity(AdmissionError):
    """The token belongs to another key than the one presenting it."""

    reason = "wrong-identity"


class TokenNotYetValid(AdmissionError):
    """The token's not-before time is still in the future."""

    reason = "not-yet-valid"


class TokenExpired(AdmissionError):
    """The token's expiry has passed."""

    reason = "expired"


class TokenRevoked(AdmissionError):
    """The token's serial is on the swarm's revoked list."""

    reason = "revoked"


class RoleNotAllowed(AdmissionError):
    """The role claimed is not one the token grants."""

    reason = "role-not-allowed"


@attrs.frozen
class AdmissionToken:
    """One signed admission. Build with ``issue``; read with ``decode`` / ``load``.

    Times are Unix seconds (UTC); the token is valid for ``not_before <= now < expires``.
    ``roles`` is sorted and without duplicates, so the signed bytes are canonical.
    """

    swarm: str
    node_pub: bytes = attrs.field(repr=short)
    roles: tuple[str, ...]
    not_before: int
    expires: int
    serial: int
    authority_pub: bytes = attrs.field(repr=short)
    signature: bytes = attrs.field(default=b"", repr=False)

    def signed_bytes(self) -> bytes:
        """What the authority signs: ``SIGNED_CONTEXT`` + a msgpack array of every field
        but the signature, in declaration order."""
        body = [
            self.swarm,
            self.node_pub,
            list(self.roles),
            self.not_before,
            self.expires,
            self.serial,
            self.authority_pub,
        ]
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return SIGNED_CONTEXT + packed

    def encode(self) -> bytes:
        """The token as it travels in a handshake: ``["shard-token", 1, *fields, signature]``."""
        body = [
            _TAG,
            1,
            self.swarm,
            self.node_pub,
            list(self.roles),
            self.not_before,
            self.expires,
            self.serial,
            self.authority_pub,
            self.signature,
        ]
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    @classmethod
    def decode(cls, data: bytes) -> AdmissionToken:
        """Parse ``encode``'s bytes. Errors: ``TokenMalformed`` saying what is wrong."""
        if len(data) > _MAX_TOKEN_BYTES:
            raise TokenMalformed(f"token is {len(data)} bytes; at most {_MAX_TOKEN_BYTES}")
        try:
            body = unpack_small(data)
        except ValueError as exc:
            raise TokenMalformed(f"token is not msgpack: {exc}") from None
        return _from_body(body)

    def to_text(self) -> str:
        """The token file's contents: ``shard-token-v1 <base64>`` and a newline."""
        return f"{TOKEN_PREFIX} {base64.b64encode(self.encode()).decode()}\n"

    @classmethod
    def from_text(cls, text: str, *, source: str = "token") -> AdmissionToken:
        """Parse ``to_text``. Errors: ``TokenMalformed`` naming ``source``."""
        words = text.split()
        if len(words) != 2 or words[0] != TOKEN_PREFIX:
            raise TokenMalformed(
                f"{source}: not a shard admission token (expected '{TOKEN_PREFIX} <base64>'); "
                "pass the file `shard admit --out` wrote"
            )
        try:
            data = base64.b64decode(words[1], validate=True)
        except binascii.Error:
            raise TokenMalformed(f"{source}: the token is not valid base64") from None
        try:
            return cls.decode(data)
        except TokenMalformed as exc:
            raise TokenMalformed(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: Path) -> AdmissionToken:
        """Read a token file. Errors: ``TokenMissing`` (no file), ``TokenMalformed``."""
        try:
            text = path.read_text(encoding="ascii")
        except FileNotFoundError:
            raise TokenMissing(f"{path}: no such token file; {_FIX}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenMalformed(f"{path}: cannot read token: {exc}") from None
        return cls.from_text(text, source=str(path))

    def save(self, path: Path) -> None:
        """Write the token file (never overwriting). Errors: ``IdentityError``."""
        write_new(path, self.to_text().encode(), mode=0o644)


@attrs.frozen
class Admitted:
    """Who a handshake admitted on the other end: its key, the role it holds on this
    connection, and the token that allowed it."""

    identity: bytes = attrs.field(repr=short)
    role: str
    token: AdmissionToken


def unpack_small(data: bytes) -> object:
    """Unpack a small msgpack record (a token, a handshake message): arrays of at most 16
    items, strings and bins of at most 1 KiB, no maps, no extension types.

    Errors: ``ValueError`` naming what msgpack refused.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            max_bin_len=_MAX_TOKEN_BYTES,
            max_str_len=_MAX_TOKEN_BYTES,
            max_array_len=16,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


def _from_body(body: object) -> AdmissionToken:
    if not isinstance(body, list) or len(body) != 10 or body[:2] != [_TAG, 1]:
        raise TokenMalformed("not a version 1 shard token")
    swarm, node_pub, roles, not_before, expires, serial, authority_pub, signature = body[2:]
    ok = (
        isinstance(swarm, str)
        and _is_bytes(node_pub, KEY_BYTES)
        and isinstance(roles, list)
        and all(isinstance(r, str) for r in roles)
        and all(_is_int(v) for v in (not_before, expires, serial))
        and _is_bytes(authority_pub, KEY_BYTES)
        and _is_bytes(signature, SIGNATURE_BYTES)
    )
    if not ok:
        raise TokenMalformed("a token field has the wrong type or length")
    return AdmissionToken(
        swarm, node_pub, tuple(roles), not_before, expires, serial, authority_pub, signature
    )


def _is_bytes(value: object, size: int) -> bool:
    return isinstance(value, bytes) and len(value) == size


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_SERIAL


def canonical_roles(roles: Iterable[str]) -> tuple[str, ...]:
    """Sorted, unique roles. Errors: ``ValueError`` for an unknown role or none at all."""
    found = tuple(sorted(set(roles)))
    unknown = [r for r in found if r not in ROLES]
    if unknown or not found:
        raise ValueError(f"roles must be some of {', '.join(ROLES)}; got {', '.join(found)!r}")
    return found


def issue(
    authority: NodeIdentity,
    *,
    node_pub: bytes,
    swarm: str,
    roles: Iterable[str],
    not_before: int,
    expires: int,
    serial: int,
) -> AdmissionToken:
    """Sign a token admitting ``node_pub`` to ``swarm`` as ``roles`` for [not_before, expires).

    Errors: ``ValueError`` for an empty swarm, a bad key, unknown roles, an empty window or a
    serial outside [0, 2**63).
    """
    if not swarm:
        raise ValueError("swarm name must not be empty")
    if len(node_pub) != KEY_BYTES:
        raise ValueError(f"node public key must be {KEY_BYTES} bytes")
    if not 0 <= serial <= _MAX_SERIAL:
        raise ValueError(f"serial must be in [0, 2**63), got {serial}")
    if not 0 <= not_before < expires <= _MAX_SERIAL:
        raise ValueError(f"expiry ({expires}) must come after not-before ({not_before})")
    unsigned = AdmissionToken(
        swarm,
        node_pub,
        canonical_roles(roles),
        not_before,
        expires,
        serial,
        authority.public,
    )
    return attrs.evolve(unsigned, signature=authority.sign(unsigned.signed_bytes()))


def verify(
    token: AdmissionToken,
    *,
    authority_pub: bytes,
    swarm: str,
    role: str,
    now: float,
    revoked: Collection[int] = (),
    node_pub: bytes | None = None,
    whose: str = "the token",
) -> None:
    """Check that ``token`` admits ``node_pub`` (if given) to ``swarm`` as ``role`` at ``now``.

    Checks, in order: issued by ``authority_pub``; its signature; the swarm; the key; the
    validity window; revocation; the role. ``whose`` starts every message ("the token of
    127.0.0.1:5123"). Errors: the ``AdmissionError`` subclass of the first failed check.
    """
    what = f"{whose} (serial {token.serial}, key {short(token.node_pub)})"
    if token.authority_pub != authority_pub:
        raise ForeignAuthority(
            f"{what} was issued by authority {short(token.authority_pub)}, not this swarm's "
            f"({short(authority_pub)}); {_FIX}"
        )
    if not verify_signature(authority_pub, token.signed_bytes(), token.signature):
        raise BadTokenSignature(
            f"{what} does not carry a valid signature of the swarm's authority (forged or "
            f"altered); {_FIX}"
        )
    if token.swarm != swarm:
        raise ForeignSwarm(f"{what} admits to swarm {token.swarm!r}, not {swarm!r}; {_FIX}")
    if node_pub is not None and token.node_pub != node_pub:
        owner, presenter = told_apart(token.node_pub, node_pub)
        raise WrongIdentity(
            f"{what} belongs to key {owner}, but it was presented by key {presenter}; each "
            "node must present its own token"
        )
    _check_window(token, what, now)
    if token.serial in revoked:
        raise TokenRevoked(f"{what} has been revoked by the swarm's authority; {_FIX}")
    if role not in token.roles:
        raise RoleNotAllowed(
            f"{what} allows the roles {', '.join(token.roles)}, not {role!r}; {_FIX}"
        )


def _check_window(token: AdmissionToken, what: str, now: float) -> None:
    if now < token.not_before:
        raise TokenNotYetValid(
            f"{what} is not valid before {utc(token.not_before)} (now {utc(now)}); check this "
            "machine's clock, or wait"
        )
    if now >= token.expires:
        raise TokenExpired(f"{what} expired at {utc(token.expires)} (now {utc(now)}); {_FIX}")


def utc(t: float) -> str:
    """Unix seconds as ``2026-11-30T07:55:43Z``."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_DURATION = re.compile(r"(\d+)([smhdw])")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> int:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"``, ``"2w"`` -> seconds.

    Errors: ``ValueError`` saying the accepted forms.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration like 30d, 12h, 90m, 3600s or 2w")
    return int(match.group(1)) * _UNIT_S[match.group(2)]
