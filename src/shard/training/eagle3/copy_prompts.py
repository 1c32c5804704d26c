"""Copy tasks for an EAGLE-3 head's training text: a passage the target is asked to repeat
(in its chat template), or one whose start it is given again to continue (plain text).

A head trained only on prose and chat has rarely seen the target copy from its context, and
at a copy's first tokens, where the prompt lookup has not yet lined up far enough to be
trusted, it guesses prose (docs/benchmarks.md, "That chunk, traced"). The states it reads
already say what the target will copy (the target attends back to the passage); trained on
text where the target copies, the head can learn to read that. Most passages are the
target's own text (the first sentences of its continuations in the chunk made before, which
it copies fluently); the rest are built from the tokenizer's vocabulary words and numbers in
a few shapes (sentences, lists, key-value lines, table rows). Nothing is downloaded, and
none is a prompt of the benchmark sets.
"""

from __future__ import annotations

import random

from shard.model.tokenizer import Tokenizer

__all__ = ["copy_prompt_texts", "natural_passages", "passage", "reply_marks"]

#: The share of copy prompts whose passage is the target's own text, where some is given.
NATURAL_SHARE = 0.75

_VERBS = (
    "is next to",
    "was moved to",
    "belongs with",
    "arrived before",
    "costs more than",
    "depends on",
    "was found under",
    "is kept behind",
    "was painted like",
    "leads to",
)
_TAILS = ("", "", " on {day}", " at {n} o'clock", " for {n} minutes", " after the {x}")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_UNITS = ("boxes", "bags", "jars", "items", "kg", "metres", "pages", "crates")
_ASKS = (
    "Repeat this back to me exactly:\n\n{p}",
    "Copy the following text word for word:\n\n{p}",
    "Please write this out again, unchanged:\n\n{p}",
    "Here is a note. Repeat it so I can check it:\n\n{p}",
    'Say this again, but write "{new}" instead of "{old}":\n\n{p}',
    "{p}\n\nCan you repeat that back to me?",
)


def _sentence(rng: random.Random, words: list[str]) -> str:
    w, w2, x = rng.sample(words, 3)
    tail = rng.choice(_TAILS).format(day=rng.choice(_DAYS), n=rng.randint(1, 59), x=x)
    return f"The {w} {rng.choice(_VERBS)} the {w2}{tail}."


def passage(rng: random.Random, words: list[str]) -> str:
    """A short passage of one of four shapes: sentences, a list, key-value lines or a
    table."""
    shape = rng.randrange(4)
    lines = rng.randint(2, 4)
    if shape == 0:
        return " ".join(_sentence(rng, words) for _ in range(lines))
    if shape == 1:
        unit = rng.choice(_UNITS)
        return "\n".join(
            f"{i + 1}. {rng.choice(words)}: {rng.randint(1, 99)} {unit}" for i in range(lines)
        )
    if shape == 2:
        return "\n".join(f"{rng.choice(words)} = {rng.randint(0, 999)}" for _ in range(lines))
    head = "| name | count |\n|---|---|\n"
    return head + "\n".join(f"| {rng.choice(words)} | {rng.randint(1, 99)} |" for _ in range(lines))


def reply_marks(tokenizer: Tokenizer) -> tuple[str, tuple[str, ...]]:
    """What the tokenizer's chat template writes between a user's turn and the reply (for
    SmolLM2 ``"<|im_end|>\\n<|im_start|>assistant\\n"``; empty without a template) and the
    texts of its stop tokens, which end a reply (a stop token that decodes to nothing is left
    out: it marks nothing in the decoded text)."""
    ends = tuple(t for t in (tokenizer.decode([i]) for i in tokenizer.eos_ids) if t)
    if not tokenizer.has_chat_template:
        return "", ends
    return tokenizer.apply_chat([{"role": "user", "content": "\x00"}]).split("\x00")[-1], ends


def natural_passages(
    texts: list[str], limit: int = 200, marks: tuple[str, tuple[str, ...]] = ("", ())
) -> list[str]:
    """Passages from the target's own text (decoded rows; with ``marks`` from
    ``reply_marks``, a chat row's passage is its reply: what follows the last reply mark, up
    to a stop token): whole sentences or lines from its start, at most ``limit``
    characters, at least 40."""
    after, ends = marks
    out = []
    for text in texts:
        body = text.rsplit(after, 1)[-1] if after else text
        for end_mark in ends:
            body = body.split(end_mark)[0]
        body = body.strip()
        cut = body[:limit]
        end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind("\n"))
        if len(body) > limit:
            cut = cut[: end + 1] if end > 0 else ""
        if len(cut.strip()) >= 40:
            out.append(cut.strip())
    return out


def copy_prompt_texts(
    tokenizer: Tokenizer,
    words: list[str],
    n: int,
    rng: random.Random,
    chat_share: float = 0.7,
    natural: list[str] | None = None,
    max_len: int | None = None,
) -> list[list[int]]:
    """``n`` copy prompts as ids: ``chat_share`` of them a request to repeat a passage (in
    the chat template), the rest a passage followed by its first line or sentence again,
    for the target to go on copying. ``NATURAL_SHARE`` of the passages are drawn from
    ``natural`` (``natural_passages``) where it has any, the rest built (``passage``). A
    prompt longer than ``max_len`` tokens is drawn again (cutting it would cut the request
    or the chat template's start); ``ValueError`` where 100 draws in a row are all too long."""
    out: list[list[int]] = []
    misses = 0
    while len(out) < n:
        ids = _one(tokenizer, words, rng, chat_share, natural)
        if max_len is None or len(ids) <= max_len:
            out.append(ids)
            misses = 0
        elif (misses := misses + 1) >= 100:
            raise ValueError(f"no copy prompt fits in {max_len} tokens")
    return out


def _one(
    tokenizer: Tokenizer,
    words: list[str],
    rng: random.Random,
    chat_share: float,
    natural: list[str] | None,
) -> list[int]:
    mine = natural and rng.random() < NATURAL_SHARE
    text = rng.choice(natural) if natural and mine else passage(rng, words)
    if rng.random() < chat_share and tokenizer.has_chat_template:
        plain = [t.strip(".,;|:") for t in text.split() if t.strip(".,;|:").isalpha()]
        old = rng.choice(plain or ["the"])
        ask = rng.choice(_ASKS).format(p=text, old=old, new=rng.choice(words))
        return tokenizer.encode(tokenizer.apply_chat([{"role": "user", "content": ask}]))
    first = text.split("\n")[0] if "\n" in text else text.split(". ")[0]
    cut = first[: rng.randint(max(1, len(first) // 3), len(first))]
    return tokenizer.encode(f"{text}\n\n{cut}")
