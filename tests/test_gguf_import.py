"""GGUF -> Hugging Face conversion: tensors, layout, config, atomic output, CLI, real model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file

from fixtures_smollm2 import (
    TINY,
    TINY_SPECIALS,
    llama_cpp_permute,
    smollm2_dir,
    write_tiny_gguf,
)
from shard.cli.convert import convert_main
from shard.convert import gguf_import
from shard.convert.gguf_import import (
    COMPLETE_MARKER,
    ConvertError,
    OutputExists,
    convert_gguf,
    is_complete,
    unpermute_qk,
)


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny GGUF and the HF tensors it encodes."""
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """unpermute_qk undoes llama.cpp's permute for Q (n_head) and K (n_head_kv)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((9 * 64, 576)).astype(np.float32)
    k = rng.standard_normal((3 * 64, 576)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(q, 9, 9), 9), q)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(k, 9, 3), 3), k)
    assert not np.array_equal(llama_cpp_permute(q, 9, 9), q)


def test_tiny_roundtrip_restores_hf_tensors(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Converting a llama.cpp-style GGUF to float32 gives back the HF names, layout, values."""
    path, expected = tiny
    out = convert_gguf(path, path.parent / "out", progress=False, stored=False)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    for name, array in expected.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_tiny_config_from_metadata(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """config.json carries the GGUF hyperparameters, token ids and tied embeddings."""
    path, _ = tiny
    config = json.loads((convert_gguf(path, path.parent / "out") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == TINY["hidden"]
    assert config["num_attention_heads"] == TINY["heads"]
    assert config["num_key_value_heads"] == TINY["kv_heads"]
    assert config["num_hidden_layers"] == TINY["layers"]
    assert config["intermediate_size"] == TINY["ffn"]
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["tie_word_embeddings"] is True
    generation = json.loads((path.parent / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # EOS, then <|endoftext|> as llama.cpp does


def test_output_weight_becomes_untied_lm_head(tmp_path: Path) -> None:
    """A GGUF with output.weight yields lm_head.weight and tie_word_embeddings false."""
    expected = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    out = convert_gguf(tmp_path / "untied.gguf", tmp_path / "out", progress=False, stored=False)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(
        load_file(out / "model.safetensors")["lm_head.weight"], expected["lm_head.weight"]
    )


def test_output_is_complete_and_leaves_no_temp_dirs(
    tiny: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """A finished conversion has every file and the marker, and nothing else beside it."""
    path, _ = tiny
    out = convert_gguf(path, path.parent / "out", progress=False)
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        COMPLETE_MARKER,
    }
    assert is_complete(out)
    assert sorted(p.name for p in path.parent.iterdir()) == ["out", "tiny.gguf"]


def test_failed_conversion_leaves_nothing(
    tiny: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error mid-conversion removes the temp dir and never creates out_dir."""
    path, _ = tiny

    def explode(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "_write_safetensors", explode)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(path, path.parent / "out", progress=False)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]


def test_existing_output_is_refused(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """A non-empty out_dir is never overwritten; an empty one is filled."""
    path, _ = tiny
    (path.parent / "taken").mkdir()
    (path.parent / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExists, match="already exists"):
        convert_gguf(path, path.parent / "taken", progress=False)
    assert (path.parent / "taken" / "keep.txt").read_text() == "mine"
    (path.parent / "empty").mkdir()
    assert is_complete(convert_gguf(path, path.parent / "empty", progress=False))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"arch": "qwen2"}, "architecture 'qwen2' is not supported"),
        ({"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm'"),
    ],
)
def test_unsupported_input_is_a_clear_error(
    tmp_path: Path, options: dict[str, str], message: str
) -> None:
    """Unsupported architectures and pre-tokenizers fail fast with a ConvertError."""
    write_tiny_gguf(tmp_path / "x.gguf", **options)  # type: ignore[arg-type]
    with pytest.raises(ConvertError, match=message):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["I", "'m", "Ġ12345", "Ġok"]),
        ("smollm", ["I", "'m", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),
        ("llama-bpe", ["I", "'m", "Ġ", "123", "45", "Ġok"]),
        ("glm4", ["I", "'m", "Ġ", "123", "45", "Ġok"]),
        ("gpt-4o", ["I'm", "Ġ", "123", "45", "Ġok"]),
    ],
)
def test_pre_tokenizer_follows_llama_cpp(tmp_path: Path, pre: str, pieces: list[str]) -> None:
    """tokenizer.ggml.pre selects llama.cpp's splitting: whole numbers, digits, or triples;
    gpt-oss's o200k keeps a contraction on its word."""
    write_tiny_gguf(tmp_path / "x.gguf", pre=pre)
    out = convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)
    tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.pre_tokenizer is not None
    split = tokenizer.pre_tokenizer.pre_tokenize_str("I'm 12345 ok")
    assert [piece for piece, _ in split] == pieces


def test_tokenizer_files_from_metadata(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """tokenizer.json marks control tokens special; tokenizer_config names them."""
    path, _ = tiny
    out = convert_gguf(path, path.parent / "out", progress=False)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == [
        (i, t, True) for i, t in enumerate(TINY_SPECIALS)
    ]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False
    assert "<|im_start|>assistant" in config["chat_template"]


def test_convert_main_writes_and_reports(
    tiny: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard convert` converts, prints where it wrote and exits 0."""
    path, _ = tiny
    assert convert_main([str(path), str(path.parent / "out"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {path.parent / 'out'}"
    assert is_complete(path.parent / "out")


@pytest.mark.parametrize("case", ["missing", "not-gguf", "no-args"])
def test_convert_main_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """Bad input gives exit status 2 and a single `shard convert: error:` line."""
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"definitely not a gguf file")
    argv = {
        "missing": [str(tmp_path / "nope.gguf"), str(tmp_path / "out")],
        "not-gguf": [str(bogus), str(tmp_path / "out")],
        "no-args": [],
    }[case]
    assert convert_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shard convert: error: ")
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_smollm2_config_matches_the_model_card() -> None:
    """The converted SmolLM2-135M config has the published hyperparameters."""
    config = json.loads((smollm2_dir() / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(smollm2_dir() / "model.safetensors")


@pytest.mark.slow
def test_smollm2_generates_coherent_english_in_transformers(smollm2_float32_dir: Path) -> None:
    """transformers loads SmolLM2 converted to float32 and greedily completes with "Paris".

    Wrong Q/K un-permutation, rope base or norm epsilon all turn this into gibberish.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shard.model.tokenizer import Tokenizer

    out = smollm2_float32_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = Tokenizer.from_dir(out)
    prompt = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=2
        )
    completion = tokenizer.decode(out[0, len(prompt) :].tolist())
    assert "Paris" in completion, completion
