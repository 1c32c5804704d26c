"""A GGUF's tokenizer, rebuilt as a Hugging Face ``tokenizers`` tokenizer.

llama.cpp stores the tokenizer as metadata arrays (``tokenizer.ggml.tokens``, ``merges``,
``token_type``, the name of its pre-tokenizer) rather than a ``tokenizer.json``. This module
turns those values (read by ``shard.model.gguf_import`` into a ``GgufVocab``) back into the
three files the runtime and ``transformers`` load. Only byte-level BPE is rebuilt, and only
with pre-tokenizers whose splitting rules are reproduced exactly; anything else is refused
(``VocabError``) rather than approximated. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

import attrs
import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

__all__ = ["GgufVocab", "VocabError", "tokenizer_files"]


class VocabError(ValueError):
    """The GGUF's tokenizer metadata cannot be rebuilt faithfully (the message says why)."""


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


# llama.cpp names its pre-tokenizer in tokenizer.ggml.pre; these are the names whose splitting
# rules (llama-vocab.cpp, ``regex_exprs``) a Hugging Face pre-tokenizer reproduces exactly.
_GPT2_PRE = frozenset({"gpt-2", "mpt", "olmo", "jais"})
_DIGITS_PRE = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}
)
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    if vocab.model != "gpt2":
        raise VocabError(f"tokenizer model {vocab.model!r} is not supported; only byte-level BPE")
    tokens, kinds = vocab.tokens, vocab.kinds
    if len(tokens) > config["vocab_size"] or len(set(tokens)) != len(tokens):
        raise VocabError("GGUF vocabulary is inconsistent (too many or duplicate tokens)")
    tokenizer = _bpe(tokens, vocab.merges, vocab.pre)
    control = [i for i, k in enumerate(kinds) if k == gguf.TokenType.CONTROL]
    user = [t for t, k in zip(tokens, kinds, strict=True) if k == gguf.TokenType.USER_DEFINED]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in control]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    named = {
        role: (tokens[config[f"{role}_token_id"]], config[f"{role}_token_id"])
        for role in ("bos", "eos", "pad")
        if config.get(f"{role}_token_id", -1) in range(len(tokens))
    }
    add_bos, add_eos = vocab.add_bos, vocab.add_eos
    tokenizer.post_processor = _post_processor(named, add_bos=add_bos, add_eos=add_eos)
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
    elif pre in _LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
    else:
        raise VocabError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: "
            f"{', '.join(sorted(_GPT2_PRE | _DIGITS_PRE | _LLAMA3_PRE))}"
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _post_processor(
    named: dict[str, tuple[str, int]], *, add_bos: bool, add_eos: bool
) -> processors.PostProcessor:
    """Adds BOS/EOS only when the GGUF says so; otherwise byte-level offsets only."""
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
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
