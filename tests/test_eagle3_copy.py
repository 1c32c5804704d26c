"""Copy tasks in an EAGLE-3 head's training text (``shard.training.eagle3.copy_prompts``):
what the prompts ask, and which chunks ``fill`` makes of them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shard.model.tokenizer import Tokenizer
from shard.training.eagle3 import data
from shard.training.eagle3.copy_prompts import (
    copy_prompt_texts,
    natural_passages,
    passage,
    reply_marks,
)
from shard.training.eagle3.data import Batch, ChunkStore, fill

WORDS = ["harbor", "violin", "pepper", "ladder", "meadow", "candle", "turnip", "saddle"]


def test_passages_take_each_shape_and_only_the_words_given() -> None:
    rng = random.Random(0)
    texts = [passage(rng, WORDS) for _ in range(200)]
    assert any(t.startswith("The ") and "\n" not in t for t in texts)  # sentences
    assert any(t.startswith("1. ") for t in texts)  # a numbered list
    assert any(" = " in t for t in texts)  # key-value lines
    assert any(t.startswith("| name | count |") for t in texts)  # a table
    for t in texts:
        for line in t.split("\n"):
            if line.startswith("1. "):
                assert line.split(":")[0].removeprefix("1. ") in WORDS


def test_copy_prompts_ask_for_the_passage_or_restart_it(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = copy_prompt_texts(tok, WORDS, 60, random.Random(1))
    assert ids == copy_prompt_texts(tok, WORDS, 60, random.Random(1))  # seeded
    chats = plains = 0
    for text in (tok.decode(x) for x in ids):
        if text.startswith("<|im_start|>"):  # a request to repeat, in the chat template
            chats += 1
            assert text.endswith("<|im_start|>assistant\n")
        else:  # the passage, then its first line again, cut short, to be continued
            plains += 1
            body, again = text.rsplit("\n\n", 1)
            assert again and body.startswith(again)
    assert chats > 20 and plains > 5


def test_natural_passages_are_whole_sentences_from_a_reply_start(smollm2_dir: Path) -> None:
    marks = reply_marks(Tokenizer.from_dir(smollm2_dir))
    assert marks == ("<|im_end|>\n<|im_start|>assistant\n", ("<|im_end|>", "<|endoftext|>"))
    reply = "First sentence here, long enough to keep. " * 3 + "A tail that runs on" * 20
    rows = [
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + reply + "<|im_end|>",
        "Too short.",
        "Plain text that is long enough to be a passage of its own.<|endoftext|>",
    ]
    got = natural_passages(rows, limit=200, marks=marks)
    assert got == [
        "First sentence here, long enough to keep. " * 2
        + "First sentence here, long enough to keep.",
        "Plain text that is long enough to be a passage of its own.",
    ]
    assert natural_passages(rows[:1])[0].startswith("<|im_start|>user")  # no marks: whole rows
    silent: Any = type(
        "Tok",
        (),
        {
            "eos_ids": (0, 1),
            "has_chat_template": False,
            "decode": lambda s, i: "" if i == [0] else "<e>",
        },
    )()
    assert reply_marks(silent) == ("", ("<e>",))  # a stop token with no text marks nothing


def test_copy_prompts_longer_than_max_len_are_drawn_again(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_dir(smollm2_dir)
    long = ["word " * 150 + "end."]
    ids = copy_prompt_texts(tok, WORDS, 30, random.Random(2), natural=long, max_len=112)
    assert len(ids) == 30 and all(len(x) <= 112 for x in ids)
    assert not any("word word" in tok.decode(x) for x in ids)  # the long passage never fits
    with pytest.raises(ValueError, match="no copy prompt fits in 4 tokens"):
        copy_prompt_texts(tok, WORDS, 1, random.Random(2), max_len=4)  # a passage alone is more


def test_fill_makes_every_nth_chunk_of_copy_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[list[int]]] = []
    naturals: list[list[str] | None] = []

    def fake_sample(target: Any, prompts: list[list[int]], **kw: Any) -> Batch:
        seen.append(prompts)
        n, s = len(prompts), kw["seq_len"]
        return Batch(
            torch.zeros(n, s, dtype=torch.long),
            torch.zeros(n, s, 3),
            torch.zeros(n, s, 1),
            torch.ones(n, s, dtype=torch.bool),
        )

    monkeypatch.setattr(data, "sample_batch", fake_sample)
    monkeypatch.setattr(data, "prompt_texts", lambda tok, words, n, rng: [[1] * 80] * n)

    def fake_copy(tok: Any, words: list[str], n: int, rng: Any, **kw: Any) -> list[list[int]]:
        naturals.append(kw["natural"])
        return [[2] * 120] * n

    monkeypatch.setattr(data, "copy_prompt_texts", fake_copy)
    store = ChunkStore(tmp_path / "text")
    tok: Any = type(
        "Tok",
        (),
        {
            "eos_ids": (0,),
            "has_chat_template": False,
            "decode": lambda self, ids: (
                "<eos>"
                if list(ids) == [0]
                else f"A row of {len(ids)} tokens, decoded as one sentence.<eos>"
            ),
        },
    )()
    kw: dict[str, Any] = dict(layers=(0,), rows=2, seq_len=10, temperatures=(0.0,), seed=0)
    fill(store, None, tok, WORDS, tokens=7 * 20, prompt_len=64, copy_every=3, **kw)  # type: ignore[arg-type]
    assert len(seen) == 7
    for i, prompts in enumerate(seen):
        if i % 3 == 2:
            assert prompts == [[2] * 112] * 2  # cut to copy_prompt_len
        else:
            assert prompts == [[1] * 64] * 2
    # each copy chunk's passages come from the chunk before: its 2 rows of 10 real tokens
    row = "A row of 10 tokens, decoded as one sentence."  # up to the stop token's text
    assert naturals == [[row, row]] * 2
    seen.clear()
    fill(ChunkStore(tmp_path / "plain"), None, tok, WORDS, tokens=60, prompt_len=64, **kw)  # type: ignore[arg-type]
    assert all(p == [[1] * 64] * 2 for p in seen)  # copy_every 0 (the default): none
