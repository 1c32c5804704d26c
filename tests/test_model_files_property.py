"""Any mutation of a valid model file ends in a typed refusal or a correct read, never another
exception (property tests, seeded: ``derandomize=True``): config.json fields, safetensors
bytes and header fields, index entries, quantization tables."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tests.test_model_config import LLAMA_32_1B, QWEN2_05B
from tests.test_model_files_hostile import GEMMA3, MIXTRAL

from shard.model.config import ModelConfig, ModelLoadError
from shard.model.config_fields import MAX
from shard.model.loader import checkpoint_index
from shard.model.safetensors_header import SafetensorsError, quant_entries, read_header
from shard.model.tensorfile import open_tensors

SEEDED = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 2, 3, 7, 64, 2**31, 2**40]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=10**6), max_size=4),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
    st.sampled_from(["llama3", "yarn", "linear", "default", "sliding_attention"]),
)
BASES = [LLAMA_32_1B, QWEN2_05B, GEMMA3, MIXTRAL]
KEYS = sorted({k for base in BASES for k in base} | {"head_dim", "rope_parameters", "layer_types"})


def _refused(e: Exception) -> None:
    """A refusal is one line."""
    assert "\n" not in str(e)


@SEEDED
@given(
    base=st.sampled_from(BASES),
    changes=st.lists(st.tuples(st.sampled_from(KEYS), HOSTILE), min_size=1, max_size=3),
)
def test_any_config_mutation_is_refused_or_sane(
    base: dict[str, Any], changes: list[tuple[str, Any]]
) -> None:
    """A mutated config.json gives a ModelLoadError or a config within every bound."""
    d = {**base, **dict(changes)}
    try:
        c = ModelConfig.from_hf(d)
    except ModelLoadError as e:
        _refused(e)
        return
    assert 0 < c.n_layers <= MAX["layers"] and 0 < c.vocab_size <= MAX["vocab"]
    assert c.n_heads % c.n_kv_heads == 0 and c.head_dim % 2 == 0
    assert math.isfinite(c.rms_norm_eps) and c.rms_norm_eps > 0
    assert math.isfinite(c.rope_theta) and c.rope_theta > 0
    assert c.max_position_embeddings <= MAX["positions"]
    assert all(0 <= i < c.vocab_size for i in c.eos_token_ids)


#: The published configs of the frontier families (specs/models): MLA, DSA, MiniMax-M2,
#: Gated DeltaNet and DeepSeek-V4's fields, mutated as the Llama-family bases are.
FRONTIER = [
    json.loads((Path(__file__).resolve().parents[1] / "specs" / "models" / name /
                "config.json").read_text())
    for name in ("deepseek-v3", "glm-5", "minimax-m2", "qwen3-next-80b-a3b", "deepseek-v4-flash")
]  # fmt: skip
FRONTIER_KEYS = sorted({k for base in FRONTIER for k in base})


@SEEDED
@given(
    base=st.sampled_from(FRONTIER),
    changes=st.lists(st.tuples(st.sampled_from(FRONTIER_KEYS), HOSTILE), min_size=1, max_size=3),
)
def test_any_frontier_config_mutation_is_refused_or_sane(
    base: dict[str, Any], changes: list[tuple[str, Any]]
) -> None:
    """A mutated frontier config.json (its family's own fields too) gives a one-line
    ModelLoadError or a config within every bound, never another exception."""
    test_any_config_mutation_is_refused_or_sane.hypothesis.inner_test(base, changes)  # type: ignore[attr-defined]


def _valid_file(tmp_path: Path) -> bytes:
    path = tmp_path / "v.safetensors"
    save_file(
        {
            "a": torch.arange(6, dtype=torch.float32).view(2, 3),
            "b": torch.ones(4, dtype=torch.int8),
        },
        path,
    )
    return path.read_bytes()


@SEEDED
@given(
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=400), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=400)),
)
def test_any_byte_mutation_of_a_safetensors_file_is_refused_or_read(
    tmp_path: Path, edits: list[tuple[int, int]], cut: int | None
) -> None:
    """Flipped bytes or a cut anywhere: SafetensorsError, or every tensor reads in bounds."""
    data = bytearray(_valid_file(tmp_path))
    for at, byte in edits:
        if at < len(data):
            data[at] = byte
    path = tmp_path / "m.safetensors"
    path.write_bytes(bytes(data[:cut] if cut is not None else data))
    try:
        header = read_header(path)
    except SafetensorsError as e:
        _refused(e)
        return
    with open_tensors(path) as f:
        for name, entry in header.entries.items():
            assert header.base <= entry.start <= entry.stop <= header.size
            assert f.get_tensor(name).numel() == math.prod(entry.shape)


@SEEDED
@given(
    name=st.sampled_from(["a", "b"]),
    key=st.sampled_from(["dtype", "shape", "data_offsets"]),
    value=HOSTILE,
)
def test_any_header_field_mutation_is_refused_or_read(
    tmp_path: Path, name: str, key: str, value: Any
) -> None:
    """A header field replaced by any JSON value: SafetensorsError or a consistent read."""
    data = _valid_file(tmp_path)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[name][key] = value
    try:
        blob = json.dumps(header, allow_nan=True).encode()
    except ValueError:
        return
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])
    try:
        got = read_header(path)
    except SafetensorsError:
        return
    with open_tensors(path) as f:
        for entry_name in got.entries:
            f.get_tensor(entry_name)


@SEEDED
@given(meta=st.dictionaries(st.sampled_from(["kind", "group", "shape"]), HOSTILE, max_size=3))
def test_any_quantization_table_is_refused_or_consistent(
    tmp_path: Path, meta: dict[str, Any]
) -> None:
    """A ``shard.quant`` entry of any shape: SafetensorsError or one that fits its tensors."""
    path = tmp_path / "q.safetensors"
    tensors = {"w": torch.zeros(4, 32, dtype=torch.uint8), "w.scale": torch.ones(4, 2)}
    try:
        table = json.dumps({"w": {"kind": "int4", "group": 32, "shape": [4, 64], **meta}})
    except ValueError:
        return
    save_file(tensors, path, metadata={"shard.quant": table})
    try:
        q = quant_entries(read_header(path))["w"]
    except SafetensorsError:
        return
    assert q.shape[1] % q.group == 0 and q.group > 0


@settings(max_examples=60, derandomize=True, deadline=None)
@given(target=st.one_of(st.text(max_size=20), st.sampled_from(["..", ".", "/", "a/../b", "x\0"])))
def test_any_index_entry_is_refused_or_inside_the_folder(target: str) -> None:
    """An index naming any string: ModelLoadError, or a regular file in the model's folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_file({"a": torch.ones(2)}, model / "s.safetensors")
        body = {"weight_map": {"a": "s.safetensors", "b": target}}
        (model / "model.safetensors.index.json").write_text(json.dumps(body))
        try:
            files = checkpoint_index(model)
        except ModelLoadError as e:
            _refused(e)
            return
        for file in files.values():
            assert (model / file).resolve().parent == model.resolve()
            assert (model / file).is_file()
