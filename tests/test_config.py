"""Swarm specs: loading, every validation rule, and the shipped specs.

Every rejection must be one line that names the file and the key; ``_rejected`` checks that
for each case before the test looks at the specific wording.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard.spec.limits import Limits
from shard.spec.nodes import Address, CoordinatorSpec, EdgeSpec, StageSpec
from shard.spec.swarm import SpecError, SwarmSpec, load_spec
from shard.spec.validate import even_split
from shard.transport.links import HANDSHAKE_TIMEOUT_S

SPECS = Path(__file__).resolve().parent.parent / "specs"
SOURCE = "<test>"


def _data(**sections: Any) -> dict[str, Any]:
    """A minimal valid spec as parsed TOML; ``sections`` replace whole top-level tables."""
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


def _stages(*layers: Any) -> list[dict[str, Any]]:
    return [
        {"name": f"s{i}", "listen": f"127.0.0.1:{7701 + i}", "layers": block}
        for i, block in enumerate(layers)
    ]


def _load(data: dict[str, Any]) -> SwarmSpec:
    return SwarmSpec.from_dict(data, source=SOURCE)


def _rejected(data: dict[str, Any], key: str) -> str:
    """Assert ``data`` is rejected with a one-line error naming the source and ``key``."""
    with pytest.raises(SpecError) as info:
        _load(data)
    return _check_error(info.value, key)


def _check_error(error: SpecError, key: str) -> str:
    text = str(error)
    assert "\n" not in text
    assert text.startswith(f"{SOURCE}: {key}: "), text
    assert error.key == key
    return text


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarm.toml"
    path.write_text(text)
    return path


# --- the shipped specs -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["local.toml", "wan-sim.toml"])
def test_shipped_spec_tiles_smollm2(name: str) -> None:
    """Each shipped spec loads and splits SmolLM2's 30 layers into 3 contiguous blocks."""
    spec = load_spec(SPECS / name)
    assert spec.path == SPECS / name
    assert spec.model == "smollm2"
    assert spec.insecure
    assert spec.blocks(30) == ((0, 10), (10, 20), (20, 30))
    assert spec.ring() == ("coord", "s0", "s1", "s2", "coord")


def test_local_spec_ports_and_latency() -> None:
    """specs/local.toml uses ports 7700-7703 on 127.0.0.1 and no emulated latency."""
    spec = load_spec(SPECS / "local.toml")
    ports = [spec.node(n).listen.port for n in spec.ring()[:-1]]
    assert ports == [7700, 7701, 7702, 7703]
    assert all(str(spec.node(n).listen).startswith("127.0.0.1:") for n in spec.ring())
    assert all(hop.latency_ms == 0.0 for hop in spec.hops())


def test_shipped_specs_share_no_port() -> None:
    """No two shipped specs (nor two nodes of one, standbys included) listen on the same
    port, so any two of them can run at once on one machine."""
    owners: dict[int, str] = {}
    paths = sorted(SPECS.glob("*.toml"))
    assert {p.name for p in paths} >= {"local.toml", "wan-sim.toml", "failover.toml"}
    for path in paths:
        spec = load_spec(path)
        for node in (spec.coordinator, *spec.stages, *spec.standbys):
            port = node.listen.port
            assert port not in owners, f"{path.name} {node.name} and {owners[port]}: port {port}"
            owners[port] = f"{path.name} {node.name}"


def test_wan_sim_spec_delays_every_hop() -> None:
    """specs/wan-sim.toml uses ports 7710-7713 and 25 ms on each of the 4 ring hops."""
    spec = load_spec(SPECS / "wan-sim.toml")
    assert [spec.node(n).listen.port for n in spec.ring()[:-1]] == [7710, 7711, 7712, 7713]
    assert [(h.src, h.dst, h.latency_ms) for h in spec.hops()] == [
        ("coord", "s0", 25.0),
        ("s0", "s1", 25.0),
        ("s1", "s2", 25.0),
        ("s2", "coord", 25.0),
    ]


# --- the records and their helpers ----------------------------------------------------------


def test_minimal_spec_gets_defaults() -> None:
    """Optional tables and keys take their documented defaults."""
    spec = _load(_data())
    assert spec.dtype == "float32"
    assert spec.limits == Limits()
    assert spec.default_latency_ms == 0.0
    assert spec.default_bandwidth_mbps == 0.0
    assert spec.edges == ()
    assert spec.path is None
    assert spec.coordinator == CoordinatorSpec("coord", Address("127.0.0.1", 7700))
    assert spec.stages[0] == StageSpec("s0", Address("127.0.0.1", 7701), None)


def test_timeouts_default_to_the_constants_they_replace() -> None:
    """The limits that used to be module constants keep their values as defaults; a node
    without a spec (a test, a bench) dials with the same handshake timeout as the spec's."""
    limits = Limits()
    assert (limits.handshake_timeout_s, limits.receipt_timeout_s) == (10.0, 10.0)
    assert limits.max_resyncs == 8
    assert limits.handshake_timeout_s == HANDSHAKE_TIMEOUT_S


def test_limits_read_every_key() -> None:
    """Each [limits] key lands in its field (integers accepted for seconds, as floats)."""
    given = {
        "max_sessions": 4,
        "max_len": 512,
        "prefill_chunk": 32,
        "max_message_mib": 16,
        "connect_timeout_s": 3,
        "verdict_timeout_s": 20.0,
        "retry_after_s": 5.0,
        "handshake_timeout_s": 2.5,
        "max_resyncs": 0,
        "receipt_timeout_s": 30,
        "idle_timeout_s": 60,
        "message_timeout_s": 7.5,
        "max_peer_connections": 8,
        "max_buffer_mib": 64,
        "max_connections": 32,
        "max_prompt_bytes": 4096,
        "max_batch_rows": 64,
        "gather_window_s": 0.002,
        "kv_budget_mib": 256,
        "reclaim_idle_s": 12,
    }
    limits = _load(_data(limits=given)).limits
    assert attrs.asdict(limits) == given
    assert isinstance(limits.receipt_timeout_s, float)


def test_coordinator_name_defaults_to_coord() -> None:
    """Without a name the coordinator is called "coord"."""
    spec = _load(_data(coordinator={"listen": "127.0.0.1:7700"}))
    assert spec.ring()[0] == spec.ring()[-1] == "coord"


def test_explicit_layers_are_returned_in_ring_order() -> None:
    """Explicit blocks that tile the model come back unchanged."""
    spec = _load(_data(stage=_stages([0, 4], [4, 5], [5, 30])))
    assert spec.blocks(30) == ((0, 4), (4, 5), (5, 30))


@given(n_stages=st.integers(1, 64), n_layers=st.integers(1, 200))
def test_even_split_tiles_with_remainder_first(n_stages: int, n_layers: int) -> None:
    """Auto blocks tile [0, n) contiguously; sizes differ by at most one, larger ones first."""
    if n_stages > n_layers:
        with pytest.raises(SpecError):
            even_split(SOURCE, n_stages, n_layers)
        return
    blocks = even_split(SOURCE, n_stages, n_layers)
    assert len(blocks) == n_stages
    assert blocks[0][0] == 0
    assert blocks[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [last - first for first, last in blocks]
    assert sizes == sorted(sizes, reverse=True)
    assert max(sizes) - min(sizes) <= 1


def test_auto_rejects_more_stages_than_layers() -> None:
    """Auto split with more stages than layers names the stage list."""
    with pytest.raises(SpecError) as info:
        _load(_data()).blocks(1)
    assert "2 stages but the model has 1 layers" in _check_error(info.value, "stage")


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:7700", "127.0.0.1", 7700),
        ("[::1]:7701", "::1", 7701),
        ("node-a.example.org:80", "node-a.example.org", 80),
        ("localhost:0", "localhost", 0),
    ],
)
def test_address_parses_and_round_trips(text: str, host: str, port: int) -> None:
    """IPv4, bracketed IPv6, host names and port 0 parse; str() gives the text back."""
    address = Address.parse(text)
    assert address == Address(host, port)
    assert str(address) == text


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1",
        ":7700",
        "::1:7700",
        "[::zz]:1",
        "host:http",
        "host:65536",
        "a_b:1",
        "1.2.3.999:1",
    ],
)
def test_bad_address_names_the_listen_key(text: str) -> None:
    """A malformed address is rejected under its own key, with an example of a good one."""
    data = _data()
    data["stage"][1]["listen"] = text
    assert "e.g. listen = " in _rejected(data, "stage[1].listen")


def test_edge_resolves_override_then_default() -> None:
    """edge() returns the per-hop override if any, else the [links] defaults."""
    links = {
        "latency_ms": 25,
        "bandwidth_mbps": 100.0,
        "edge": [{"from": "s0", "to": "s1", "latency_ms": 40.0}],
    }
    spec = _load(_data(links=links))
    assert spec.edge("s0", "s1") == EdgeSpec("s0", "s1", 40.0, 100.0)
    assert spec.edge("s1", "coord") == EdgeSpec("s1", "coord", 25.0, 100.0)
    assert [h.latency_ms for h in spec.hops()] == [25.0, 40.0, 25.0]


def test_edge_rejects_a_non_hop() -> None:
    """edge() on two nodes that are not consecutive in the ring raises SpecError."""
    with pytest.raises(SpecError, match="s1 -> s0 is not a hop"):
        _load(_data()).edge("s1", "s0")


def test_node_finds_stages_and_coordinator() -> None:
    """node() returns the named record and names the known nodes when it finds none."""
    spec = _load(_data())
    assert spec.node("coord") is spec.coordinator
    assert spec.node("s1") is spec.stages[1]
    with pytest.raises(SpecError) as info:
        spec.node("s9")
    assert "nodes: coord, s0, s1" in _check_error(info.value, "node")


def test_with_ports_replaces_only_named_ports() -> None:
    """with_ports() moves the named nodes' ports and leaves everything else alone."""
    data = _data()
    for node in [data["coordinator"], *data["stage"]]:
        node["listen"] = "127.0.0.1:0"
    spec = _load(data).with_ports({"coord": 4000, "s1": 4002})
    assert [spec.node(n).listen.port for n in ("coord", "s0", "s1")] == [4000, 0, 4002]
    assert spec.node("s1").listen.host == "127.0.0.1"
    with pytest.raises(SpecError):
        spec.with_ports({"nope": 1})
    with pytest.raises(SpecError):
        spec.with_ports({"s0": 70000})


def test_spec_error_pickles() -> None:
    """SpecError survives pickling, so a child process can report it to its parent."""
    error = SpecError("f.toml", "swarm.name", "bad")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == "f.toml: swarm.name: bad"
    assert again.key == "swarm.name"


# --- files -------------------------------------------------------------------------------------


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    """load_spec on a missing path raises SpecError naming the file."""
    path = tmp_path / "nope.toml"
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert str(info.value) == f"{path}: no such file"


def test_toml_syntax_error_gives_line_and_column(tmp_path: Path) -> None:
    """A TOML syntax error names the file, the line and the column."""
    path = _write(tmp_path, '[swarm]\nname = "x"\nmodel = \n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert text.startswith(f"{path}: invalid TOML: ")
    assert "line 3" in text
    assert "column" in text
    assert "\n" not in text


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    """Validation errors from a file start with the file's path, as given."""
    path = _write(tmp_path, '[swarm]\nname = "x"\nmodel = "smollm2"\ninsecure = true\n')
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: coordinator: missing required key")


def test_relative_model_path_resolves_against_spec_dir(tmp_path: Path) -> None:
    """A relative model path is resolved against the spec file's directory, not the cwd."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"")
    for model, expected in [("ckpt", tmp_path / "ckpt"), ("./m.gguf", tmp_path / "m.gguf")]:
        text = (SPECS / "local.toml").read_text().replace('"smollm2"', f'"{model}"')
        assert load_spec(_write(tmp_path, text)).model == str(expected.resolve())


def test_model_path_must_exist(tmp_path: Path) -> None:
    """A model path that does not exist is rejected, saying where it looked."""
    data = _data(swarm={"name": "t", "model": "missing-ckpt", "insecure": True})
    with pytest.raises(SpecError) as info:
        SwarmSpec.from_dict(data, source=SOURCE, base_dir=tmp_path)
    text = _check_error(info.value, "swarm.model")
    assert str(tmp_path / "missing-ckpt") in text
    assert "not found" in text


def test_model_file_must_be_gguf(tmp_path: Path) -> None:
    """A model path naming a file other than a .gguf is rejected."""
    (tmp_path / "weights.bin").write_bytes(b"")
    data = _data(swarm={"name": "t", "model": "weights.bin", "insecure": True})
    with pytest.raises(SpecError, match=r"is a file but not a \.gguf"):
        SwarmSpec.from_dict(data, source=SOURCE, base_dir=tmp_path)


# --- validation rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "typo", "key", "suggestion"),
    [
        (None, "stages", "stages", "stage"),
        ("swarm", "modle", "swarm.modle", "model"),
        ("limits", "max_lenght", "limits.max_lenght", "max_len"),
        ("coordinator", "listne", "coordinator.listne", "listen"),
        ("stage", "laters", "stage[0].laters", "layers"),
        ("links", "latency", "links.latency", "latency_ms"),
        ("edge", "form", "links.edge[0].form", "from"),
    ],
)
def test_unknown_key_is_named_with_suggestion(
    table: str | None, typo: str, key: str, suggestion: str
) -> None:
    """An unknown key at any level is named, with the closest known key suggested."""
    data = _data(links={"edge": [{"from": "coord", "to": "s0"}]}, limits={})
    target = {
        None: data,
        "swarm": data["swarm"],
        "limits": data["limits"],
        "coordinator": data["coordinator"],
        "stage": data["stage"][0],
        "links": data["links"],
        "edge": data["links"]["edge"][0],
    }[table]
    target[typo] = 1
    assert f"did you mean '{suggestion}'?" in _rejected(data, key)


@pytest.mark.parametrize(
    ("path", "key"),
    [
        (("swarm",), "swarm"),
        (("coordinator",), "coordinator"),
        (("swarm", "name"), "swarm.name"),
        (("swarm", "model"), "swarm.model"),
        (("coordinator", "listen"), "coordinator.listen"),
        (("stage", 0, "name"), "stage[0].name"),
        (("stage", 1, "listen"), "stage[1].listen"),
    ],
)
def test_missing_required_key(path: tuple[Any, ...], key: str) -> None:
    """A missing required key or table is named, with an example to add."""
    data = _data()
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    del parent[path[-1]]
    assert "missing required key; add " in _rejected(data, key)


@pytest.mark.parametrize(
    ("table", "name", "value", "key", "expected"),
    [
        ("stage", "layers", "x", "stage[0].layers", 'or "auto", got string'),
        ("stage", "layers", [0], "stage[0].layers", "got array"),
        ("stage", "layers", [0.0, 3], "stage[0].layers", "two integers"),
        ("stage", "listen", 7701, "stage[0].listen", "expected a string, got integer"),
        ("swarm", "insecure", 1, "swarm.insecure", "expected true or false, got integer"),
        ("swarm", "name", "", "swarm.name", "must not be empty"),
        ("limits", "max_len", "big", "limits.max_len", "expected an integer, got string"),
        ("limits", "max_sessions", True, "limits.max_sessions", "got boolean"),
        ("limits", "max_len", 0, "limits.max_len", "must be >= 1"),
        ("limits", "connect_timeout_s", 0, "limits.connect_timeout_s", "> 0"),
        ("limits", "handshake_timeout_s", 0, "limits.handshake_timeout_s", "> 0"),
        ("limits", "receipt_timeout_s", -1.0, "limits.receipt_timeout_s", "> 0"),
        ("limits", "max_resyncs", -1, "limits.max_resyncs", "must be >= 0"),
        ("limits", "max_resyncs", 2.5, "limits.max_resyncs", "expected an integer, got float"),
        ("limits", "idle_timeout_s", 0, "limits.idle_timeout_s", "> 0"),
        ("limits", "message_timeout_s", -1.0, "limits.message_timeout_s", "> 0"),
        ("limits", "max_peer_connections", 0, "limits.max_peer_connections", "must be >= 1"),
        ("limits", "max_peer_connections", 2.5, "limits.max_peer_connections", "got float"),
        ("links", "latency_ms", "25", "links.latency_ms", "expected a number, got string"),
        ("links", "edge", {"from": "s0"}, "links.edge", "array of tables"),
    ],
)
def test_wrong_type(table: str, name: str, value: Any, key: str, expected: str) -> None:
    """A value of the wrong type or range names its key, what was expected and what it got."""
    data = _data(limits={}, links={})
    (data[table][0] if table == "stage" else data[table])[name] = value
    assert expected in _rejected(data, key)


def test_section_of_wrong_type() -> None:
    """[[stage]] written as a single [stage] table is explained."""
    data = _data(stage={"name": "s0", "listen": "127.0.0.1:7701"})
    assert "expected an array of tables [[stage]], got table" in _rejected(data, "stage")


@pytest.mark.parametrize("stages", [None, []])
def test_empty_stage_list(stages: list[Any] | None) -> None:
    """A spec without stages is rejected, saying how to add one."""
    data = _data(stage=stages)
    if stages is None:
        del data["stage"]
    assert "no stages; add at least one [[stage]]" in _rejected(data, "stage")


def test_duplicate_stage_names() -> None:
    """Two stages with the same name are rejected at the second one."""
    data = _data()
    data["stage"][1]["name"] = "s0"
    assert "duplicate node name 's0' (also stage[0].name)" in _rejected(data, "stage[1].name")


def test_stage_named_like_coordinator() -> None:
    """A stage may not share the coordinator's name."""
    data = _data()
    data["stage"][0]["name"] = "coord"
    assert "(also coordinator.name)" in _rejected(data, "stage[0].name")


def test_invalid_node_name() -> None:
    """Node names are restricted to letters, digits, '_', '.', '-'."""
    data = _data()
    data["stage"][0]["name"] = "s 0"
    assert "not a valid name" in _rejected(data, "stage[0].name")


def test_duplicate_listen_address() -> None:
    """Two nodes listening on the same host and port are rejected."""
    data = _data()
    data["stage"][1]["listen"] = "127.0.0.1:7700"
    text = _rejected(data, "stage[1].listen")
    assert "duplicate listen address '127.0.0.1:7700' (also coordinator.listen)" in text


def test_port_zero_may_repeat() -> None:
    """Port 0 (ephemeral) on several nodes is not a duplicate."""
    data = _data()
    for node in [data["coordinator"], *data["stage"]]:
        node["listen"] = "127.0.0.1:0"
    assert _load(data).stages[1].listen == Address("127.0.0.1", 0)


def test_mixing_auto_and_explicit_layers() -> None:
    """Layers must be "auto" on every stage or explicit on every stage."""
    data = _data(stage=_stages("auto", [10, 30]))
    assert 'use "auto" on every stage' in _rejected(data, "stage[1].layers")


def test_omitted_layers_count_as_auto_when_mixing() -> None:
    """An omitted layers key means "auto", so it cannot be mixed with explicit blocks."""
    data = _data(stage=_stages([0, 10], "auto"))
    del data["stage"][1]["layers"]
    _rejected(data, "stage[1].layers")


def test_overlapping_blocks() -> None:
    """Overlapping blocks are rejected at load time, showing both blocks."""
    data = _data(stage=_stages([0, 10], [8, 20]))
    text = _rejected(data, "stage[1].layers")
    assert "overlaps stage[0] ([0, 10) and [8, 20)); blocks must tile [0, n_layers)" in text


def test_gap_between_blocks() -> None:
    """A gap between blocks is rejected, naming the unassigned layers."""
    data = _data(stage=_stages([0, 10], [12, 20]))
    assert "layers [10, 12) unassigned" in _rejected(data, "stage[1].layers")


def test_first_block_must_start_at_zero() -> None:
    """The first block starts at layer 0."""
    data = _data(stage=_stages([2, 10], [10, 20]))
    assert "starts at layer 2" in _rejected(data, "stage[0].layers")


@pytest.mark.parametrize("block", [[5, 5], [6, 5], [-1, 5]])
def test_empty_or_negative_block(block: list[int]) -> None:
    """A block with first >= last, or a negative first layer, is rejected."""
    data = _data(stage=_stages(block))
    assert "need 0 <= first < last" in _rejected(data, "stage[0].layers")


def test_blocks_out_of_range() -> None:
    """blocks() rejects a block past the model's last layer."""
    spec = _load(_data(stage=_stages([0, 20], [20, 32])))
    with pytest.raises(SpecError) as info:
        spec.blocks(30)
    assert "[20, 32) is out of range; the model has 30 layers" in _check_error(
        info.value, "stage[1].layers"
    )


def test_blocks_must_end_at_n_layers() -> None:
    """blocks() rejects a last block that stops short of the model's layer count."""
    spec = _load(_data(stage=_stages([0, 10], [10, 20])))
    with pytest.raises(SpecError) as info:
        spec.blocks(30)
    assert "last block ends at 20 but the model has 30 layers" in _check_error(
        info.value, "stage[1].layers"
    )


def test_blocks_rechecks_an_evolved_spec() -> None:
    """blocks() guards tiling itself, even for a spec changed after loading."""
    spec = _load(_data(stage=_stages([0, 10], [10, 30])))
    broken = attrs.evolve(
        spec, stages=(spec.stages[0], attrs.evolve(spec.stages[1], layers=(12, 30)))
    )
    with pytest.raises(SpecError) as info:
        broken.blocks(30)
    _check_error(info.value, "stage[1].layers")


@pytest.mark.parametrize(
    ("links", "key"),
    [
        ({"latency_ms": -1.0}, "links.latency_ms"),
        ({"latency_ms": float("nan")}, "links.latency_ms"),
        ({"bandwidth_mbps": -5}, "links.bandwidth_mbps"),
        ({"edge": [{"from": "coord", "to": "s0", "latency_ms": -0.5}]}, "links.edge[0].latency_ms"),
    ],
)
def test_negative_or_non_finite_latency(links: dict[str, Any], key: str) -> None:
    """Latency and bandwidth must be finite and non-negative, by default and per edge."""
    assert "must be a finite number >= 0" in _rejected(_data(links=links), key)


def test_bad_dtype() -> None:
    """An unknown dtype lists the supported ones."""
    data = _data()
    data["swarm"]["dtype"] = "fp32"
    text = _rejected(data, "swarm.dtype")
    assert "use one of float32, bfloat16, float16" in text


@pytest.mark.parametrize("insecure", [False, None])
def test_secure_mode_needs_a_trust_table(insecure: bool | None) -> None:
    """insecure = false (also the default) without [trust] names what a secure swarm needs."""
    data = _data()
    if insecure is None:
        del data["swarm"]["insecure"]
    else:
        data["swarm"]["insecure"] = insecure
    text = _rejected(data, "swarm.insecure")
    assert "needs a [trust] table" in text
    assert text.endswith("set insecure = true only for local development")


def test_edge_names_unknown_node() -> None:
    """An edge override naming an unknown node names it and suggests a close one."""
    links = {"edge": [{"from": "s0", "to": "s11"}]}
    text = _rejected(_data(links=links), "links.edge[0].to")
    assert "unknown node 's11'; did you mean 's1'?" in text


@pytest.mark.parametrize(("src", "dst"), [("s1", "s0"), ("coord", "s1"), ("s0", "coord")])
def test_edge_must_be_a_ring_hop(src: str, dst: str) -> None:
    """An edge override must name two consecutive nodes of the ring, in ring order."""
    links = {"edge": [{"from": src, "to": dst}]}
    text = _rejected(_data(links=links), "links.edge[0]")
    assert f"{src} -> {dst} is not a hop of the ring (coord -> s0 -> s1 -> coord)" in text


def test_edge_overridden_twice() -> None:
    """The same hop may be overridden only once."""
    edge = {"from": "s0", "to": "s1", "latency_ms": 1.0}
    text = _rejected(_data(links={"edge": [edge, edge]}), "links.edge[1]")
    assert "overridden twice" in text


def test_prefill_chunk_within_max_len() -> None:
    """prefill_chunk may not exceed max_len."""
    data = _data(limits={"max_len": 64, "prefill_chunk": 128})
    assert "exceeds max_len = 64" in _rejected(data, "limits.prefill_chunk")


def test_buffer_budget_holds_two_messages() -> None:
    """max_buffer_mib must hold two messages of max_message_mib (one read, one being read)."""
    data = _data(limits={"max_message_mib": 64, "max_buffer_mib": 100})
    assert "less than twice max_message_mib = 64" in _rejected(data, "limits.max_buffer_mib")


@pytest.mark.parametrize("key", ["max_prompt_bytes", "max_connections", "max_buffer_mib"])
def test_boundary_limits_are_positive(key: str) -> None:
    """The boundary limits are positive integers."""
    assert "must be >= 1, got 0" in _rejected(_data(limits={key: 0}), f"limits.{key}")


def test_docs_example_loads(tmp_path: Path) -> None:
    """The example in docs/specs.md is a valid spec (the docs cannot drift from the code)."""
    doc = (SPECS.parent / "docs" / "specs.md").read_text()
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "models" / "Llama-3.2-1B").mkdir(parents=True)
    (tmp_path / "specs").mkdir()
    spec = load_spec(_write(tmp_path / "specs", example))
    assert spec.model == str((tmp_path / "models" / "Llama-3.2-1B").resolve())
    assert spec.blocks(16) == ((0, 10), (10, 16))
    assert spec.node("b").listen == Address("fd00::3", 7702)
    assert [h.latency_ms for h in spec.hops()] == [25.0, 40.0, 25.0]
