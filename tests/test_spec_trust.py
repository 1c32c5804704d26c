"""Secure swarm specs: the [trust] table and node keys/tokens, the shipped local-secure spec,
the ops script that provisions it, and a node's own check of its credentials at start."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from shard.nodes.compose import client_network, node_network, provision_local, trust_policy
from shard.spec.swarm import SpecError, SwarmSpec, load_spec
from shard.spec.trust import CredentialPaths
from shard.transport import WebSocketNetwork
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.admission import ForeignSwarm, RoleNotAllowed, TokenExpired, TokenRevoked, issue
from shard.trust.identity import IdentityError, NodeIdentity
from trust_fixtures import NOW

ROOT = Path(__file__).resolve().parent.parent
HEX = "ab" * 32


def secure_data(**trust: Any) -> dict[str, Any]:
    """A minimal secure spec as parsed TOML (paths relative to the spec's directory)."""
    return copy.deepcopy(
        {
            "swarm": {"name": "lab", "model": "smollm2", "insecure": False},
            "trust": {"authority": HEX, **trust},
            "coordinator": {
                "name": "coord",
                "listen": "127.0.0.1:7700",
                "key": "k/coord.key",
                "token": "k/coord.token",
            },
            "stage": [
                {"name": "s0", "listen": "127.0.0.1:7701", "key": "k/s0.key", "token": "k/s0.token"}
            ],
        }
    )


def rejected(data: dict[str, Any], key: str) -> str:
    with pytest.raises(SpecError) as caught:
        SwarmSpec.from_dict(data, source="<t>", base_dir=Path("/base"))
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith(f"<t>: {key}: "), text
    return text


def test_secure_spec_reads_trust_and_node_paths() -> None:
    """insecure = false with [trust] loads; node paths resolve against the spec's directory."""
    data = secure_data(revoked=[3, 9], client_key="c.key", client_token="/abs/c.token")
    spec = SwarmSpec.from_dict(data, source="<t>", base_dir=Path("/base"))
    assert not spec.insecure
    assert spec.trust is not None
    assert spec.trust.authority == HEX
    assert spec.trust.revoked == {3, 9}
    assert spec.trust.client_key == Path("/base/c.key")
    assert spec.trust.client_token == Path("/abs/c.token")
    assert spec.coordinator.credentials == CredentialPaths(
        Path("/base/k/coord.key"), Path("/base/k/coord.token")
    )
    assert spec.stages[0].credentials.token == Path("/base/k/s0.token")


def test_authority_as_a_path_resolves_against_the_spec() -> None:
    """An authority that is not 64 hex digits is a .pub path, made absolute."""
    spec = SwarmSpec.from_dict(
        secure_data(authority="keys/authority.pub"), source="<t>", base_dir=Path("/base")
    )
    assert spec.trust is not None and spec.trust.authority == "/base/keys/authority.pub"


@pytest.mark.parametrize(
    ("edit", "key", "words"),
    [
        (lambda d: d.pop("trust"), "swarm.insecure", "needs a [trust] table"),
        (lambda d: d["stage"][0].pop("key"), "stage[0].key", "shard keygen --out keys/s0.key"),
        (lambda d: d["coordinator"].pop("token"), "coordinator.token", "shard admit"),
        (lambda d: d["trust"].pop("authority"), "trust.authority", "missing required key"),
        (lambda d: d["trust"].update(revoked=["x"]), "trust.revoked", "list of token serials"),
        (lambda d: d["trust"].update(revoked=[-1]), "trust.revoked", "list of token serials"),
        (lambda d: d["trust"].update(client_key="c.key"), "trust.client_token", "go together"),
        (lambda d: d["trust"].update(authorty="x"), "trust.authorty", "did you mean 'authority'"),
        (lambda d: d["stage"][0].update(tokn="x"), "stage[0].tokn", "did you mean 'token'"),
    ],
)
def test_secure_spec_errors_name_the_key(edit: Any, key: str, words: str) -> None:
    """Every missing or malformed trust setting is one line naming its key and the fix."""
    data = secure_data()
    edit(data)
    assert words in rejected(data, key)


def test_insecure_spec_ignores_missing_credentials() -> None:
    """insecure = true needs no [trust] and no keys (local development)."""
    data = secure_data()
    data["swarm"]["insecure"] = True
    del data["trust"]
    spec = SwarmSpec.from_dict(data, source="<t>")
    assert spec.insecure and spec.trust is None


def test_shipped_local_secure_spec_loads() -> None:
    """specs/local-secure.toml is a valid secure spec naming files under specs/local-secure/."""
    spec = load_spec(ROOT / "specs" / "local-secure.toml")
    assert not spec.insecure and spec.trust is not None
    assert spec.trust.authority == str(ROOT / "specs" / "local-secure" / "authority.key.pub")
    assert spec.node("s2").credentials.key == ROOT / "specs" / "local-secure" / "s2.key"
    assert spec.blocks(30) == ((0, 10), (10, 20), (20, 30))


@pytest.mark.slow
def test_ops_script_provisions_the_local_secure_spec(tmp_path: Path) -> None:
    """ops/local-secure-keys (shard keygen + shard admit) makes credentials that the nodes of
    specs/local-secure.toml and its client accept; running it again overwrites nothing."""
    shutil.copy(ROOT / "specs" / "local-secure.toml", tmp_path / "spec.toml")
    script = ROOT / "ops" / "local-secure-keys"
    # 7 CLI runs; the client's token admits the monitor too, as the script's default does
    env = {**os.environ, "NODES": "coord:coordinator s2:stage client:client,monitor"}
    done = subprocess.run(
        [script, tmp_path / "local-secure"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("token=") == 3
    assert (tmp_path / "local-secure" / "s2.key").stat().st_mode & 0o777 == 0o600
    spec = load_spec(tmp_path / "spec.toml")
    assert isinstance(node_network(spec, "s2", "stage"), SecureWebSocketNetwork)
    assert isinstance(node_network(spec, "coord", "coordinator"), SecureWebSocketNetwork)
    assert isinstance(client_network(spec), SecureWebSocketNetwork)
    assert isinstance(client_network(spec, role="monitor"), SecureWebSocketNetwork)
    again = subprocess.run(
        [script, tmp_path / "local-secure"], capture_output=True, text=True, timeout=60, env=env
    )
    assert again.returncode != 0
    assert "already exists; refusing to overwrite" in again.stderr


def _provisioned(tmp_path: Path, **trust: Any) -> SwarmSpec:
    local = provision_local(
        tmp_path / "keys",
        swarm="lab",
        nodes={"coord": ["coordinator"], "s0": ["stage"], "cli": ["client"]},
        now=NOW,
    )
    data = secure_data(authority=str(local.authority_pub), **trust)
    data["coordinator"].update(key=str(local.key("coord")), token=str(local.token("coord")))
    data["stage"][0].update(key=str(local.key("s0")), token=str(local.token("s0")))
    return SwarmSpec.from_dict(data, source="<t>")


def test_node_checks_its_own_credentials_at_start(tmp_path: Path) -> None:
    """A node whose token is expired, revoked or lacks its role stops before joining, saying
    which; its own valid credentials give a secure network."""
    spec = _provisioned(tmp_path)
    assert isinstance(node_network(spec, "s0", "stage", clock=lambda: NOW), SecureWebSocketNetwork)
    with pytest.raises(TokenExpired, match=r"s0: cannot join: its token .*s0\.token"):
        node_network(spec, "s0", "stage", clock=lambda: NOW + 30 * 86400)
    with pytest.raises(RoleNotAllowed, match="not 'coordinator'"):
        node_network(spec, "s0", "coordinator", clock=lambda: NOW)
    revoked = _provisioned(tmp_path / "r", revoked=[2])  # s0 got serial 2
    with pytest.raises(TokenRevoked):
        node_network(revoked, "s0", "stage", clock=lambda: NOW)


def test_client_credentials_from_flags_or_spec(tmp_path: Path) -> None:
    """A client of a secure swarm needs a key and token: from flags, else [trust]; none is an
    error naming both ways; an insecure spec gives a plain network."""
    spec = _provisioned(tmp_path)
    keys = tmp_path / "keys"
    with pytest.raises(IdentityError, match="--key KEY --token TOKEN"):
        client_network(spec, clock=lambda: NOW)
    net = client_network(spec, key=keys / "cli.key", token=keys / "cli.token", clock=lambda: NOW)
    assert isinstance(net, SecureWebSocketNetwork)
    with pytest.raises(RoleNotAllowed):  # a stage's token is not a client's
        client_network(spec, key=keys / "s0.key", token=keys / "s0.token", clock=lambda: NOW)
    data = secure_data()
    data["swarm"]["insecure"] = True
    assert isinstance(client_network(SwarmSpec.from_dict(data)), WebSocketNetwork)


def test_authority_file_problems_name_the_spec_key(tmp_path: Path) -> None:
    """A missing authority .pub is reported against trust.authority."""
    spec = SwarmSpec.from_dict(secure_data(authority="nope.pub"), source="<t>", base_dir=tmp_path)
    with pytest.raises(IdentityError, match=r"<t>: trust.authority: .*nope.pub: no such"):
        trust_policy(spec)


def test_tokens_are_issued_for_the_spec_swarm_only(tmp_path: Path) -> None:
    """A token for another swarm name does not admit a node of this one."""
    spec = _provisioned(tmp_path)
    local_authority = tmp_path / "keys" / "authority.key"
    s0_key = NodeIdentity.load(tmp_path / "keys" / "s0.key")
    other = issue(
        NodeIdentity.load(local_authority),
        node_pub=s0_key.public,
        swarm="elsewhere",
        roles=["stage"],
        not_before=int(NOW) - 5,
        expires=int(NOW) + 5,
        serial=77,
    )
    (tmp_path / "keys" / "s0.token").unlink()
    other.save(tmp_path / "keys" / "s0.token")
    with pytest.raises(ForeignSwarm, match="admits to swarm 'elsewhere', not 'lab'"):
        node_network(spec, "s0", "stage", clock=lambda: NOW)
