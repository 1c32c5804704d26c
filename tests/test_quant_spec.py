"""The ``weights`` option: spec key per swarm and per node, one-line refusals, the CLI flags."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shard.cli import main
from shard.coordinator.service import prompt_ids
from shard.decode.reference import generate_reference
from shard.model.loader import load_stage
from shard.model.weights import WEIGHTS as MODEL_WEIGHTS
from shard.spec.device import WEIGHTS
from shard.spec.swarm import SpecError, SwarmSpec

BASE: dict[str, Any] = {
    "swarm": {"name": "x", "model": "smollm2", "insecure": True},
    "coordinator": {"listen": "127.0.0.1:0"},
    "stage": [
        {"name": "s0", "listen": "127.0.0.1:0"},
        {"name": "s1", "listen": "127.0.0.1:0"},
    ],
}


def _spec(swarm: dict[str, Any] | None = None, s1: dict[str, Any] | None = None) -> SwarmSpec:
    data = copy.deepcopy(BASE)
    data["swarm"].update(swarm or {})
    data["stage"][1].update(s1 or {})
    return SwarmSpec.from_dict(data, source="x.toml")


def test_spec_and_model_name_the_same_weights() -> None:
    """The spec (no torch) and the loader spell the same weights values."""
    assert tuple(WEIGHTS) == tuple(MODEL_WEIGHTS)


def test_swarm_weights_with_a_node_override() -> None:
    """[swarm] weights applies to every node; a node's own weights overrides it; unset: None."""
    assert _spec().runtime("s0").weights is None
    spec = _spec({"weights": "stored"}, {"weights": "int8"})
    assert spec.runtime("s0").weights == "stored"
    assert spec.runtime("s1").weights == "int8"
    assert spec.with_runtime("s0", weights="int4").runtime("s0").weights == "int4"


@pytest.mark.parametrize(
    ("swarm", "s1", "match"),
    [
        ({"weights": "int3"}, None, r"swarm\.weights.*unknown weights 'int3'"),
        (
            {"weights": "bfloat16"},
            None,
            r"swarm\.weights.*'bfloat16' contradicts dtype = 'float32'",
        ),
        ({"dtype": "bfloat16"}, {"weights": "float32"}, r"stage\[1\]\.weights.*contradicts"),
    ],
)
def test_bad_or_contradictory_weights_are_one_line_errors(
    swarm: dict[str, Any], s1: dict[str, Any] | None, match: str
) -> None:
    """An unknown weights value, or a float one other than the node's dtype, is refused, at
    the key that made the clash (``[swarm]``'s when the node inherits both)."""
    with pytest.raises(SpecError, match=match) as info:
        _spec(swarm, s1)
    assert "\n" not in str(info.value)


def test_matching_float_weights_and_quantized_with_any_dtype_are_accepted() -> None:
    """weights equal to dtype, or stored/int8/int4 with any dtype, are accepted."""
    assert _spec({"dtype": "bfloat16", "weights": "bfloat16"}).runtime("s1").dtype == "bfloat16"
    assert _spec({"dtype": "bfloat16", "weights": "int4"}).runtime("s1").weights == "int4"


def test_generate_local_weights_flag(
    tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard generate --local --weights int8` runs the model quantized at load (its output
    is the int8 model's), and --weights with --spec is refused."""
    model_dir = tiny_checkpoint(seed=3, n_layers=2)
    argv = ["generate", "--local", "--json", "--model", str(model_dir), "--ignore-eos"]
    assert main([*argv, "--max-tokens", "8", "--weights", "int8", "hello"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    model = load_stage(model_dir, 0, 2, weights="int8")
    from shard.messages import GenerateRequest
    from shard.model.tokenizer import Tokenizer

    ids = prompt_ids(Tokenizer.from_dir(model_dir), GenerateRequest(1, "hello", 8))
    want = generate_reference(model, ids, max_tokens=8, eos_ids=(), max_len=512).token_ids
    assert tuple(got) == want
    assert main(["generate", "--spec", "x.toml", "--weights", "int8", "hi"]) == 2
    assert "--weights applies only with --local" in capsys.readouterr().err


def test_plan_prints_the_weights_the_checkpoint_defaults_to(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard plan SPEC` prints the weights its nodes will hold, beside dtype: stored for a
    checkpoint with quantized tensors, dense for a float one, the spec's own when it says."""
    from fixtures_smollm2 import write_tiny_gguf
    from shard.convert.gguf_import import convert_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    stored = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "stored", progress=False)
    dense = tiny_checkpoint(seed=3, n_layers=2)
    cases = (
        (stored, "", "weights:     stored (the checkpoint's default: its quantized tensors"),
        (dense, "", "weights:     float32 (the checkpoint's default: dense in dtype)"),
        (stored, 'weights = "float32"\n', "weights:     float32 ([swarm] weights)"),
    )
    for model, extra, want in cases:
        spec = tmp_path / "spec.toml"
        spec.write_text(
            f'[swarm]\nname = "x"\nmodel = {json.dumps(str(model))}\ninsecure = true\n{extra}'
            '[coordinator]\nlisten = "127.0.0.1:7000"\n'
            '[[stage]]\nname = "s0"\nlisten = "127.0.0.1:7001"\n'
        )
        assert main(["plan", str(spec)]) == 0
        assert want in capsys.readouterr().out
