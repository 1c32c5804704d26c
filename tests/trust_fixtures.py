"""Keys, tokens and credentials for the trust tests: deterministic, in memory, fixed clock."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from shard.trust.admission import AdmissionToken, issue
from shard.trust.channel import Credentials, TrustPolicy
from shard.trust.identity import NodeIdentity

#: The tests' "now": 2027-01-15T08:00:00Z. Tokens are valid from NOW - 1 h to NOW + 1 day.
NOW = 1_800_000_000.0
SWARM = "lab"
AUTHORITY = NodeIdentity.from_seed(b"A" * 32)
OTHER_AUTHORITY = NodeIdentity.from_seed(b"Z" * 32)


def identity(name: str) -> NodeIdentity:
    """A fixed identity per name (``"s0"``, ``"coord"``, ...)."""
    return NodeIdentity.from_seed(name.encode().ljust(32, b"."))


def token(
    who: NodeIdentity,
    roles: Iterable[str] = ("stage",),
    *,
    authority: NodeIdentity = AUTHORITY,
    swarm: str = SWARM,
    serial: int = 1,
    not_before: float = NOW - 3600,
    expires: float = NOW + 86400,
) -> AdmissionToken:
    """A token for ``who``, by default valid now for a stage of ``lab``."""
    return issue(
        authority,
        node_pub=who.public,
        swarm=swarm,
        roles=roles,
        not_before=int(not_before),
        expires=int(expires),
        serial=serial,
    )


def credentials(name: str, roles: Iterable[str] = ("stage",), **kw: object) -> Credentials:
    """``name``'s identity with a token (``kw`` as ``token``)."""
    who = identity(name)
    return Credentials(who, token(who, roles, **kw))  # type: ignore[arg-type]


def policy(*, revoked: Iterable[int] = ()) -> TrustPolicy:
    """The ``lab`` swarm's policy under ``AUTHORITY``."""
    return TrustPolicy(AUTHORITY.public, SWARM, frozenset(revoked))


def forged(tok: AdmissionToken, **changes: object) -> AdmissionToken:
    """``tok`` with fields changed after signing (its signature no longer matches)."""
    return attrs.evolve(tok, **changes)  # type: ignore[arg-type]
