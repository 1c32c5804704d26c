"""Failover in swarm specs: [failover], [[standby]] and [[faults]], their defaults, every
rejection (one line naming the file and the key), and the SwarmSpec methods that know standbys.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from shard.spec.failover import FailoverSpec, FaultSpec
from shard.spec.nodes import StageSpec, StandbySpec
from shard.spec.swarm import SpecError, SwarmSpec
from shard.spec.trust import CredentialPaths

SOURCE = "<test>"
HEX = "ab" * 32


def _data(**sections: Any) -> dict[str, Any]:
    """A minimal valid spec (coord, s0, s1) as parsed TOML; ``sections`` replace top tables."""
    data: dict[str, Any] = {
        "swarm": {"name": "t", "model": "smollm2", "insecure": True},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:7700"},
        "stage": [
            {"name": "s0", "listen": "127.0.0.1:7701", "layers": "auto"},
            {"name": "s1", "listen": "127.0.0.1:7702", "layers": "auto"},
        ],
    }
    data.update(sections)
    return copy.deepcopy(data)


def _full() -> dict[str, Any]:
    """Every failover key given: a hot standby, a spare, and one fault of each kind."""
    return _data(
        failover={
            "heartbeat_s": 0.1,
            "dead_after_s": 0.5,
            "send_timeout_s": 1.5,
            "join_deadline_s": 10,
            "splice_timeout_s": 20.0,
            "replay_max_mib": 256,
            "register_timeout_s": 5,
            "probe_s": 0.5,
        },
        standby=[
            {"name": "s1-standby", "listen": "127.0.0.1:7711", "layers_of": "s1"},
            {"name": "spare", "listen": "[::1]:7712"},
        ],
        faults=[
            {"kind": "kill", "node": "s1", "at_token": 12},
            {"kind": "stall", "node": "s0", "at_s": 2, "seconds": 3},
            {"kind": "sever", "node": "coord", "at_token": 0},
        ],
    )


def _load(data: dict[str, Any]) -> SwarmSpec:
    return SwarmSpec.from_dict(data, source=SOURCE)


def _rejected(data: dict[str, Any], key: str) -> str:
    """Assert ``data`` is rejected with a one-line error naming the source and ``key``."""
    with pytest.raises(SpecError) as info:
        _load(data)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{SOURCE}: {key}: "), text
    assert info.value.key == key
    return text


def test_absent_tables_read_as_defaults() -> None:
    """No [failover], [[standby]] or [[faults]]: default timings, no standbys, no faults."""
    spec = _load(_data())
    assert spec.failover == FailoverSpec()
    assert spec.failover == FailoverSpec(0.25, 4.0, 2.0, 30.0, 30.0, 1024)
    assert spec.failover.replay_max_bytes == 1024 << 20
    assert spec.standbys == ()
    assert spec.faults == ()


def test_empty_failover_table_reads_as_defaults() -> None:
    """An empty [failover] is the defaults; the Register deadline keeps its old 10 s."""
    assert _load(_data(failover={})).failover == FailoverSpec()
    assert FailoverSpec().register_timeout_s == 10.0


def test_detector_keys_are_read() -> None:
    """``suspect_phi``, ``dead_phi`` and ``min_std_s`` land in their fields (defaults: 3, 8,
    0.1 s)."""
    d = FailoverSpec()
    assert (d.suspect_phi, d.dead_phi, d.min_std_s) == (3.0, 8.0, 0.1)
    spec = _load(_data(failover={"suspect_phi": 2, "dead_phi": 12, "min_std_s": 0.05}))
    assert (spec.failover.suspect_phi, spec.failover.dead_phi) == (2.0, 12.0)
    assert spec.failover.min_std_s == 0.05


def test_register_timeout_is_read_and_checked() -> None:
    """``register_timeout_s`` lands in its field and must be a number > 0."""
    spec = _load(_data(failover={"register_timeout_s": 3}))
    assert spec.failover.register_timeout_s == 3.0
    data = _data(failover={"register_timeout_s": 0})
    assert "> 0" in _rejected(data, "failover.register_timeout_s")


def test_full_example_reads_into_records() -> None:
    """Every key lands in its record field (integers accepted for seconds, as floats)."""
    spec = _load(_full())
    assert spec.failover == FailoverSpec(
        heartbeat_s=0.1,
        dead_after_s=0.5,
        send_timeout_s=1.5,
        join_deadline_s=10.0,
        splice_timeout_s=20.0,
        replay_max_mib=256,
        register_timeout_s=5.0,
        probe_s=0.5,
    )
    hot, spare = spec.standbys
    assert (hot.name, str(hot.listen), hot.layers_of) == ("s1-standby", "127.0.0.1:7711", "s1")
    assert (spare.name, str(spare.listen), spare.layers_of) == ("spare", "[::1]:7712", None)
    assert hot.role == spare.role == "standby"  # the default
    auditor = _load(_with("standby", {"role": "auditor"})).standbys[0]
    assert (auditor.name, auditor.layers_of, auditor.role) == ("s1-standby", "s1", "auditor")
    assert hot.credentials == CredentialPaths()
    assert spec.faults == (
        FaultSpec("kill", "s1", at_token=12),
        FaultSpec("stall", "s0", at_s=2.0, seconds=3.0),
        FaultSpec("sever", "coord", at_token=0),
    )
    assert isinstance(spec.faults[1].at_s, float)
    assert spec.ring() == ("coord", "s0", "s1", "coord")  # standbys stay out of the ring


def test_spec_file_with_failover_tables(tmp_path: Path) -> None:
    """The TOML form of the docs' example loads."""
    path = tmp_path / "swarm.toml"
    path.write_text(
        """
[swarm]
name = "t"
model = "smollm2"
insecure = true

[coordinator]
listen = "127.0.0.1:7700"

[[stage]]
name = "s0"
listen = "127.0.0.1:7701"

[[stage]]
name = "s1"
listen = "127.0.0.1:7702"

[failover]
heartbeat_s = 0.25
dead_after_s = 1.0

[[standby]]
name = "s1-standby"
listen = "127.0.0.1:7711"
layers_of = "s1"

[[faults]]
kind = "kill"
node = "s1"
at_token = 12
"""
    )
    spec = SwarmSpec.from_file(path)
    assert spec.standbys[0].layers_of == "s1"
    assert spec.faults == (FaultSpec("kill", "s1", at_token=12),)


def _with(section: str, change: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """The full example with ``change`` applied to ``section`` (``[index]`` of an array);
    a value of None deletes the key."""
    data = _full()
    table = data[section] if section == "failover" else data[section][index]
    for name, value in change.items():
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value
    return data


@pytest.mark.parametrize(
    ("data", "key", "expected"),
    [
        pytest.param(
            _with("faults", {"kind": "crash"}),
            "faults[0].kind",
            "unknown fault 'crash'; use one of kill, stall, sever",
            id="bad-kind",
        ),
        pytest.param(
            _with("faults", {"at_s": 1.0}),
            "faults[0].at_token",
            "exactly one of at_token (committed tokens) or at_s (seconds): both given; keep one",
            id="both-at",
        ),
        pytest.param(
            _with("faults", {"at_token": None}),
            "faults[0].at_token",
            "exactly one of at_token (committed tokens) or at_s (seconds): neither given; add one",
            id="neither-at",
        ),
        pytest.param(
            _with("faults", {"at_token": -1}),
            "faults[0].at_token",
            "must be >= 0, got -1",
            id="negative-at-token",
        ),
        pytest.param(
            _with("faults", {"at_s": 0}, index=1),
            "faults[1].at_s",
            "must be a finite number > 0, got 0",
            id="zero-at-s",
        ),
        pytest.param(
            _with("faults", {"seconds": None}, index=1),
            "faults[1].seconds",
            "missing required key for a stall; add seconds = 3.0",
            id="stall-without-seconds",
        ),
        pytest.param(
            _with("faults", {"seconds": -2.0}, index=1),
            "faults[1].seconds",
            "must be a finite number > 0, got -2.0",
            id="stall-negative-seconds",
        ),
        pytest.param(
            _with("faults", {"seconds": 3.0}),
            "faults[0].seconds",
            "only a stall has a length; remove it from this kill",
            id="kill-with-seconds",
        ),
        pytest.param(
            _with("faults", {"node": "s9"}),
            "faults[0].node",
            "no node named 's9' here; a kill fault names a stage: s0, s1",
            id="unknown-fault-node",
        ),
        pytest.param(
            _with("faults", {"node": "coord"}),
            "faults[0].node",
            "no node named 'coord' here; a kill fault names a stage: s0, s1",
            id="kill-the-coordinator",
        ),
        pytest.param(
            _with("faults", {"node": "s1-standby"}, index=2),
            "faults[2].node",
            "a sever fault names a stage or the coordinator: s0, s1, coord",
            id="sever-a-standby",
        ),
        pytest.param(
            _with("standby", {"layers_of": "s7"}),
            "standby[0].layers_of",
            "no stage named 's7'; name the stage whose block this standby loads (s0, s1), "
            "or omit layers_of for a spare",
            id="unknown-layers-of",
        ),
        pytest.param(
            _with("standby", {"role": "judge"}),
            "standby[0].role",
            "unknown role 'judge'; use one of standby, auditor",
            id="unknown-standby-role",
        ),
        pytest.param(
            _with("standby", {"role": "auditor"}, index=1),
            "standby[1].layers_of",
            "an auditor re-runs a stage's block, so it must hold one: add layers_of = "
            '"<stage name>"',
            id="auditor-without-a-block",
        ),
        pytest.param(
            _with("standby", {"name": "s1"}),
            "standby[0].name",
            "duplicate node name 's1' (also stage[1].name); every node needs its own name",
            id="standby-named-like-a-stage",
        ),
        pytest.param(
            _with("standby", {"name": "s1-standby"}, index=1),
            "standby[1].name",
            "duplicate node name 's1-standby' (also standby[0].name)",
            id="two-standbys-one-name",
        ),
        pytest.param(
            _with("standby", {"listen": "127.0.0.1:7702"}),
            "standby[0].listen",
            "duplicate listen address '127.0.0.1:7702' (also stage[1].listen)",
            id="standby-on-a-stage-port",
        ),
        pytest.param(
            _with("standby", {"listen": "::1:7712"}),
            "standby[0].listen",
            "IPv6 hosts need brackets",
            id="bad-standby-address",
        ),
        pytest.param(
            _with("standby", {"listen": None}),
            "standby[0].listen",
            'missing required key; add listen = "127.0.0.1:7711"',
            id="standby-without-listen",
        ),
        pytest.param(
            _with("failover", {"dead_after_s": 0.15}),
            "failover.dead_after_s",
            "0.15 is under two heartbeats (heartbeat_s = 0.1); set dead_after_s >= 0.2 "
            "or lower heartbeat_s",
            id="dead-after-under-two-heartbeats",
        ),
        pytest.param(
            _with("failover", {"suspect_phi": 5.0, "dead_phi": 4.0}),
            "failover.dead_phi",
            "4.0 is under suspect_phi = 5.0 (a node must be suspected before it is dead); "
            "set dead_phi >= 5.0",
            id="dead-phi-under-suspect-phi",
        ),
        pytest.param(
            _with("failover", {"min_std_s": 0}),
            "failover.min_std_s",
            "must be a finite number > 0, got 0",
            id="zero-min-std",
        ),
        pytest.param(
            _with("failover", {"heartbeat_s": -0.25}),
            "failover.heartbeat_s",
            "must be a finite number > 0, got -0.25",
            id="negative-heartbeat",
        ),
        pytest.param(
            _with("failover", {"send_timeout_s": 0}),
            "failover.send_timeout_s",
            "must be a finite number > 0, got 0",
            id="zero-send-timeout",
        ),
        pytest.param(
            _with("failover", {"join_deadline_s": -1}),
            "failover.join_deadline_s",
            "must be a finite number > 0, got -1",
            id="negative-join-deadline",
        ),
        pytest.param(
            _with("failover", {"splice_timeout_s": float("inf")}),
            "failover.splice_timeout_s",
            "must be a finite number > 0, got inf",
            id="infinite-splice-timeout",
        ),
        pytest.param(
            _with("failover", {"replay_max_mib": 0}),
            "failover.replay_max_mib",
            "must be >= 1, got 0",
            id="zero-replay-log",
        ),
        pytest.param(
            _with("failover", {"replay_max_mib": 1.5}),
            "failover.replay_max_mib",
            "expected an integer, got float 1.5",
            id="fractional-replay-log",
        ),
        pytest.param(
            _with("failover", {"heartbeat": 0.5}),
            "failover.heartbeat",
            "unknown key; did you mean 'heartbeat_s'?",
            id="unknown-failover-key",
        ),
        pytest.param(
            _with("standby", {"layers": [0, 5]}),
            "standby[0].layers",
            "unknown key; did you mean 'layers_of'?",
            id="unknown-standby-key",
        ),
        pytest.param(
            _with("faults", {"at": 3}),
            "faults[0].at",
            "unknown key; did you mean 'at_s'?",
            id="unknown-fault-key",
        ),
        pytest.param(
            _data(fault=[{"kind": "kill", "node": "s1", "at_token": 1}]),
            "fault",
            "unknown key; did you mean 'faults'?",
            id="unknown-top-level-key",
        ),
        pytest.param(
            _data(standby={"name": "x", "listen": "127.0.0.1:7711"}),
            "standby",
            "expected an array of tables [[standby]]",
            id="standby-not-an-array",
        ),
    ],
)
def test_rejections_name_key_and_fix(data: dict[str, Any], key: str, expected: str) -> None:
    """Each invalid failover setting is one line naming the key, what is wrong and the fix."""
    assert expected in _rejected(data, key)


def test_port_zero_standbys_may_share() -> None:
    """As for stages, port 0 (ephemeral) may repeat."""
    data = _full()
    for node in [data["coordinator"], *data["stage"], *data["standby"]]:
        node["listen"] = "127.0.0.1:0"
    assert len(_load(data).standbys) == 2


def test_secure_spec_needs_standby_credentials() -> None:
    """In a secure swarm a standby needs a key and token like any node; paths resolve."""
    data = _data()
    data["swarm"]["insecure"] = False
    data["trust"] = {"authority": HEX}
    for node in [data["coordinator"], *data["stage"]]:
        node["key"], node["token"] = f"k/{node['name']}.key", f"k/{node['name']}.token"
    data["standby"] = [{"name": "sb", "listen": "127.0.0.1:7711", "key": "k/sb.key"}]
    text = _rejected(data, "standby[0].token")
    assert 'add token = "keys/sb.token"' in text
    data["standby"][0]["token"] = "k/sb.token"
    spec = SwarmSpec.from_dict(data, source=SOURCE, base_dir=Path("/base"))
    assert spec.standbys[0].credentials == CredentialPaths(
        Path("/base/k/sb.key"), Path("/base/k/sb.token")
    )
    assert spec.node("sb").credentials.token == Path("/base/k/sb.token")


def test_node_finds_a_standby() -> None:
    """node() returns a standby's record; the not-found message lists standbys too."""
    spec = _load(_full())
    standby = spec.node("s1-standby")
    assert isinstance(standby, StandbySpec)
    assert standby is spec.standbys[0]
    assert isinstance(spec.node("s1"), StageSpec)
    with pytest.raises(SpecError) as info:
        spec.node("s9")
    assert str(info.value).endswith("nodes: coord, s0, s1, s1-standby, spare")


def test_with_ports_rewrites_a_standby_port() -> None:
    """with_ports() moves a standby's port and leaves the others alone."""
    data = _full()
    data["standby"][1]["listen"] = "127.0.0.1:0"
    spec = _load(data).with_ports({"spare": 4012, "s0": 4001})
    assert [spec.node(n).listen.port for n in ("coord", "s0", "s1", "s1-standby", "spare")] == [
        7700,
        4001,
        7702,
        7711,
        4012,
    ]
    assert spec.standbys[1].listen.host == "127.0.0.1"
    with pytest.raises(SpecError):
        spec.with_ports({"spare": 70000})


@pytest.mark.parametrize(("layers", "hot"), [("auto", (15, 30)), ([0, 12], (12, 30))])
def test_standby_block_is_its_stages_block(layers: Any, hot: tuple[int, int]) -> None:
    """A hot standby loads its layers_of stage's block; a spare loads none at start."""
    data = _full()
    data["stage"][0]["layers"] = layers
    data["stage"][1]["layers"] = layers if layers == "auto" else [12, 30]
    spec = _load(data)
    assert spec.standby_block("s1-standby", 30) == hot == spec.blocks(30)[1]
    assert spec.standby_block("spare", 30) is None


def test_standby_block_of_a_non_standby() -> None:
    spec = _load(_full())
    with pytest.raises(SpecError, match="'s1' is not a \\[\\[standby\\]\\] node"):
        spec.standby_block("s1", 30)
    with pytest.raises(SpecError, match="no node named 'nope'"):
        spec.standby_block("nope", 30)


def test_the_receipt_log_folder_resolves_against_the_spec(tmp_path: Path) -> None:
    """`[ledger] receipts` is a folder relative to the spec's directory (absent: no log); a
    key it does not know, or a folder that is not a string, is one error naming it."""
    body = (
        '[swarm]\nname = "t"\nmodel = "smollm2"\ninsecure = true\n'
        '[coordinator]\nlisten = "127.0.0.1:7700"\n'
        '[[stage]]\nname = "s0"\nlisten = "127.0.0.1:7701"\n'
    )
    path = tmp_path / "swarm.toml"
    path.write_text(body)
    assert SwarmSpec.from_file(path).ledger.receipts is None
    path.write_text(body + '[ledger]\nreceipts = "metering"\n')
    assert SwarmSpec.from_file(path).ledger.receipts == str(tmp_path / "metering")
    for bad, key in (('receipt = "x"', "receipt"), ("receipts = 3", "receipts")):
        path.write_text(body + f"[ledger]\n{bad}\n")
        with pytest.raises(SpecError, match=key):
            SwarmSpec.from_file(path)
