"""Model files are input from strangers: a hostile config.json, safetensors header, index or
quantization table is refused in one line naming the file and the field, in bounded time and
memory, by the loader and by ``shard plan``'s footprint alike."""

from __future__ import annotations

import json
import math
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tests.test_model_config import LLAMA_32_1B

from shard.model.config import ModelConfig, ModelLoadError
from shard.model.footprint import FootprintError, stored
from shard.model.loader import checkpoint_index, load_stage
from shard.model.safetensors_header import SafetensorsError, quant_entries, read_header
from shard.testing.checkpoints import make_tiny_checkpoint

GEMMA3: dict[str, Any] = {
    **LLAMA_32_1B,
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "rope_scaling": None,
}
MIXTRAL: dict[str, Any] = {
    **LLAMA_32_1B,
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rope_scaling": None,
}


@contextmanager
def bounded(seconds: float = 2.0, megabytes: float = 64.0) -> Iterator[None]:
    """The block runs in under ``seconds`` and allocates under ``megabytes`` (Python heap)."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - start < seconds
    assert peak < megabytes * 2**20


def one_line(err: BaseException, *names: str) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 400, text
    for name in names:
        assert name in text, (name, text)
    return text


@pytest.mark.parametrize(
    ("base", "change", "field"),
    [
        (LLAMA_32_1B, {"num_hidden_layers": "16"}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": 10**6}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": 2**40}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": math.nan}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": [16]}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": 0}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": True}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_hidden_layers": 2.5}, "num_hidden_layers"),
        (LLAMA_32_1B, {"num_attention_heads": 30, "head_dim": None}, "num_attention_heads"),
        (LLAMA_32_1B, {"num_attention_heads": "32"}, "num_attention_heads"),
        (LLAMA_32_1B, {"num_key_value_heads": 64}, "num_key_value_heads"),
        (LLAMA_32_1B, {"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
        (LLAMA_32_1B, {"rms_norm_eps": math.nan}, "rms_norm_eps"),
        (LLAMA_32_1B, {"rms_norm_eps": 0}, "rms_norm_eps"),
        (LLAMA_32_1B, {"rope_theta": 0}, "rope_theta"),
        (LLAMA_32_1B, {"rope_theta": math.inf}, "rope_theta"),
        (LLAMA_32_1B, {"rope_scaling": [1, 2]}, "rope_scaling"),
        (LLAMA_32_1B, {"rope_scaling": {"rope_type": "llama3", "factor": 0}}, "factor"),
        (LLAMA_32_1B, {"vocab_size": math.inf}, "vocab_size"),
        (LLAMA_32_1B, {"vocab_size": 2**40}, "vocab_size"),
        (LLAMA_32_1B, {"max_position_embeddings": 2**30}, "max_position_embeddings"),
        (LLAMA_32_1B, {"bos_token_id": -1}, "bos_token_id"),
        (LLAMA_32_1B, {"bos_token_id": 128256}, "bos_token_id"),
        (LLAMA_32_1B, {"eos_token_id": [1, 2**40]}, "eos_token_id"),
        (LLAMA_32_1B, {"eos_token_id": list(range(100))}, "eos_token_id"),
        (LLAMA_32_1B, {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        (LLAMA_32_1B, {"model_type": "llama_evil"}, "llama_evil"),
        (LLAMA_32_1B, {"model_type": 7}, "model_type"),
        (GEMMA3, {"sliding_window_pattern": 0}, "sliding_window_pattern"),
        (GEMMA3, {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        (GEMMA3, {"sliding_window": -4}, "sliding_window"),
        (MIXTRAL, {"num_local_experts": 2**40}, "num_local_experts"),
        (MIXTRAL, {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        (MIXTRAL, {"num_experts_per_tok": "2"}, "num_experts_per_tok"),
    ],
)
def test_a_hostile_config_field_is_refused_in_one_line(
    base: dict[str, Any], change: dict[str, Any], field: str
) -> None:
    """Each kind of bad field (type, NaN, zero, huge, out of the vocabulary) is one line."""
    ModelConfig.from_hf(base)  # the base is valid
    with bounded(), pytest.raises(ModelLoadError) as err:
        ModelConfig.from_hf({**base, **change})
    one_line(err.value, field, "config.json")


def test_an_unknown_model_type_is_not_taken_as_llama() -> None:
    """A model_type shard does not know is refused even beside LlamaForCausalLM."""
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        ModelConfig.from_hf({**LLAMA_32_1B, "model_type": "falcon"})


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 100_000 + "1" + "}" * 100_000,
        '{"a":' * 70 + "1" + "}" * 70,
        '{"vocab_size": NaN}',
        "not json",
        "[1, 2]",
        "\xff\xfe",
    ],
)
def test_a_hostile_config_file_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    """Deep nesting, NaN, not JSON, not an object: one line naming config.json."""
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with bounded(), pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dir(tmp_path)
    one_line(err.value, "config.json")


def test_a_huge_config_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A config.json of gigabytes (sparse here) is refused by its size alone."""
    with (tmp_path / "config.json").open("wb") as f:
        f.truncate(4 << 30)
    with bounded(), pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dir(tmp_path)
    one_line(err.value, "config.json", "bytes")


# --- safetensors headers ----------------------------------------------------------------------


def _tensors(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4)}, path)
    return path


def _with_header(path: Path, edit: Callable[[dict[str, Any]], Any], tail: int = 0) -> Path:
    """``path`` rewritten with its header edited (data kept, ``tail`` bytes cut off)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header = edit(header) or header
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    out = path.with_name("bad.safetensors")
    body = data[8 + n :]
    out.write_bytes(struct.pack("<Q", len(blob)) + blob + body[: len(body) - tail])
    return out


def _set(name: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(h: dict[str, Any]) -> None:
        h[name][key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "tail", "words"),
    [
        (_set("a", "data_offsets", [0, 10**12]), 0, "data_offsets"),
        (_set("a", "data_offsets", [24, 0]), 0, "data_offsets"),
        (_set("a", "data_offsets", [-24, 0]), 0, "data_offsets"),
        (_set("a", "shape", [-2, -3]), 0, "shape"),
        (_set("a", "shape", [2, "3"]), 0, "shape"),
        (_set("a", "shape", [1] * 9), 0, "shape"),
        (_set("a", "dtype", "F128"), 0, "dtype"),
        (_set("a", "extra", 1), 0, "exactly"),
        (
            lambda h: h.update(c={"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}),
            0,
            "overlap",
        ),
        (lambda h: h.update(__metadata__={"x": 1}), 0, "__metadata__"),
        (lambda h: b"[" * 50_000 + b"]" * 50_000, 0, "nested"),
        (lambda h: b'"just a string"', 0, "object"),
        (lambda h: None, 8, "past the end"),
    ],
)
def test_a_hostile_safetensors_header_is_refused(
    tmp_path: Path, edit: Callable[[dict[str, Any]], Any], tail: int, words: str
) -> None:
    """Offsets past the end, reversed or overlapping, impossible shapes, unknown dtypes, deep
    nesting and a truncated file: one SafetensorsError naming the file."""
    bad = _with_header(_tensors(tmp_path), edit, tail)
    with bounded(), pytest.raises(SafetensorsError) as err:
        read_header(bad)
    one_line(err.value, str(bad), words)


def test_a_header_longer_than_its_file_is_refused(tmp_path: Path) -> None:
    """A declared header length of 2^60 in a small file is refused before any read."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with bounded(), pytest.raises(SafetensorsError) as err:
        read_header(path)
    one_line(err.value, "header of")


# --- indexes ----------------------------------------------------------------------------------


def _sharded(tmp_path: Path) -> Path:
    return make_tiny_checkpoint(tmp_path / "ckpt", n_layers=2, sharded=True)


def _write_index(model: Path, weight_map: Any) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("/proc/self/environ", "not a plain file name"),
        ("../ckpt/model-00001-of-00002.safetensors", "not a plain file name"),
        ("sub/model.safetensors", "not a plain file name"),
        ("/dev/zero", "not a plain file name"),
        ("missing.safetensors", "missing"),
        ("folder", "not a regular file"),
        ("fifo", "not a regular file"),
    ],
)
def test_an_index_names_only_files_in_the_model_folder(
    tmp_path: Path, target: str, words: str
) -> None:
    """Absolute paths, '..', folders, devices and missing shards are refused in one line, and
    the named file is never opened (its bytes never reach the message)."""
    model = _sharded(tmp_path)
    (model / "folder").mkdir()
    import os

    os.mkfifo(model / "fifo")  # opening it would block: it must not be opened
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    first = next(iter(index))
    _write_index(model, {**index, first: target})
    for check in (lambda: checkpoint_index(model), lambda: stored(_config(model), model)):
        with bounded(), pytest.raises((ModelLoadError, FootprintError)) as err:
            check()
        text = one_line(err.value, "model.safetensors.index.json", words)
        assert "PATH=" not in text


def _config(model: Path) -> ModelConfig:
    return ModelConfig.from_dir(model)


@pytest.mark.parametrize("weight_map", [["a", "b"], {"x": 7}, None])
def test_an_index_of_the_wrong_shape_is_refused(tmp_path: Path, weight_map: Any) -> None:
    """A weight_map that is a list, names a number or is missing: one line."""
    model = _sharded(tmp_path)
    _write_index(model, weight_map)
    with bounded(), pytest.raises(ModelLoadError) as err:
        checkpoint_index(model)
    one_line(err.value, "model.safetensors.index.json")


# --- quantization metadata --------------------------------------------------------------------


def _quantized(tmp_path: Path, meta: dict[str, Any]) -> Path:
    path = tmp_path / "q.safetensors"
    tensors = {
        "w": torch.zeros(4, 32, dtype=torch.uint8),
        "w.scale": torch.ones(4, 2),
        "w.offset": torch.zeros(4, 2),
    }
    save_file(tensors, path, metadata={"shard.quant": json.dumps({"w": meta})})
    return path


@pytest.mark.parametrize(
    ("meta", "words"),
    [
        ({"kind": "int4", "group": 0, "shape": [4, 64]}, "group"),
        ({"kind": "int4", "group": 7, "shape": [4, 64]}, "group"),
        ({"kind": "int4", "group": -32, "shape": [4, 64]}, "group"),
        ({"kind": "int4", "group": "32", "shape": [4, 64]}, "group"),
        ({"kind": "int3", "group": 32, "shape": [4, 64]}, "kind"),
        ({"kind": "int4", "group": 32, "shape": [4, 128]}, "codes"),
        ({"kind": "int4", "group": 16, "shape": [4, 64]}, ".scale"),
        ({"kind": "int4", "group": 32, "shape": "4x64"}, "shape"),
    ],
)
def test_hostile_quantization_metadata_is_refused(
    tmp_path: Path, meta: dict[str, Any], words: str
) -> None:
    """Groups of 0, 7 or below zero, unknown kinds and shapes that disagree with the codes."""
    ok = _quantized(tmp_path, {"kind": "int4", "group": 32, "shape": [4, 64]})
    assert quant_entries(read_header(ok))["w"].group == 32
    bad = _quantized(tmp_path, meta)
    with bounded(), pytest.raises(SafetensorsError) as err:
        quant_entries(read_header(bad))
    one_line(err.value, "shard.quant", words)


def test_the_loader_refuses_a_hostile_checkpoint_in_one_line(tmp_path: Path) -> None:
    """A tiny checkpoint whose weights file lies about an offset: load_stage says so in one
    line naming the file (ModelLoadError), and plan's footprint too (FootprintError)."""
    model = make_tiny_checkpoint(tmp_path / "ckpt", n_layers=2)
    weights = model / "model.safetensors"

    def lie(h: dict[str, Any]) -> None:
        name = next(k for k in h if k != "__metadata__")
        start, stop = h[name]["data_offsets"]
        h[name]["data_offsets"] = [start + 4, stop + 4]

    bad = _with_header(weights, lie)
    bad.replace(weights)
    config = ModelConfig.from_dir(model)
    with pytest.raises(ModelLoadError) as err:
        load_stage(model, 0, 2)
    one_line(err.value, "model.safetensors")
    with pytest.raises(FootprintError) as err2:
        stored(config, model)
    one_line(err2.value, "model.safetensors")


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """A tensor named twice in a header (two byte ranges) or a config field given twice (two
    readings of one file) is one line, never the last value silently."""
    path = _tensors(tmp_path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n].decode()
    entry = json.dumps(json.loads(text)["b"])
    twice = text[:-1] + f',"b":{entry}}}'
    bad = tmp_path / "twice.safetensors"
    bad.write_bytes(struct.pack("<Q", len(twice)) + twice.encode() + data[8 + n :])
    with pytest.raises(SafetensorsError) as err:
        read_header(bad)
    one_line(err.value, "duplicate")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "model_type": "qwen2"}')
    with pytest.raises(ModelLoadError) as err2:
        ModelConfig.from_dir(tmp_path)
    one_line(err2.value, "duplicate", "config.json")
