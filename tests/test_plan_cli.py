"""``shard plan``, run in process through ``shard.cli.main``: the plan for the checked-in
geography, a spec without node profiles (what it assumed), JSON output, and one ``error:``
line (never a traceback) for every bad input. No model is loaded: a spec's model is read
from its ``config.json`` only (a directory holding nothing else)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from shard.cli import main

WORLD = Path(__file__).resolve().parents[1] / "specs" / "geography" / "world.toml"

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 300,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}


def one_error(capsys: pytest.CaptureFixture[str], prefix: str = "shard: error: ") -> str:
    """The one line on stderr (asserted to be the only one and to start with ``prefix``)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    """A 3-stage spec (one standby) over a config-only model dir, 10 ms per hop, s1 -> s2 30."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    path = tmp_path / "swarm.toml"
    path.write_text(
        f"""
[swarm]
name = "t"
model = "{model}"
insecure = true
[coordinator]
listen = "127.0.0.1:7900"
[[stage]]
name = "s0"
listen = "127.0.0.1:7901"
layers = "auto"
[[stage]]
name = "s1"
listen = "127.0.0.1:7902"
layers = "auto"
[[stage]]
name = "s2"
listen = "127.0.0.1:7903"
layers = "auto"
[[standby]]
name = "spare"
listen = "127.0.0.1:7904"
[links]
latency_ms = 10.0
[[links.edge]]
from = "s1"
to = "s2"
latency_ms = 30.0
"""
    )
    return path


def test_plan_of_the_world_prints_ring_blocks_coordinator_and_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard plan --rtt world.toml` prints the European ring, its blocks, the coordinator in
    Frankfurt, the standbys, the predicted lap and the alternatives that lost."""
    assert main(["plan", "--rtt", str(WORLD)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ring:        coord-fra -> ")
    assert "coordinator: coord-fra" in out
    assert "layers [0, " in out and ", 64)" in out
    assert "standbys:" in out and "tyo-1 (ap-northeast)" in out
    assert "predicted lap:" in out and "slowest stage:" in out
    assert "alternatives that lost:" in out
    assert "even split in file order (12 stages, coordinator at coord-fra):" in out
    assert "coordinator at coord-iad:" in out


def test_plan_json_and_a_forced_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object; --coordinator forces the place, and the lap is worse."""
    assert main(["plan", "--rtt", str(WORLD), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["ring"][0] == best["ring"][-1] == "coord-fra"
    assert best["stages"][0]["first"] == 0 and best["stages"][-1]["last"] == 64
    assert {a["label"] for a in best["alternatives"]} >= {"coordinator at coord-tyo"}
    assert main(["plan", "--rtt", str(WORLD), "--json", "--coordinator", "coord-tyo"]) == 0
    forced = json.loads(capsys.readouterr().out)
    assert forced["coordinator"] == "coord-tyo"
    assert forced["lap_ms"] > best["lap_ms"]


def test_plan_of_a_spec_says_what_it_assumed(
    spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spec without profiles plans with equal speeds and its [links] latencies, keeps its
    three stages, and says so; the slow s1 -> s2 hop is avoided, and the last line is the
    layout `swarm up` runs: the plan's."""
    assert main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "assumed: s0, s1, s2, spare: 1.0 ms per layer (equal speeds)" in out
    assert "assumed: no node is profiled: the ring keeps the spec's 3 stages" in out
    assert "assumed: latencies from the spec's [links]" in out
    ring = out.splitlines()[0]
    assert "s1 -> s2" not in ring
    assert ring.count("->") == 4
    assert "auto split in file order (3 stages, coordinator at coord): 66.0 ms" in out
    assert "best ring of 4 stages (not taken: the ring keeps 3)" in out
    assert out.splitlines()[-1].startswith("swarm up:    --layout s0=0:2,s2=2:4,s1=4:6 ")


def test_plan_of_a_spec_with_a_geography(
    spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Profiles from a JSON geography replace the assumptions for the nodes they name."""
    names = ["coord", "s0", "s1", "s2", "spare"]
    geo = {
        "node": [
            {"name": "spare", "memory_gib": 1, "ms_per_layer_1": 0.1, "ms_per_layer_k": 0.1},
        ],
        "rtt": {"nodes": names, "ms": [[0 if a == b else 4 for b in names] for a in names]},
    }
    path = tmp_path / "geo.json"
    path.write_text(json.dumps(geo))
    assert main(["plan", str(spec), "--rtt", str(path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [s["node"] for s in found["stages"]] == ["spare"]  # fast and big enough
    assert any("s0, s1, s2: 1.0 ms per layer" in line for line in found["assumed"])


def test_rtt_file_missing_spec_nodes_is_one_line(
    spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A geography that lacks nodes of the spec names them."""
    path = tmp_path / "geo.toml"
    path.write_text('[rtt]\nnodes = ["coord", "s0"]\nms = [[0, 1], [1, 0]]\n')
    assert main(["plan", str(spec), "--rtt", str(path)]) == 1
    line = one_error(capsys)
    assert "rtt.nodes has no s1, s2, spare" in line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[rtt]\nnodes = ["a"]\nms = [[-3]]\n', "rtt.ms[0][0]: is negative"),
        ('[rtt]\nnodes = ["a", "b"]\nms = [[0, 1], [1]]\n', "rtt.ms[1]: not a matrix"),
        ('[rtt]\nnodes = ["a", "b"]\nms = "wide"\n', "rtt.ms: not a matrix"),
        ("[rtt\n", "invalid TOML"),
        ('coordinators = ["a"]\n', "rtt: missing"),
    ],
)
def test_bad_rtt_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    """Negative values, a ragged or non-list matrix, bad TOML, no matrix: one error line."""
    path = tmp_path / "geo.toml"
    path.write_text(text)
    assert main(["plan", "--rtt", str(path)]) == 1
    assert message in one_error(capsys)


def test_missing_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No file, neither SPEC nor --rtt, a geography without nodes, an unknown place."""
    assert main(["plan", "--rtt", str(tmp_path / "nope.toml")]) == 1
    assert "no such file" in one_error(capsys)
    assert main(["plan"]) == 2
    assert "give a SPEC, an --rtt geography, or both" in one_error(capsys, "shard plan: error: ")
    path = tmp_path / "geo.toml"
    path.write_text('[rtt]\nnodes = ["a"]\nms = [[0]]\n')
    assert main(["plan", "--rtt", str(path)]) == 1
    assert "no [[node]] tables" in one_error(capsys)
    assert main(["plan", "--rtt", str(WORLD), "--coordinator", "mars"]) == 1
    assert "--coordinator mars: not a place" in one_error(capsys)


def test_pinning_a_spec_without_trusted_nodes_says_what_to_do(
    spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--pin-boundaries with no trusted node fails with the fix, in one line."""
    assert main(["plan", str(spec), "--pin-boundaries"]) == 1
    assert "mark nodes trusted or unpin" in one_error(capsys)


def test_plan_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    """`shard plan --help` says what is optimised and what the flags are."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("predicted lap", "Held-Karp", "--rtt FILE", "--json", "--pin-boundaries"):
        assert words in out


MODELS = Path(__file__).resolve().parents[1] / "specs" / "models"
NO_FIT = 3  # plan --config's exit code when the cards do not hold the model


@pytest.mark.parametrize(
    ("model", "weights", "fits"),
    [
        ("qwen3-30b-a3b", "bfloat16", True),
        ("qwen3-30b-a3b", "int4", True),
        ("glm-4.5-air", "bfloat16", False),
        ("glm-4.5-air", "int4", True),
        ("gpt-oss-120b", "int4", True),
        ("gpt-oss-120b", "int8", False),
        ("deepseek-v3", "int4", False),
        ("deepseek-v3", "fp8", False),
        ("kimi-k2", "fp8", False),
        ("minimax-m2", "fp8", False),
        ("minimax-m2", "int4", False),
        ("glm-5", "int4", False),
        ("deepseek-v4-flash", "fp8", False),
    ],
)
def test_config_alone_gives_stage_bytes_and_a_verdict(
    capsys: pytest.CaptureFixture[str], model: str, weights: str, fits: bool
) -> None:
    """``plan --config`` on a checked-in config prints each of 3 stages' bytes on 24 GiB
    cards and a verdict; the stages tile every layer, the verdict follows the bytes, and the
    exit code says it too (0 fits, 3 does not)."""
    config = MODELS / model / "config.json"
    code = 0 if fits else NO_FIT
    assert main(["plan", "--config", str(config), "--weights", weights, "--json"]) == code
    report = json.loads(capsys.readouterr().out)
    stages = report["stages"]
    assert stages[0]["layers"][0] == 0
    assert stages[-1]["layers"][1] == json.loads(config.read_text())["num_hidden_layers"]
    assert all(a["layers"][1] == b["layers"][0] for a, b in itertools.pairwise(stages))
    assert report["fits"] is fits
    assert all(s["fits"] == (s["bytes"] <= 24 << 30) for s in stages)
    if not fits:
        assert report["fewest_cards"] is None or report["fewest_cards"] > 3
    assert main(["plan", "--config", str(config), "--weights", weights]) == code
    text = capsys.readouterr().out
    assert text.count("stage ") == 3
    dense = weights in ("float32", "bfloat16", "float16")
    assert ("dense parts" in text.splitlines()[0]) is not dense  # a dense format is its dtype
    assert ("verdict: fits" if fits else "verdict: does not fit") in text


def test_config_plan_prices_gpt_oss_experts_quantized(capsys: pytest.CaptureFixture[str]) -> None:
    """gpt-oss's fused experts are priced quantized under int4 (5 bits a parameter with the
    kernel's bf16 scales and zeros), so no note says a large part stays dense."""
    config = MODELS / "gpt-oss-120b" / "config.json"
    assert main(["plan", "--config", str(config), "--weights", "int4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unquantized_bytes"] < report["total_bytes"] // 100  # routers, biases
    assert report["total_bytes"] < 117e9 * 0.65  # 116.8 B parameters at ~5 bits
    assert main(["plan", "--config", str(config), "--weights", "int4"]) == 0
    assert "stays bfloat16" not in capsys.readouterr().out


def test_config_plan_refuses_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Not a config, a config beside a SPEC, more stages than layers: one error line each."""
    assert main(["plan", "--config", str(tmp_path / "x.toml")]) == 2
    assert "give a config.json" in one_error(capsys, "shard plan: error: ")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert main(["plan", "--config", str(tmp_path), "--stages", "7"]) == 2
    assert "6 layers" in one_error(capsys, "shard plan: error: ")


def test_a_family_not_run_yet_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A config of a family shard does not run (Kimi Linear's ``kimi_linear``, its KDA layers;
    docs/model.md "Not yet"): one line naming the type."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"model_type": "kimi_linear"}))
    assert main(["plan", "--config", str(tmp_path), "--weights", "int4"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unsupported architecture 'kimi_linear'" in err


def test_a_linear_attention_model_plans_its_state_per_session(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Qwen3-Next-80B-A3B in int4 on four 24 GiB cards: each stage of 12 layers caches KV
    for its 3 gated attention layers only (3 x 2 x 2 x 256 numbers a token, bf16) and holds
    a fixed state per session for its 9 DeltaNet layers, which the verdict names."""
    config = str(MODELS / "qwen3-next-80b-a3b")
    args = ["plan", "--config", config, "--weights", "int4", "--stages", "4", "--memory", "24"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and [s["layers"] for s in report["stages"]][1] == [12, 24]
    for stage in report["stages"]:
        assert stage["kv_bytes_per_token"] == 3 * 2 * 2 * 256 * 2
        assert stage["state_bytes_per_session"] > 9 * 32 * 128 * 128 * 4  # the live states
    assert main(args) == 0
    assert "a session for its linear-attention state" in capsys.readouterr().out


def test_fp8_prices_a_published_fp8_checkpoint_at_a_byte_a_weight(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--weights fp8`` on DeepSeek-V3's published config: between int8's and bf16's bytes
    (one byte a weight plus block scales, embedding/head/kv_b_proj/routers bf16); refused for a
    config that is not FP8."""
    totals = {}
    for weights in ("fp8", "int8", "bfloat16"):
        config = str(MODELS / "deepseek-v3")
        assert main(["plan", "--config", config, "--weights", weights, "--json"]) == NO_FIT
        totals[weights] = json.loads(capsys.readouterr().out)["total_bytes"]
    assert totals["int8"] < totals["fp8"] < 0.55 * totals["bfloat16"]
    assert main(["plan", "--config", str(MODELS / "glm-4.5-air"), "--weights", "fp8"]) == 1
    assert "quantization_config is FP8" in capsys.readouterr().err


def test_plan_of_a_spec_shows_each_stage_s_bytes(
    spec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan SPEC` splits by bytes, so it prints them: each stage's weights as it holds
    them, the embedding on the first and the head (a copy of the tied table, and the final
    norm) on the last, counted here by hand from the config (float32, the spec's default)."""
    h, kv, ffn, vocab = 64, 2 * 16, 128, 300
    layer = 4 * (h * h + 2 * h * kv + h * h + 3 * h * ffn + 2 * h)
    embedding, head = 4 * vocab * h, 4 * vocab * h + 4 * h
    assert main(["plan", str(spec), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    want = [layer * (s["last"] - s["first"]) for s in stages]
    want[0] += embedding
    want[-1] += head
    assert [s["weight_bytes"] for s in stages] == want
    assert main(["plan", str(spec)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "layers [" in line]
    assert [row.split()[-4:-2] for row in rows] == [[f"{b / 2**20:.1f}", "MiB"] for b in want]
