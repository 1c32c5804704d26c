"""``reachable`` and ``[swarm] relay`` in a swarm spec: defaults, the ``nat:NAME`` address of a
node behind NAT, and each mistake refused in one line naming the key; a spec with no node
behind NAT gets no NAT network at all."""

from __future__ import annotations

from typing import Any

import pytest

from shard.nodes.compose import with_reach
from shard.spec.swarm import SpecError, SwarmSpec
from shard.transport import MemoryNetwork
from shard.transport.nat import NatNetwork


def _data(*, s1: dict[str, Any] | None = None, **swarm: Any) -> dict[str, Any]:
    return {
        "swarm": {"name": "home", "model": "smollm2", "insecure": True, **swarm},
        "coordinator": {"name": "coord", "listen": "203.0.113.7:7700"},
        "stage": [
            {"name": "s0", "listen": "192.168.1.20:7701", "reachable": False},
            {"name": "s1", "listen": "198.51.100.2:7701", **(s1 or {})},
        ],
    }


def test_reachable_defaults_to_true_and_a_nat_node_is_addressed_by_name() -> None:
    """s0 (reachable = false) is dialled as nat:s0; s1 and the coordinator by address; the
    relay is the coordinator."""
    spec = SwarmSpec.from_dict(_data())
    assert [s.reachable for s in spec.stages] == [False, True]
    assert spec.address_of("s0") == "nat:s0"
    assert spec.address_of("s1") == "198.51.100.2:7701"
    assert spec.address_of("coord") == "203.0.113.7:7700"
    assert spec.relay == "coord"
    assert SwarmSpec.from_dict(_data(relay="s1")).relay == "s1"


@pytest.mark.parametrize(
    ("data", "key", "why"),
    [
        (_data(relay="s0"), "swarm.relay", "s0 has reachable = false"),
        (_data(relay="nobody"), "swarm.relay", "no node named 'nobody'"),
        (_data(relay=3), "swarm.relay", "string"),
        (_data(s1={"reachable": "no"}), "stage[1].reachable", "true or false"),
    ],
)
def test_a_wrong_reach_is_one_line_naming_the_key(data: dict[str, Any], key: str, why: str) -> None:
    """Each mistake names its key and what is wrong."""
    with pytest.raises(SpecError) as caught:
        SwarmSpec.from_dict(data, source="home.toml")
    assert key in str(caught.value) and why in str(caught.value), str(caught.value)


def test_a_coordinator_behind_nat_is_refused() -> None:
    """Everyone dials the coordinator, so it must accept inbound connections."""
    data = _data()
    data["coordinator"]["reachable"] = False
    with pytest.raises(SpecError, match=r"coordinator.reachable: the coordinator must accept"):
        SwarmSpec.from_dict(data, source="home.toml")


def test_only_a_spec_with_a_node_behind_nat_gets_nat_networks() -> None:
    """Without a reachable = false node every node's network is exactly the wire network;
    with one, each is a NatNetwork, and only the relay node holds the hub."""
    inner = MemoryNetwork()
    plain = SwarmSpec.from_dict(_data() | {"stage": [{"name": "s0", "listen": "10.0.0.2:1"}]})
    assert with_reach(plain, "s0", "stage", inner, owns_inner=False) is inner
    spec = SwarmSpec.from_dict(_data(relay="s1"))
    nets = {n: with_reach(spec, n, "stage", inner, owns_inner=False) for n in ("coord", "s0", "s1")}
    assert all(isinstance(net, NatNetwork) for net in nets.values())
    hubs = {n for n, net in nets.items() if isinstance(net, NatNetwork) and net.hub is not None}
    assert hubs == {"s1"}
