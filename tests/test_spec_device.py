"""Spec keys ``device``, ``dtype``, ``graphs`` per node: defaults, one-line errors, one ring
dtype, and the ``shard up`` overrides (``SwarmSpec.with_runtime``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shard.spec.device import DeviceSpec
from shard.spec.swarm import SpecError, SwarmSpec

BASE: dict[str, Any] = {
    "swarm": {"name": "x", "model": "smollm2", "insecure": True},
    "coordinator": {"listen": "127.0.0.1:0"},
    "stage": [
        {"name": "s0", "listen": "127.0.0.1:0"},
        {"name": "s1", "listen": "127.0.0.1:0"},
    ],
    "standby": [{"name": "b0", "listen": "127.0.0.1:0", "layers_of": "s1"}],
}


def spec_with(where: str, index: int | None = None, **keys: Any) -> SwarmSpec:
    data = copy.deepcopy(BASE)
    table = data[where] if index is None else data[where][index]
    table.update(keys)
    return SwarmSpec.from_dict(data, source="x.toml")


def test_defaults_are_cpu_in_the_swarm_dtype_without_graphs() -> None:
    """A spec that says nothing runs every node on the CPU, in [swarm] dtype, graphs off."""
    spec = SwarmSpec.from_dict(BASE, source="x.toml")
    for name in ("coord", "s0", "s1", "b0"):
        assert spec.node(name).runtime == DeviceSpec()
        assert spec.runtime(name) == DeviceSpec(device="cpu", dtype="float32", graphs="off")


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:7", "auto"])
def test_every_device_spelling_reads(device: str) -> None:
    """cpu, cuda, cuda:N and auto are accepted on a stage and on the coordinator."""
    assert spec_with("stage", 0, device=device).runtime("s0").device == device
    assert spec_with("coordinator", device=device).runtime("coord").device == device


@pytest.mark.parametrize(
    ("where", "index", "keys", "message"),
    [
        ("stage", 0, {"device": "gpu"}, "x.toml: stage[0].device: unknown device 'gpu'; use"),
        ("stage", 0, {"device": "cuda:x"}, "stage[0].device: unknown device 'cuda:x'"),
        ("stage", 1, {"device": 0}, "stage[1].device: expected a string, got integer 0"),
        ("stage", 0, {"dtype": "int8"}, "stage[0].dtype: unknown dtype 'int8'; use one of"),
        ("stage", 0, {"graphs": "on"}, "stage[0].graphs: unknown graphs mode 'on'; use one of"),
        ("standby", 0, {"graphs": "eager"}, "standby[0].graphs: unknown graphs mode 'eager'"),
        ("coordinator", None, {"graphs": "lazy"}, "coordinator.graphs: unknown key"),
    ],
)
def test_bad_values_are_one_line_errors(
    where: str, index: int | None, keys: dict[str, Any], message: str
) -> None:
    """Each bad value names the file and key and says what to write."""
    with pytest.raises(SpecError) as info:
        spec_with(where, index, **keys)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_stage_dtype_must_match_the_ring() -> None:
    """Activations cross the ring in one dtype: a stage or standby that differs is refused."""
    with pytest.raises(SpecError, match=r"stage\[1\]\.dtype: bfloat16 but stage\[0\] runs in"):
        spec_with("stage", 1, dtype="bfloat16")
    with pytest.raises(SpecError, match=r"standby\[0\]\.dtype: float16 but stage\[0\]"):
        spec_with("standby", 0, dtype="float16")


def test_the_coordinator_may_draft_in_its_own_dtype() -> None:
    """The coordinator holds no ring layers: its draft's dtype is its own."""
    spec = spec_with("coordinator", dtype="bfloat16", device="auto")
    assert spec.runtime("coord") == DeviceSpec("auto", "bfloat16", "off")
    assert spec.runtime("s0").dtype == "float32"


def test_node_dtype_equal_to_swarm_dtype_is_fine() -> None:
    """Saying the swarm's dtype again on one stage is not a mismatch."""
    assert spec_with("stage", 0, dtype="float32").runtime("s0").dtype == "float32"


def test_with_runtime_overrides_one_node() -> None:
    """``shard up --device --dtype --graphs`` changes that node only; None keeps the spec's."""
    spec = spec_with("stage", 0, device="cuda:1", graphs="warm")
    changed = spec.with_runtime("s0", device="auto")
    assert changed.runtime("s0") == DeviceSpec("auto", "float32", "warm")
    assert changed.runtime("s1") == spec.runtime("s1")
    assert spec.with_runtime("b0", graphs="lazy").runtime("b0").graphs == "lazy"
    assert spec.with_runtime("coord", dtype="float16").runtime("coord").dtype == "float16"


def test_with_runtime_rejects_bad_values_in_one_line() -> None:
    """A bad override names the node and the key; a ring dtype mismatch is refused too."""
    spec = SwarmSpec.from_dict(BASE, source="x.toml")
    with pytest.raises(SpecError, match=r"^x\.toml: s1\.device: unknown device 'tpu'"):
        spec.with_runtime("s1", device="tpu")
    with pytest.raises(SpecError, match=r"s1\.dtype: bfloat16 but s0 runs in float32"):
        spec.with_runtime("s1", dtype="bfloat16")
    with pytest.raises(SpecError, match="no node named 'zz'"):
        spec.with_runtime("zz", device="cpu")
