"""Varied training prompts for a chat model: requests wrapped in its chat template, and
plain openings, about topics drawn from the tokenizer's own vocabulary of whole words.

The words give thousands of topics with nothing downloaded: every vocabulary entry that is
a space and 4-12 lowercase letters (``" harbor"``, ``" violin"``). Some make odd requests;
the target still answers them in its own style, which is what the head learns. None of the
held-out prompts (``bench/prompts/heldout_prose.toml``, ``HELD_OUT``) is built here.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from shard.model.tokenizer import Tokenizer

__all__ = ["prompt_texts", "vocabulary_words"]

_WORD = re.compile(r"^\u0120([a-z]{4,12})$")  # byte-level BPE's leading-space marker

_REQUESTS = (
    "Explain {w} in simple terms.",
    "What is {a} {w}? Answer in two sentences.",
    "Write a short story about {a} {w}.",
    "Write a short poem about {w}.",
    "Give me three tips about {w}.",
    "List five facts about {w}.",
    "Describe {a} {w} to a child.",
    "Why is {w} important?",
    "Write a paragraph about the history of {w}.",
    "How do I choose a good {w}?",
    "Compare {w} and {w2}.",
    "Write a short email to a friend about {w}.",
    "What are the pros and cons of {w}?",
    "Summarize what people should know about {w}.",
    "Tell me a fun fact about {w}.",
    "Write a product description for {a} {w}.",
    "Give a step-by-step guide to {w}.",
    "Write a blog post introduction about {w} and {w2}.",
    "What would happen if there were no {w}?",
    "Write a dialogue between {a} {w} and {a2} {w2}.",
    "Suggest a name for a shop that sells {w}.",
    "How can I learn more about {w}?",
    "Write a thank-you note mentioning {w}.",
    "Explain the difference between {w} and {w2} briefly.",
    "Write a Python function about {w}.",
    "What are common mistakes people make with {w}?",
)
_OPENINGS = (
    "The {w} was the first thing she noticed when",
    "Once upon a time, there was {a} {w} who",
    "In the small town of {W}, the",
    "Chapter 1\n\nThe {w} had always",
    "Dear {W},\n\nI am writing to",
    "{W} is one of the most",
    "Here are some things to know about {w}:\n1.",
    "The history of {w} begins",
    "Q: What is {a} {w}?\nA:",
    "It was a cold morning when the {w}",
    "My favourite {w} is",
    "Scientists have long studied the {w} because",
    "# {W}\n\n",
)


def vocabulary_words(model_dir: Path) -> list[str]:
    """Whole lowercase words of 4-12 letters in the model's ``tokenizer.json`` vocabulary,
    sorted (byte-level BPE vocabularies; an empty list for others)."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab", {})
    return sorted({m.group(1) for t in vocab if (m := _WORD.match(t))})


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def prompt_texts(
    tokenizer: Tokenizer, words: list[str], n: int, rng: random.Random, chat_share: float = 0.7
) -> list[list[int]]:
    """``n`` prompts as ids: ``chat_share`` of them requests in the chat template, the rest
    plain openings."""
    out = []
    for _ in range(n):
        w, w2 = rng.sample(words, 2)
        fill = {"w": w, "w2": w2, "W": w.capitalize(), "a": _article(w), "a2": _article(w2)}
        if rng.random() < chat_share and tokenizer.has_chat_template:
            text = rng.choice(_REQUESTS).format(**fill)
            text = tokenizer.apply_chat([{"role": "user", "content": text}])
        else:
            text = rng.choice(_OPENINGS).format(**fill)
        out.append(tokenizer.encode(text))
    return out
