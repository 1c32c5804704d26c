"""``[formation]`` in a swarm spec: read with its defaults, no ``[[stage]]`` needed, every
mistake one line naming the key; and the spec a node started with ``--join`` runs on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from shard.nodes.joining import joined_spec
from shard.spec.formation import FormationSpec
from shard.spec.nodes import Address, StandbySpec
from shard.spec.swarm import SpecError, SwarmSpec


def _data(formation: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "swarm": {"name": "formed", "model": "smollm2", "insecure": True},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:7700"},
        **extra,
    }
    if formation is not None:
        data["formation"] = formation
    return data


def test_a_formation_spec_needs_no_stages_and_reads_defaults() -> None:
    """``[formation]`` alone: no stages, expect 1, wait 120 s, 5 probes, unpinned."""
    spec = SwarmSpec.from_dict(_data({}))
    assert spec.stages == () and spec.formation == FormationSpec()
    full = SwarmSpec.from_dict(
        _data(
            {
                "expect": 3,
                "wait_s": 30,
                "probes": 7,
                "pin_boundaries": True,
                "trusted": ["gpu-a", "gpu-b"],
            }
        )
    )
    assert full.formation == FormationSpec(3, 30.0, 7, True, ("gpu-a", "gpu-b"))


def test_remeasure_and_unreachable_read_with_defaults() -> None:
    """The mesh is re-measured every 60 s by default, never with 0; ``unreachable`` names
    the nodes the operator says accept no inbound connection (none by default)."""
    assert FormationSpec().remeasure_s == 60.0 and FormationSpec().unreachable == ()
    spec = SwarmSpec.from_dict(_data({"remeasure_s": 0, "unreachable": ["home-1"]}))
    assert spec.formation is not None
    assert spec.formation.remeasure_s == 0.0 and spec.formation.unreachable == ("home-1",)
    assert SwarmSpec.from_dict(_data({"remeasure_s": 15})).formation == FormationSpec(
        remeasure_s=15.0
    )


def test_stages_fixes_the_ring_size_and_defaults_to_the_planners_choice() -> None:
    """``stages`` is the number of stages the formed ring holds (None by default: the
    predicted lap decides); up to ``expect``."""
    assert FormationSpec().stages is None
    spec = SwarmSpec.from_dict(_data({"expect": 2, "stages": 2}))
    assert spec.formation == FormationSpec(expect=2, stages=2)


def test_a_spec_without_formation_still_needs_stages() -> None:
    """Every existing spec reads as before: no stages and no [formation] is an error that
    names both ways out."""
    with pytest.raises(SpecError, match=r"no stages.*\[formation\]"):
        SwarmSpec.from_dict(_data())


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (
            _data({}, stage=[{"name": "s0", "listen": "127.0.0.1:7701", "layers": "auto"}]),
            "formation",
        ),
        (_data({}, standby=[{"name": "x", "listen": "127.0.0.1:7711"}]), "formation"),
        (_data({"expect": 0}), "formation.expect"),
        (_data({"wait_s": 0}), "formation.wait_s"),
        (_data({"probes": 1000}), "formation.probes"),
        (_data({"trusted": "gpu-a"}), "formation.trusted"),
        (_data({"pin_boundaries": True}), "formation.pin_boundaries"),
        (_data({"expext": 3}), "formation.expext"),
        (_data({"remeasure_s": 2}), "formation.remeasure_s"),
        (_data({"remeasure_s": -1}), "formation.remeasure_s"),
        (_data({"unreachable": [""]}), "formation.unreachable"),
        (_data({"stages": 0}), "formation.stages"),
        (_data({"expect": 2, "stages": 3}), "formation.stages"),
    ],
)
def test_formation_mistakes_name_the_key(data: dict[str, Any], key: str) -> None:
    """Each mistake is one SpecError naming its key."""
    with pytest.raises(SpecError) as info:
        SwarmSpec.from_dict(data)
    assert info.value.key == key, str(info.value)


def test_blocks_of_a_formed_swarm_come_from_the_scheduler() -> None:
    """A formed swarm has no blocks of its own to split; asking says where they come from."""
    spec = SwarmSpec.from_dict(_data({}))
    with pytest.raises(SpecError, match="scheduler places"):
        spec.blocks(6)


def test_a_joining_node_sees_itself_as_a_spare_standby(tmp_path: Path) -> None:
    """``joined_spec`` adds the node as a spare standby at its listen address with its key and
    token, and points the coordinator at the --join address."""
    spec = SwarmSpec.from_dict(_data({}))
    key, token = tmp_path / "n.key", tmp_path / "n.token"
    me = joined_spec(spec, "gpu-a", join="10.0.0.1:7700", listen="10.0.0.5:7800", key=key)
    node = me.node("gpu-a")
    assert isinstance(node, StandbySpec) and node.layers_of is None
    assert node.listen == Address("10.0.0.5", 7800) and node.credentials.key == key
    assert me.coordinator.listen == Address("10.0.0.1", 7700)
    with pytest.raises(SpecError, match="is a node of the spec"):
        joined_spec(spec, "coord", join="10.0.0.1:7700", listen="127.0.0.1:0")
    with pytest.raises(SpecError, match="expected host:port"):
        joined_spec(spec, "gpu-a", join="nowhere", listen="127.0.0.1:0")
    secure = attrs.evolve(spec, insecure=False)
    with pytest.raises(SpecError, match="key and token"):
        joined_spec(secure, "gpu-a", join="10.0.0.1:7700", listen="127.0.0.1:0", key=key)
    assert (
        joined_spec(
            secure, "gpu-a", join="10.0.0.1:7700", listen="127.0.0.1:0", key=key, token=token
        )
        .node("gpu-a")
        .credentials.token
        == token
    )
