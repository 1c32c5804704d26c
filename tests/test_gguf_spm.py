"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model = "llama"``): pieces and
scores rebuilt as a tokenizer, checked against a plain greedy SentencePiece-BPE written out
here and, on Gemma 3's real vocabulary, against transformers' own GGUF tokenizer."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest

from gemma_fixtures import gemma_gguf, gemma_reader, read_by
from shard.convert.gguf_vocab import GgufVocab, VocabError, read_vocab, tokenizer_files
from shard.model.tokenizer import StreamDecoder, Tokenizer

SPACE = "\u2581"
NORMAL, CONTROL, USER, BYTE = (
    int(gguf.TokenType.NORMAL),
    int(gguf.TokenType.CONTROL),
    int(gguf.TokenType.USER_DEFINED),
    int(gguf.TokenType.BYTE),
)


def tiny_vocab(
    *, add_space_prefix: bool, add_bos: bool = True, space_run: bool = True
) -> GgufVocab:
    """A small SentencePiece vocabulary: specials, user-defined pieces (a newline run and,
    with ``space_run``, a run of spaces, as Gemma has), 256 byte pieces and scored normal
    pieces."""
    tokens = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<turn>",
        "\n",
        "\n\n",
        "  " if space_run else "<b>",
    ]
    kinds = [CONTROL] * 5 + [USER] * 3
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    kinds += [BYTE] * 256
    normal = [
        *"▁abcdehlorwté",
        "▁h", "he", "ll", "lo", "▁w", "or", "rl", "ld", "▁he", "hel", "llo", "▁hel", "▁hello",
        "▁wor", "wor", "▁worl", "▁world", "ab", "bc", "abc", "▁a", "▁ab", "cé",
    ]  # fmt: skip
    tokens += normal
    kinds += [NORMAL] * len(normal)
    rng = random.Random(5)
    scores = [-1000.0] * (len(tokens) - len(normal)) + [
        -float(i) + rng.choice((0.0, 0.5)) for i in range(len(normal))
    ]
    return GgufVocab(
        model="llama",
        tokens=tokens,
        kinds=kinds,
        merges=[],
        pre="default",
        add_bos=add_bos,
        add_eos=False,
        chat_template=None,
        scores=scores,
        add_space_prefix=add_space_prefix,
    )


def reference_encode(text: str, vocab: GgufVocab) -> list[int]:
    """SentencePiece's BPE written out plainly: control tokens, and user-defined pieces without
    spaces, split out of the raw text; in each run between them spaces become ``▁`` (and the
    run at the very start gets a ``▁`` prefix when the GGUF says so); then repeatedly merge
    the adjacent pair whose merged piece is best (a user-defined piece before any normal one,
    normal ones by score, the leftmost on ties); leftover symbols fall back to byte pieces."""
    ids = {
        t.replace(" ", SPACE) if k == USER else t: i
        for i, (t, k) in enumerate(zip(vocab.tokens, vocab.kinds, strict=True))
    }
    whole = sorted(
        (t for t, k in zip(vocab.tokens, vocab.kinds, strict=True)
         if k == CONTROL or (k == USER and " " not in t)),
        key=len, reverse=True,
    )  # fmt: skip
    out = [ids["<bos>"]] if vocab.add_bos else []
    pos, start = 0, 0
    while pos < len(text):
        hit = next((w for w in whole if text.startswith(w, pos)), None)
        if hit is None:
            pos += 1
            continue
        out += _merge(text[start:pos], vocab, ids, at_start=start == 0)
        out.append(ids[hit])
        pos = start = pos + len(hit)
    return out + _merge(text[start:], vocab, ids, at_start=start == 0)


def _merge(plain: str, vocab: GgufVocab, ids: dict[str, int], *, at_start: bool) -> list[int]:
    if not plain:
        return []
    prefix = SPACE if vocab.add_space_prefix and at_start else ""
    symbols = list(prefix + plain.replace(" ", SPACE))

    def rank(piece: str) -> tuple[int, float] | None:
        i = ids.get(piece)
        if i is None or vocab.kinds[i] not in (NORMAL, USER):
            return None
        return (0, 0.0) if vocab.kinds[i] == USER else (1, -vocab.scores[i])

    while len(symbols) > 1:
        pairs = [(rank(a + b), i) for i, (a, b) in enumerate(itertools.pairwise(symbols))]
        best = min(((r, i) for r, i in pairs if r is not None), default=None)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


def build(vocab: GgufVocab, directory: Path) -> Tokenizer:
    """The vocabulary's three tokenizer files (and a config) written out, loaded as shard
    loads a model's tokenizer."""
    config = {
        "vocab_size": len(vocab.tokens),
        "bos_token_id": vocab.tokens.index("<bos>"),
        "eos_token_id": vocab.tokens.index("<eos>"),
        "pad_token_id": vocab.tokens.index("<pad>"),
        "max_position_embeddings": 512,
    }
    tokenizer, tokenizer_config, generation = tokenizer_files(vocab, config)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    for name, data in (
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation),
        ("config.json", config),
    ):
        (directory / name).write_text(json.dumps(data))
    return Tokenizer.from_dir(directory)


TINY_TEXTS = [
    "hello world",
    " hello  world ",
    "abc abcé\n\nhello\nworld",
    "<turn>hello<turn> world<bos>",
    "xyz 日本 🤖",
    "  ",
    "▁hello ▁ world",
    "",
]


def random_texts(seed: int, n: int) -> list[str]:
    """``n`` seeded random texts over the tiny vocabulary's characters, specials and runs."""
    rng = random.Random(seed)
    alphabet = [*"abcdehlorwté ", "\n", "\n\n", "  ", "▁", "<turn>", "日", "🤖", "é"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(n)]


def test_tiny_vocabulary_encodes_as_greedy_sentencepiece(tmp_path: Path) -> None:
    """On a small vocabulary without a space prefix (as Gemma's), every text (fixed and 400
    seeded random ones) encodes as the plain greedy SentencePiece BPE does, BOS first, and
    decodes back to itself (specials skipped; a literal ``▁`` comes back as the space it
    stands for)."""
    vocab = tiny_vocab(add_space_prefix=False)
    tok = build(vocab, tmp_path / "tok")
    seed = 11
    for text in TINY_TEXTS + random_texts(seed, 400):
        got = tok.encode(text)
        assert got == reference_encode(text, vocab), f"seed {seed}: {text!r}"
        assert got[:1] == [2]
        plain = text.replace(SPACE, " ")  # a literal "▁" is a space to SentencePiece
        for special in ("<turn>", "<bos>"):
            plain = plain.replace(special, "")
        assert tok.decode(got, skip_special_tokens=True) == plain, text


def write_gguf(vocab: GgufVocab, path: Path) -> Path:
    """A minimal GGUF holding ``vocab`` (and one zero embedding) for transformers to read."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.kinds)
    for name, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(writer, f"add_{name}_token_id")(vocab.tokens.index(token))
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab.tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_space_prefixed_vocabulary_equals_transformers(tmp_path: Path) -> None:
    """With ``add_space_prefix`` (Llama 2 and Mistral GGUFs have it), the tiny vocabulary
    written as a Llama GGUF encodes as transformers' GGUF tokenizer does: one ``▁`` before the
    text's first run, none after a leading special token or before a leading space. (Without
    the flag transformers' Llama converter still prefixes, so Gemma's real file, which has it
    off and transformers' Gemma converter, checks that case below. Nor does that converter
    fold a user-defined run of spaces into the pieces as its Gemma converter does; Llama 2
    and Mistral vocabularies have no such piece, so this one has none either.)"""
    from transformers import AutoTokenizer

    vocab = tiny_vocab(add_space_prefix=True, space_run=False)
    path = write_gguf(vocab, tmp_path / "tiny.gguf")
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = build(read_vocab(gguf.GGUFReader(path)), tmp_path / "ours")
    seed = 12
    for text in TINY_TEXTS + random_texts(seed, 300):
        assert ours.encode(text) == theirs(text)["input_ids"], f"seed {seed}: {text!r}"


def test_bos_follows_the_gguf(tmp_path: Path) -> None:
    """``add_bos_token = false`` adds no BOS; the same vocabulary with it true does."""
    off = build(tiny_vocab(add_space_prefix=False, add_bos=False), tmp_path / "off")
    on = build(tiny_vocab(add_space_prefix=False, add_bos=True), tmp_path / "on")
    assert off.encode("hello")[:1] != [2]
    assert on.encode("hello") == [2, *off.encode("hello")]


def test_sentencepiece_without_scores_is_refused() -> None:
    """A SentencePiece vocabulary whose scores are missing is refused, never guessed."""
    vocab = tiny_vocab(add_space_prefix=False)
    broken = attrs.evolve(vocab, scores=[])
    with pytest.raises(VocabError, match="score"):
        tokenizer_files(broken, {"vocab_size": len(vocab.tokens), "max_position_embeddings": 8})


def test_unknown_tokenizer_model_is_refused() -> None:
    """A tokenizer model shard cannot rebuild exactly (e.g. WordPiece's "bert") is refused."""
    vocab = attrs.evolve(tiny_vocab(add_space_prefix=False), model="bert")
    with pytest.raises(VocabError, match="not supported"):
        tokenizer_files(vocab, {"vocab_size": len(vocab.tokens), "max_position_embeddings": 8})


GEMMA_TEXTS = [
    "Hello world",
    "  two  spaces\n\nnew paragraph\n\n\n",
    "naïve café — 東京 ünïcödé Ελληνικά русский العربية अनुच्छेद 한국어",
    "emoji 🚀🎉👩\u200d👩\u200d👧 flags 🇫🇷 zero\u200bwidth no\u00a0break",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal bos <eos> <pad> <unk> <mask>",
    "def f(x):\n    return x**2  # four spaces\n\tand a tab\r\n",
    "1234567890 3.14159 -42 1e-5 0x1F",
    " leading and trailing ",
    "▁ a literal sentencepiece space ▁▁",
    "",
]


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """Gemma 3's GGUF vocabulary rebuilt by shard, and transformers' tokenizer of the same
    GGUF (the independent reference)."""
    from transformers import AutoTokenizer

    path, reader = gemma_gguf(), gemma_reader()  # parsed once, shared with test_gemma_real
    vocab = read_vocab(reader)
    assert vocab.model == "llama"
    assert vocab.add_bos
    assert not vocab.add_space_prefix
    ours = build(vocab, tmp_path_factory.mktemp("gemma-tok"))
    with read_by(reader):
        theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


@pytest.mark.slow
def test_gemma_vocabulary_equals_transformers(gemma_pair: tuple[Tokenizer, Any]) -> None:
    """On Gemma 3's real vocabulary, shard's ids equal transformers' GGUF tokenizer's for
    non-ASCII text, whitespace runs and special tokens (fixed texts and 300 seeded random
    ones), each starting with ``<bos>`` as the GGUF declares, and decode alike."""
    ours, theirs = gemma_pair
    seed = 7
    rng = random.Random(seed)
    alphabet = [
        *"abcXYZ  \n\t.,!?'\"-_0123456789éüñßøæ日本語中文한국어русский🤖👍\u00a0\u200b<>/",
        "<start_of_turn>", "<end_of_turn>", "<bos>", "  ", "\n\n", "▁", "<0x41>",
    ]  # fmt: skip
    texts = GEMMA_TEXTS + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)
    ]
    for text in texts:
        got = ours.encode(text)
        assert got == theirs(text)["input_ids"], f"seed {seed}: {text!r}"
        assert got[0] == ours.bos_id == 2
        assert ours.decode(got) == theirs.decode(got)


@pytest.mark.slow
def test_gemma_stream_decoding_joins_byte_pieces(gemma_pair: tuple[Tokenizer, Any]) -> None:
    """Streaming Gemma's ids one at a time gives the text back, byte-fallback pieces of an
    emoji joined before they are shown (never half a character)."""
    ours, _ = gemma_pair
    text = "Hello 🤖 wörld  \n\n日本"
    stream = StreamDecoder(ours, skip_special_tokens=True)
    pieces = [stream.push(i) for i in ours.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
