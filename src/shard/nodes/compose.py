"""Trust, composed: each node's credentials and network from its spec, ``shard keygen``,
``shard admit``, and provisioning a local secure swarm.

``node_network(spec, name, role)`` is what a node process runs on: a plain
``WebSocketNetwork`` when the spec says ``insecure = true``, otherwise a
``SecureWebSocketNetwork`` holding the node's key and token, checked first against the spec's
authority, swarm, revocations and the node's role, so a node that could not be admitted
stops at once with the reason instead of being refused by every peer. When any node has
``reachable = false``, that network is wrapped in a ``NatNetwork`` (``with_reach``), which
holds the relay role on the ``[swarm] relay`` node.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from shard.messages import NodeName
from shard.spec.limits import Limits
from shard.spec.nodes import NodeSpec
from shard.spec.swarm import SwarmSpec
from shard.transport import Network, WebSocketNetwork
from shard.transport.guard import PeerDeadlines
from shard.transport.nat import NatNetwork
from shard.transport.paths import PathNetwork
from shard.transport.relayhub import RelayHub
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.admission import (
    AdmissionToken,
    canonical_roles,
    issue,
    parse_duration,
    utc,
    verify,
)
from shard.trust.channel import Credentials, TrustPolicy
from shard.trust.identity import IdentityError, NodeIdentity, public_path, read_public_key, short
from shard.wire import WireLimits

Clock = Callable[[], float]


def wire_limits(spec: SwarmSpec) -> WireLimits:
    """The spec's ``limits.max_message_mib`` as the wire's frame and tensor caps."""
    return _frame_caps(spec.limits)


def _frame_caps(limits: Limits) -> WireLimits:
    cap = limits.max_message_mib << 20
    return WireLimits(max_frame_bytes=cap, max_tensor_bytes=cap)


def trust_policy(spec: SwarmSpec) -> TrustPolicy:
    """What this swarm requires of every token. Errors: ``IdentityError`` (authority file)."""
    if spec.trust is None:
        raise ValueError(f"{spec.source}: not a secure spec (no [trust] table)")
    try:
        authority = read_public_key(spec.trust.authority)
    except IdentityError as exc:
        raise IdentityError(f"{spec.source}: trust.authority: {exc}") from None
    return TrustPolicy(authority, spec.name, spec.trust.revoked)


def load_credentials(
    key: Path, token: Path, policy: TrustPolicy, *, role: str, now: float, who: str
) -> Credentials:
    """Read a key and a token and check that the token admits this key as ``role`` now.

    Errors: ``IdentityError`` (key file), an ``AdmissionError`` subclass (token file).
    """
    identity = NodeIdentity.load(key)
    admission = AdmissionToken.load(token)
    verify(
        admission,
        authority_pub=policy.authority,
        swarm=policy.swarm,
        role=role,
        now=now,
        revoked=policy.revoked,
        node_pub=identity.public,
        whose=f"{who}: cannot join: its token {token}",
    )
    return Credentials(identity, admission)


def plain_network(spec: SwarmSpec) -> WebSocketNetwork:
    """A plaintext ``WebSocketNetwork`` under the spec's ``[limits]`` (``plain_network_for``)."""
    return plain_network_for(spec.limits)


def plain_network_for(limits: Limits) -> WebSocketNetwork:
    """A plaintext ``WebSocketNetwork`` under ``limits``: frame size, timeouts, the node-wide
    byte budget and the caps on connections (in all and per host)."""
    return WebSocketNetwork(
        limits=_frame_caps(limits),
        connect_timeout_s=limits.connect_timeout_s,
        max_peer_connections=limits.max_peer_connections,
        max_buffer_bytes=limits.max_buffer_mib << 20,
        max_connections=limits.max_connections,
        deadlines=_deadlines(limits),
    )


def peer_deadlines(spec: SwarmSpec) -> PeerDeadlines:
    """What a node's listener holds every served connection to, from ``[limits]``: idle
    (``idle_timeout_s`` + ``message_timeout_s``, so a link's own idle deadline, with its
    reason, comes first), a trickled message (``message_timeout_s``) and reclaiming at the
    per-host cap (``reclaim_idle_s``)."""
    return _deadlines(spec.limits)


def _deadlines(limits: Limits) -> PeerDeadlines:
    return PeerDeadlines(
        idle_s=limits.idle_timeout_s + limits.message_timeout_s,
        message_s=limits.message_timeout_s,
        reclaim_idle_s=limits.reclaim_idle_s,
    )


def with_reach(
    spec: SwarmSpec, name: str, role: str, inner: Network, *, owns_inner: bool
) -> Network:
    """``inner`` as node ``name`` (``role``) needs it to reach nodes behind NAT: when any node
    of ``spec`` has ``reachable = false``, or the ring forms from joined nodes (``[formation]``:
    a joined node's network is one on demand, turned behind NAT when the scheduler finds
    nobody reaches it), a ``NatNetwork`` around ``inner`` (holding the relay role when
    ``name`` is ``[swarm] relay``); otherwise ``inner`` itself.

    Errors: ``TypeError`` when ``inner`` cannot dial paths (``shard.transport.paths``)."""
    nodes: list[NodeSpec] = [spec.coordinator, *spec.stages, *spec.standbys]
    formed = spec.formation is not None  # joined nodes' reachability is detected at run time
    if all(node.reachable for node in nodes) and not formed:
        return inner
    if not isinstance(inner, PathNetwork):
        raise TypeError(f"{inner!r} cannot carry NAT-friendly edges (it has no dial_path)")
    limits = spec.limits
    relay = spec.relay or spec.coordinator.name
    hub = None
    if name == relay:
        pair_s = min(8.0, 0.8 * limits.connect_timeout_s)  # within the dialer's connect time
        hub = RelayHub(
            NodeName(name),
            spec.name,
            role,
            pair_timeout_s=pair_s,
            handshake_timeout_s=limits.handshake_timeout_s,
        )
    return NatNetwork(
        inner,
        node=NodeName(name),
        role=role,
        swarm=spec.name,
        advertise=spec.address_of(name),
        relay=str(spec.node(relay).listen),
        hub=hub,
        owns_inner=owns_inner,
        call_timeout_s=limits.connect_timeout_s,
        handshake_timeout_s=limits.handshake_timeout_s,
        on_demand=formed and name != spec.coordinator.name,
    )


def node_network(spec: SwarmSpec, name: str, role: str, *, clock: Clock = time.time) -> Network:
    """The network node ``name`` of ``spec`` runs on, as ``role`` (around it, what reaches
    nodes behind NAT when the spec has any: ``with_reach``).

    Errors: ``IdentityError`` / ``AdmissionError`` when its credentials cannot admit it.
    """
    inner = _wire_network(spec, name, role, clock)
    return with_reach(spec, name, role, inner, owns_inner=True)


def _wire_network(spec: SwarmSpec, name: str, role: str, clock: Clock) -> Network:
    """The plain or the sealed network of node ``name``."""
    timeout_s = spec.limits.connect_timeout_s
    cap = spec.limits.max_peer_connections
    if spec.insecure:
        return plain_network(spec)
    paths = spec.node(name).credentials
    assert paths.key is not None and paths.token is not None  # checked when the spec loaded
    policy = trust_policy(spec)
    credentials = load_credentials(paths.key, paths.token, policy, role=role, now=clock(), who=name)
    return SecureWebSocketNetwork(
        credentials,
        policy,
        role=role,
        limits=wire_limits(spec),
        connect_timeout_s=timeout_s,
        clock=clock,
        max_peer_connections=cap,
        max_buffer_bytes=spec.limits.max_buffer_mib << 20,
        max_connections=spec.limits.max_connections,
        deadlines=peer_deadlines(spec),
    )


def client_network(
    spec: SwarmSpec,
    *,
    key: Path | None = None,
    token: Path | None = None,
    role: str = "client",
    clock: Clock = time.time,
) -> Network:
    """The network a client (``shard generate --spec``, ``swarm run``; ``role="monitor"`` for a
    status viewer) talks to ``spec`` on.

    ``key``/``token`` override the spec's ``[trust] client_key``/``client_token``.
    Errors: ``IdentityError`` when a secure swarm gets no client credentials.
    """
    timeout_s = spec.limits.connect_timeout_s
    if spec.insecure:
        return WebSocketNetwork(
            limits=wire_limits(spec),
            connect_timeout_s=timeout_s,
            max_buffer_bytes=spec.limits.max_buffer_mib << 20,
            max_connections=spec.limits.max_connections,
        )
    assert spec.trust is not None
    key = key or spec.trust.client_key
    token = token or spec.trust.client_token
    if key is None or token is None:
        raise IdentityError(
            f"{spec.source}: a secure swarm admits only clients with a key and token: pass "
            "--key KEY --token TOKEN or set [trust] client_key and client_token (make them "
            "with `shard keygen` and `shard admit --roles client`)"
        )
    policy = trust_policy(spec)
    credentials = load_credentials(key, token, policy, role=role, now=clock(), who=role)
    return SecureWebSocketNetwork(
        credentials,
        policy,
        role=role,
        limits=wire_limits(spec),
        connect_timeout_s=timeout_s,
        clock=clock,
        max_buffer_bytes=spec.limits.max_buffer_mib << 20,
        max_connections=spec.limits.max_connections,
    )


# --- shard keygen / shard admit --------------------------------------------------------------


def keygen(out: Path) -> int:
    """``shard keygen --out PATH``: a new identity in PATH (0600) and PATH.pub."""
    identity = NodeIdentity.generate()
    pub = identity.save(out)
    print(f"key={out} pub={pub} public={identity.public.hex()}")
    return 0


def admit(
    *,
    authority: Path,
    node_pub: str,
    swarm: str,
    roles: str,
    expires: str,
    out: Path,
    serial: int | None = None,
    now: float | None = None,
) -> int:
    """``shard admit``: sign a token for ``node_pub`` (hex or .pub path) and write ``out``.

    Errors: ``IdentityError`` (key files, ``out`` exists), ``ValueError`` (bad arguments).
    """
    signer = NodeIdentity.load(authority)
    pub = read_public_key(node_pub)
    start = int(time.time() if now is None else now)
    token = issue(
        signer,
        node_pub=pub,
        swarm=swarm,
        roles=canonical_roles(r.strip() for r in roles.split(",") if r.strip()),
        not_before=start - 60,  # forgive a minute of clock skew between machines
        expires=start + parse_duration(expires),
        serial=secrets.randbelow(1 << 48) if serial is None else serial,
    )
    token.save(out)
    print(
        f"token={out} serial={token.serial} swarm={swarm} roles={','.join(token.roles)} "
        f"key={short(pub)} expires={utc(token.expires)}"
    )
    return 0


# --- a local secure swarm --------------------------------------------------------------------


@attrs.frozen
class LocalTrust:
    """Keys and tokens made by ``provision_local``: ``DIR/NAME.key``, ``.key.pub``, ``.token``."""

    directory: Path
    authority: NodeIdentity
    serials: Mapping[str, int]

    @property
    def authority_pub(self) -> Path:
        return public_path(self.directory / "authority.key")

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    def token(self, name: str) -> Path:
        return self.directory / f"{name}.token"


def provision_local(
    directory: Path,
    *,
    swarm: str,
    nodes: Mapping[str, Sequence[str]],
    now: float,
    lifetime_s: int = 7 * 86400,
) -> LocalTrust:
    """A fresh authority and, per node name, a key and a token for its roles (serials 1..n).

    For tests and local development (``ops/local-secure-keys`` does the same with the CLI).
    Errors: ``IdentityError`` when a file already exists.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    authority = NodeIdentity.generate()
    authority.save(directory / "authority.key")
    serials: dict[str, int] = {}
    for serial, (name, roles) in enumerate(nodes.items(), start=1):
        identity = NodeIdentity.generate()
        identity.save(directory / f"{name}.key")
        token = issue(
            authority,
            node_pub=identity.public,
            swarm=swarm,
            roles=roles,
            not_before=int(now) - 60,
            expires=int(now) + lifetime_s,
            serial=serial,
        )
        token.save(directory / f"{name}.token")
        serials[name] = serial
    return LocalTrust(directory, authority, serials)


@attrs.frozen
class Signing:
    """Where a node's receipt key and admission token are read from (``signing``): read when
    the node builds its executor (a standby: on ``Activate``), not when it starts."""

    key: Path | None
    token: Path | None  # None in an ``insecure`` swarm: there is no authority

    def identity(self) -> NodeIdentity:
        """The key to sign receipts with: the node's own key when the spec names one (always
        in a secure swarm; in an ``insecure`` one, so ``shard receipt verify --coordinator``
        can pin it), else a fresh ephemeral key, which makes receipts internally consistent
        but proves nothing about who ran the node (docs/security.md says so).

        Errors: ``IdentityError`` for a key file that cannot be read.
        """
        return NodeIdentity.generate() if self.key is None else NodeIdentity.load(self.key)

    def token_text(self) -> str:
        """The text of the node's admission token, which its receipts carry so that pinning
        the authority pins its key; "" without one.

        Errors: an ``AdmissionError`` subclass for a token file that cannot be read.
        """
        if self.token is None:
            return ""
        return AdmissionToken.load(self.token).to_text().rstrip("\n")


def signing(spec: SwarmSpec, name: str) -> Signing:
    """Where node ``name`` reads its signing key and token (SpecError: no such node)."""
    paths = spec.node(name).credentials
    return Signing(paths.key, None if spec.insecure else paths.token)


def signing_identity(spec: SwarmSpec, name: str) -> NodeIdentity:
    """The key node ``name`` signs receipts with (``Signing.identity``)."""
    return signing(spec, name).identity()


def signing_token(spec: SwarmSpec, name: str) -> str:
    """Node ``name``'s admission token's text, "" in an ``insecure`` swarm
    (``Signing.token_text``)."""
    return signing(spec, name).token_text()
