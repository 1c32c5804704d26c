"""A GGUF's tokenizer, rebuilt as a Hugging Face ``tokenizers`` tokenizer.

llama.cpp stores the tokenizer as metadata arrays (``tokenizer.ggml.tokens``, ``merges``,
``token_type``, the name of its pre-tokenizer) rather than a ``tokenizer.json``. This module
turns those values (read by ``shard.convert.gguf_import`` into a ``GgufVocab``) back into the
three files the runtime and ``transformers`` load. Two vocabularies are rebuilt:

- byte-level BPE (``tokenizer.ggml.model = "gpt2"``: SmolLM2, Llama 3, Qwen), only with
  pre-tokenizers whose splitting rules are reproduced exactly;
- SentencePiece-style BPE (``"llama"``: Gemma, Llama 2, Mistral), stored as pieces with
  scores and no merges. SentencePiece's BPE merges, at each step, the adjacent pair whose
  merged piece scores highest; a ``tokenizers`` BPE whose merges are every split of a piece
  into two pieces, ranked by the merged piece's score, makes the same choices. Spaces become
  ``▁``, a ``▁`` is prefixed only where ``tokenizer.ggml.add_space_prefix`` says, and
  characters outside the vocabulary fall back to their UTF-8 byte pieces (``<0x41>``).

Anything else is refused (``VocabError``) rather than approximated, as is metadata that
lies: values of the wrong type, token types llama.cpp does not define, merges naming tokens
the vocabulary lacks, BOS/EOS/padding ids outside it, scores that are not finite, tokens
longer than ``MAX_TOKEN_CHARS``. Nothing
here imports torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

import attrs
import gguf
import tokenizers
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from shard.convert.gguf_common import FLOAT_TYPES, INTEGER_TYPES, ConvertError

if TYPE_CHECKING:
    from shard.convert.gguf_file import GgufFile

__all__ = ["GgufVocab", "VocabError", "read_vocab", "tokenizer_files"]


class VocabError(ConvertError, ValueError):
    """The GGUF's tokenizer metadata cannot be rebuilt faithfully (the message says why)."""


_ARRAY: Final = gguf.GGUFValueType.ARRAY
_STRING: Final = gguf.GGUFValueType.STRING
_INTS, _FLOATS = INTEGER_TYPES, FLOAT_TYPES  # the metadata reader's own sets
_TOKEN_TYPES: Final = frozenset(int(t) for t in gguf.TokenType)
MAX_TOKEN_CHARS: Final = 1024
"""Characters in one token (real vocabularies: under 300). The SentencePiece rebuild tries
every split of every piece, so its time grows with the square of a piece's length."""
MAX_VOCAB_CHARS: Final = 1 << 24
"""Characters in all tokens together (Gemma 3's 262,144 tokens: about 2 million)."""


@attrs.frozen
class GgufVocab:
    """The tokenizer metadata of a GGUF, as read (``tokenizer.ggml.*`` keys)."""

    model: str
    tokens: list[str]
    kinds: list[int]  # gguf.TokenType per token
    merges: list[str]  # "left right"
    pre: str
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    scores: list[float] = attrs.field(factory=list)  # per token (SentencePiece vocabularies)
    add_space_prefix: bool = True  # SentencePiece: prefix the text with "▁"


def read_vocab(reader: GgufFile) -> GgufVocab:
    """The ``tokenizer.ggml.*`` metadata of an open GGUF, each value of its type.

    Errors: ``VocabError`` when the file has no tokens, a BPE vocabulary no merges, or a
    value has the wrong type (naming the key).
    """

    def meta(key: str, kinds: frozenset[gguf.GGUFValueType], default: Any) -> Any:
        return _typed(reader, f"tokenizer.ggml.{key}", kinds, default)

    def array(key: str, kinds: frozenset[gguf.GGUFValueType], default: Any) -> Any:
        return _typed(reader, f"tokenizer.ggml.{key}", kinds, default, array=True)

    strings, flag = frozenset({_STRING}), frozenset({gguf.GGUFValueType.BOOL})
    tokens: list[str] | None = array("tokens", strings, None)
    if not tokens:
        raise VocabError("GGUF metadata has no 'tokenizer.ggml.tokens'; the file is incomplete")
    model = meta("model", strings, "gpt2")
    merges: list[str] = array("merges", strings, [])
    if model == "gpt2" and not merges:
        raise VocabError("GGUF metadata has no 'tokenizer.ggml.merges' for its BPE vocabulary")
    return GgufVocab(
        model=model,
        tokens=tokens,
        kinds=array("token_type", _INTS, [int(gguf.TokenType.NORMAL)] * len(tokens)),
        merges=merges,
        pre=meta("pre", strings, "gpt-2"),
        add_bos=meta("add_bos_token", flag, False),
        add_eos=meta("add_eos_token", flag, False),
        chat_template=_typed(reader, "tokenizer.chat_template", strings, None),
        scores=array("scores", _FLOATS, []),
        add_space_prefix=meta("add_space_prefix", flag, True),
    )


def _typed(
    reader: GgufFile,
    key: str,
    kinds: frozenset[gguf.GGUFValueType],
    default: Any,
    *,
    array: bool = False,
) -> Any:
    """The value under ``key``: one of ``kinds``, or (``array``) an array of them."""
    field = reader.get_field(key)
    if field is None:
        return default
    types = list(field.types)
    if array and types[:1] == [_ARRAY] and (types[1:] == [] or types[1] in kinds):
        return field.contents()
    if not array and len(types) == 1 and types[0] in kinds:
        return field.contents()
    want = " or ".join(sorted(k.name.lower() for k in kinds))
    got = " of ".join(t.name.lower() for t in types)
    raise VocabError(f"{key}: must be {'an array of ' if array else ''}{want}, not {got}")


# llama.cpp names its pre-tokenizer in tokenizer.ggml.pre; these are the names whose splitting
# rules (llama-vocab.cpp, ``regex_exprs``) a Hugging Face pre-tokenizer reproduces exactly.
_GPT2_PRE = frozenset({"gpt-2", "mpt", "olmo", "jais"})
_DIGITS_PRE = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}
)
#: GLM-4.5's ``glm4`` (and ``chatglm-bpe``): llama.cpp's CHATGLM4 type, Llama 3's very regex.
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "glm4", "chatglm-bpe"})
_QWEN2_PRE = frozenset({"qwen2"})  # Qwen2/2.5/3: Llama 3's regex, digits one at a time
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# gpt-oss's o200k split, as its tokenizer.json (and tiktoken's o200k_base) has it: words split
# at case changes, contractions kept on the word. llama.cpp's GPT4O type runs an ASCII-only
# adaptation of it (no \p{M}, case told apart for A-Z / a-z only); this is the model's own.
_GPT4O_PRE = frozenset({"gpt-4o"})
_O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Control tokens llama.cpp treats as end of generation; listing them in generation_config
# makes a decoding loop stop where llama.cpp would, e.g. on <|endoftext|> after a completion.
_EOG_TOKENS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
)


def tokenizer_files(
    vocab: GgufVocab, config: dict[str, Any]
) -> tuple[tokenizers.Tokenizer, dict[str, Any], dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and generation_config.json for ``vocab``, given the
    model's ``config.json`` (its vocabulary size, special token ids and context length).

    Errors: ``VocabError`` when the vocabulary cannot be rebuilt faithfully.
    """
    tokens, kinds = vocab.tokens, vocab.kinds
    if len(tokens) > config["vocab_size"]:
        raise VocabError(
            f"tokenizer.ggml.tokens: {len(tokens)} tokens for {config['vocab_size']} embedding "
            "rows; the GGUF vocabulary is inconsistent"
        )
    if len(set(tokens)) != len(tokens):
        raise VocabError(
            "tokenizer.ggml.tokens: a token appears twice; the vocabulary is inconsistent"
        )
    if len(kinds) != len(tokens):
        raise VocabError(
            f"tokenizer.ggml.token_type: {len(kinds)} types for {len(tokens)} tokens; they do "
            "not match one for one"
        )
    _check_values(vocab, config)
    if vocab.model == "gpt2":
        tokenizer = _bpe(tokens, vocab.merges, vocab.pre)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece(vocab)
    else:
        raise VocabError(
            f"tokenizer model {vocab.model!r} is not supported; only byte-level BPE ('gpt2') "
            "and SentencePiece-style BPE ('llama')"
        )
    control = [i for i, k in enumerate(kinds) if k == gguf.TokenType.CONTROL]
    user = _added_user_tokens(vocab)
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in control]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    named = {
        role: (tokens[config[f"{role}_token_id"]], config[f"{role}_token_id"])
        for role in ("bos", "eos", "pad")
        if f"{role}_token_id" in config
    }
    add_bos, add_eos = vocab.add_bos, vocab.add_eos
    byte_level = vocab.model == "gpt2"
    tokenizer.post_processor = _post_processor(
        named, add_bos=add_bos, add_eos=add_eos, byte_level=byte_level
    )
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": vocab.chat_template,
        **{f"{role}_token": token for role, (token, _) in named.items()},
    }
    eos = [config["eos_token_id"]] if "eos" in named else []
    eos += [i for i in control if tokens[i] in _EOG_TOKENS and i not in eos]
    keys = ("bos_token_id", "pad_token_id")
    generation: dict[str, Any] = {key: config[key] for key in keys if key in config}
    return tokenizer, tokenizer_config, {**generation, "eos_token_id": eos}


def _check_values(vocab: GgufVocab, config: dict[str, Any]) -> None:
    """Refuse what the tokenizer would misread, crash or stall on: tokens too long, special
    ids outside the tokens, unknown token types, merges of tokens the vocabulary lacks, scores
    that are not finite."""
    n = len(vocab.tokens)
    longest = max(range(n), key=lambda i: len(vocab.tokens[i]))
    if len(vocab.tokens[longest]) > MAX_TOKEN_CHARS:
        raise VocabError(
            f"tokenizer.ggml.tokens: token {longest} has {len(vocab.tokens[longest])} "
            f"characters; at most {MAX_TOKEN_CHARS} are read"
        )
    if sum(len(t) for t in vocab.tokens) > MAX_VOCAB_CHARS:
        raise VocabError(f"tokenizer.ggml.tokens: more than {MAX_VOCAB_CHARS} characters in all")
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = config.get(f"{role}_token_id")
        if token_id is not None and not 0 <= token_id < n:
            raise VocabError(
                f"tokenizer.ggml.{key}_token_id: {token_id} is not a token id (0..{n - 1})"
            )
    unknown = sorted(set(vocab.kinds) - _TOKEN_TYPES)
    if unknown:
        raise VocabError(
            f"tokenizer.ggml.token_type: {unknown[0]} is not a llama.cpp token type "
            f"({', '.join(f'{int(t)} {t.name}' for t in gguf.TokenType)})"
        )
    if vocab.scores and not all(math.isfinite(s) for s in vocab.scores):
        raise VocabError("tokenizer.ggml.scores: not every score is finite")
    known = set(vocab.tokens)
    for i, merge in enumerate(vocab.merges):
        left, space, right = merge.partition(" ")
        if not space or not {left, right, left + right} <= known:
            raise VocabError(
                f"tokenizer.ggml.merges: merge {i} {merge[:40]!r} is not 'left right' with "
                "left, right and their join all tokens of the vocabulary"
            )


def _bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with the pre-tokenizer llama.cpp uses for ``pre``."""
    if any(" " not in m for m in merges):
        raise VocabError("GGUF merges are malformed (expected 'left right' pairs)")
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        tokenizer.pre_tokenizer = byte_level
    elif pre in _DIGITS_PRE:  # llama.cpp splits every digit first, then the GPT-2 regex
        digits = pre_tokenizers.Digits(individual_digits=True)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in _LLAMA3_PRE | _QWEN2_PRE | _GPT4O_PRE:
        regex = _QWEN2_REGEX if pre in _QWEN2_PRE else _LLAMA3_REGEX
        regex = _O200K_REGEX if pre in _GPT4O_PRE else regex
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
    else:
        raise VocabError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: "
            f"{', '.join(sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE | _QWEN2_PRE | _GPT4O_PRE))}"
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _sentencepiece(vocab: GgufVocab) -> tokenizers.Tokenizer:
    """A SentencePiece-style BPE: pieces and scores in, merges derived (module docstring).

    A user-defined piece made of spaces (Gemma's ``"  "`` runs) is stored with ``▁`` for its
    spaces and reached by merges, not matched as an added token: the text is normalized to
    ``▁`` first, so that is where such a piece can match (as in transformers' GGUF loader).
    """
    pieces = [_sp_piece(t, k) for t, k in zip(vocab.tokens, vocab.kinds, strict=True)]
    if len(vocab.scores) != len(pieces):
        raise VocabError(
            f"tokenizer.ggml.scores: {len(vocab.scores)} scores for {len(pieces)} tokens; a "
            "SentencePiece vocabulary has one per token"
        )
    if len(set(pieces)) != len(pieces):
        raise VocabError(
            "tokenizer.ggml.tokens: the SentencePiece vocabulary has duplicate pieces once "
            "spaces are ▁"
        )
    unknown = [t for t, k in zip(pieces, vocab.kinds, strict=True) if k == gguf.TokenType.UNKNOWN]
    model = models.BPE(
        vocab={t: i for i, t in enumerate(pieces)},
        merges=_score_merges(pieces, vocab.scores, vocab.kinds),
        unk_token=unknown[0] if unknown else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = tokenizers.Tokenizer(model)
    if vocab.add_space_prefix:  # "▁" before the text's first run only, as llama.cpp adds it
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
    else:
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    undo: list[decoders.Decoder] = [
        decoders.Replace(_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if vocab.add_space_prefix:
        undo.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(undo)
    return tokenizer


def _sp_piece(token: str, kind: int) -> str:
    """The piece as the BPE model holds it: a user-defined piece's spaces become ``▁``."""
    return token.replace(" ", _SPACE) if kind == gguf.TokenType.USER_DEFINED else token


def _added_user_tokens(vocab: GgufVocab) -> list[str]:
    """User-defined tokens matched before the model runs (a SentencePiece vocabulary's
    space runs are pieces of the model instead; ``_sentencepiece``)."""
    user = [
        t
        for t, k in zip(vocab.tokens, vocab.kinds, strict=True)
        if k == gguf.TokenType.USER_DEFINED
    ]
    return user if vocab.model != "llama" else [t for t in user if " " not in t]


def _score_merges(
    pieces: list[str], scores: list[float], kinds: list[int]
) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best merged piece first.

    User-defined pieces come first (SentencePiece matches them whole, before any merge), then
    normal pieces by score; control and byte pieces are never the result of a merge. Ties keep
    the vocabulary's order (the lower id first), then the split point from the left, so the
    list, and the tokenizer, are a function of the GGUF alone.
    """
    ids = {t: i for i, t in enumerate(pieces)}
    ranked: list[tuple[int, float, int, int, str, str]] = []
    for i, (piece, kind) in enumerate(zip(pieces, kinds, strict=True)):
        if kind == gguf.TokenType.USER_DEFINED:
            tier, score = 0, 0.0
        elif kind == gguf.TokenType.NORMAL:
            tier, score = 1, -scores[i]
        else:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((tier, score, i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(
    named: dict[str, tuple[str, int]], *, add_bos: bool, add_eos: bool, byte_level: bool
) -> processors.PostProcessor | None:
    """Adds BOS/EOS only when the GGUF says so; otherwise byte-level offsets only (or nothing,
    for a SentencePiece vocabulary)."""
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    wanted = [role for role, on in (("bos", add_bos), ("eos", add_eos)) if on]
    if any(role not in named for role in wanted):
        raise VocabError("GGUF asks to add BOS/EOS tokens but does not name them")
    bos = [named["bos"][0]] if add_bos else []
    eos = [named["eos"][0]] if add_eos else []
    return processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=[named[role] for role in wanted],
    )
