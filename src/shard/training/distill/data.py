"""Training text for ``shard.training.distill.build``, labelled by the target: its own samples, and
code.

A distilled draft should agree with the target on what the target writes, so most training
text is the target's own sampled continuations (on-policy for the target) of varied seed
prompts — chat-templated requests and plain openings about code, prose, lists and facts. The
rest is Python standard-library source, read from disk (no downloads).

Every position carries a label: the target's final normed hidden state ``h`` ``[D]``. The
target's logits there are ``h @ E.T`` (``E`` the tied embedding, which the draft shares), so
the loss can recompute any logit it needs without storing ``[V]``-wide rows. Sampling and
labelling are one pass: the hidden state that chooses a sampled token is its predecessor's
label. Sequences in a sampling batch are left-padded; a per-row key mask hides the padding and
rotary embeddings are relative, so a row's shift does not change what it computes.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from shard.model.kvcache import KVCache
from shard.model.llama import Attention, Block, StageModel, apply_rotary
from shard.model.tokenizer import Tokenizer

__all__ = [
    "Corpus",
    "build_corpus",
    "hidden_states",
    "labelled_code",
    "labelled_samples",
    "seed_prompts",
]

_CODE_SHARE = 0.2  # of training rows: standard-library code
_SAMPLE_BATCH = 64  # rows sampled at once: one-token steps are memory-bound, so batch wide
_CODE_BATCH = 16  # rows of code labelled at once
_TEMPERATURES = (0.8, 0.9, 1.0)

_TASKS = (
    "Write a Python function that {code}.",
    "Explain how to {code} in Python, with a short example.",
    "Explain {topic} in simple terms.",
    "List five facts about {topic}.",
    "Write a short story about {thing}.",
    "Give three tips for {activity}.",
    "What is {topic}? Answer in two sentences.",
    "Write a haiku about {thing}.",
    "Summarize the main ideas of {topic} as a bulleted list.",
    "Compare {topic} and {topic2} briefly.",
)
_OPENINGS = (
    "def {name}(",
    "# {Topic}\n\n",
    "The history of {topic} begins",
    "Q: What is {topic}?\nA:",
    "Here are some tips for {activity}:\n1.",
    "Once upon a time, {thing}",
    "import ",
    'class {Name}:\n    """',
)
_WORDS = {
    "code": (
        "reverses a string",
        "parses a CSV file",
        "counts word frequencies",
        "merges two sorted lists",
        "checks whether a number is prime",
        "reads a JSON config",
        "computes a moving average",
        "finds duplicates in a list",
        "validates an email address",
        "flattens a nested list",
    ),
    "topic": (
        "photosynthesis",
        "the French Revolution",
        "machine learning",
        "black holes",
        "the water cycle",
        "climate change",
        "the human immune system",
        "supply and demand",
        "plate tectonics",
        "the Roman Empire",
        "vaccines",
        "renewable energy",
    ),
    "thing": (
        "a lonely robot",
        "the sea at night",
        "an old bookshop",
        "a mountain village",
        "autumn leaves",
        "a cat and a dog",
        "a city in the rain",
    ),
    "activity": (
        "learning a new language",
        "staying healthy",
        "saving money",
        "writing clean code",
        "public speaking",
        "sleeping well",
        "studying for exams",
    ),
    "name": ("load_data", "parse_args", "fetch_items", "normalize", "train_model", "main"),
}


def seed_prompts(tokenizer: Tokenizer, n: int, rng: random.Random) -> list[list[int]]:
    """``n`` varied prompts as token ids: about two thirds chat requests, one third plain text."""

    def fill(template: str) -> str:
        topic, topic2 = rng.sample(_WORDS["topic"], 2)
        name = rng.choice(_WORDS["name"])
        return template.format(
            code=rng.choice(_WORDS["code"]),
            topic=topic,
            topic2=topic2,
            Topic=topic.capitalize(),
            thing=rng.choice(_WORDS["thing"]),
            activity=rng.choice(_WORDS["activity"]),
            name=name,
            Name="".join(p.capitalize() for p in name.split("_")),
        )

    out = []
    for i in range(n):
        if i % 3 < 2:
            text = tokenizer.apply_chat([{"role": "user", "content": fill(rng.choice(_TASKS))}])
        else:
            text = fill(rng.choice(_OPENINGS))
        out.append(tokenizer.encode(text))
    return out


@attrs.frozen
class Corpus:
    """Right-padded training rows: ids ``[N, S]``, labels ``[N, S, D]``, loss mask ``[N, S]``."""

    ids: Tensor
    labels: Tensor
    valid: Tensor

    @classmethod
    def concat(cls, parts: list[Corpus]) -> Corpus:
        return cls(
            torch.cat([p.ids for p in parts]),
            torch.cat([p.labels for p in parts]),
            torch.cat([p.valid for p in parts]),
        )

    @property
    def tokens(self) -> int:
        """Labelled positions (those the loss sees)."""
        return int(self.valid.sum())


def build_corpus(
    target: StageModel,
    tokenizer: Tokenizer,
    rows: int,
    seq_len: int,
    seed: int,
    budget_s: float | None,
    progress: bool,
) -> Corpus:
    """Up to ``rows`` labelled rows of ``seq_len``: the target's samples of ``seed_prompts``
    and at most ``_CODE_SHARE`` standard-library code; fewer once ``budget_s`` is spent."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    began = time.perf_counter()
    parts: list[Corpus] = []
    made = code = 0
    total = rows if budget_s is None else None  # a budget usually ends it well before ``rows``
    bar = tqdm(total=total, desc="labelling text", unit="row", disable=not progress)
    while made < rows and (not parts or budget_s is None or time.perf_counter() - began < budget_s):
        if code + _CODE_BATCH <= _CODE_SHARE * (made + _CODE_BATCH):
            n = min(_CODE_BATCH, rows - made)
            parts.append(labelled_code(target, tokenizer, rows=n, seq_len=seq_len, rng=rng))
            code += n
        else:
            n = min(_SAMPLE_BATCH, rows - made)
            prompts = [p[-(seq_len // 2) :] for p in seed_prompts(tokenizer, n, rng)]
            parts.append(
                labelled_samples(
                    target,
                    prompts,
                    seq_len=seq_len,
                    temperature=rng.choice(_TEMPERATURES),
                    stop_ids=tokenizer.eos_ids,
                    generator=gen,
                )
            )
        made += n
        bar.update(n)
    bar.close()
    return Corpus.concat(parts)


def hidden_states(model: StageModel, ids: Tensor) -> Tensor:
    """The final normed hidden ``[B, S, D]`` of a whole model on ids ``[B, S]`` from position 0.

    A cache-free, autograd-capable forward through the same modules (``StageModel.forward``
    is ``no_grad`` and writes a KV cache): the training path for the draft and the batched
    labelling path for the target. Logits are ``hidden @ lm_head.weight.T``.
    """
    assert model.embed_tokens is not None and model.norm is not None
    s = ids.shape[1]
    model.cover_positions(s)
    h = model.embed_tokens(ids)  # [B, S, D]
    rope = (model.rope_cos[:s].to(h.dtype), model.rope_sin[:s].to(h.dtype))  # [S, Dh/2] each
    mask = _causal(s, model.config.sliding_window)  # [S, S]
    for layer in model.layers:
        assert isinstance(layer, Block)
        h = _block(layer, h, rope, mask)
    out: Tensor = model.norm(h)
    return out


def _block(layer: Block, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
    """``Block.forward`` without a KV cache: attention over this call's positions only."""
    attn, (b, s, _) = layer.self_attn, h.shape
    if not isinstance(attn, Attention):
        raise ValueError("distilling a draft needs grouped-query attention, not MLA")
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(b, s, attn.n_heads, -1).transpose(1, 2)  # [B, H, S, Dh]
    k = attn.k_proj(x).view(b, s, attn.n_kv_heads, -1).transpose(1, 2)  # [B, KV, S, Dh]
    v = attn.v_proj(x).view(b, s, attn.n_kv_heads, -1).transpose(1, 2)  # [B, KV, S, Dh]
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    gqa = attn.n_heads != attn.n_kv_heads
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=attn.head_dim**-0.5, enable_gqa=gqa
    )  # [B, H, S, Dh]
    h = h + attn.o_proj(y.transpose(1, 2).reshape(b, s, -1))  # [B, S, D]
    out: Tensor = h + layer.mlp(layer.post_attention_layernorm(h))
    return out


def _causal(s: int, window: int | None) -> Tensor:
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]  # [S, S]: query i sees key j <= i
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    return mask


def labelled_samples(
    target: StageModel,
    prompts: list[list[int]],
    *,
    seq_len: int,
    temperature: float,
    stop_ids: tuple[int, ...],
    generator: torch.Generator,
) -> Corpus:
    """Sample each prompt's continuation to ``seq_len`` tokens in one batch; label every position.

    Positions after a row's first stop token (EOS) are masked out of the loss.
    """
    b, p = len(prompts), max(len(x) for x in prompts)
    if p >= seq_len:
        raise ValueError(f"prompts of {p} tokens leave no room in seq_len {seq_len}")
    ids = torch.zeros(b, seq_len, dtype=torch.long)
    real = torch.zeros(b, seq_len, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, p - len(prompt) : p] = torch.tensor(prompt)
        real[r, p - len(prompt) :] = True
    # Pad queries also see themselves, so no attention row is empty (that would give NaN).
    causal = _causal(seq_len, target.config.sliding_window)  # [S, S]
    mask = (causal & real[:, None, :]) | torch.eye(seq_len, dtype=torch.bool)  # [B, S, S]
    mask = mask[:, None]  # [B, 1, S, S]
    labels = torch.zeros(b, seq_len, target.config.hidden_size)
    cache = target.new_cache(seq_len, batch=b)
    with torch.inference_mode():
        labels[:, :p] = _step(target, ids[:, :p], 0, cache, mask[:, :, :p, :p])
        for t in range(p, seq_len):
            logits = _head(target, labels[:, t - 1])  # [B, V]
            ids[:, t] = _sample(logits / temperature, generator)
            labels[:, t] = _step(
                target, ids[:, t : t + 1], t, cache, mask[:, :, t : t + 1, : t + 1]
            )[:, 0]
    valid = real.clone()
    for r in range(b):
        stops = [t for t in range(p, seq_len) if int(ids[r, t]) in stop_ids]
        if stops:
            valid[r, stops[0] :] = False  # the label at stops[0] - 1 predicts the stop: kept
    return _left_to_right(ids, labels, valid, [p - len(x) for x in prompts])


def labelled_code(
    target: StageModel, tokenizer: Tokenizer, *, rows: int, seq_len: int, rng: random.Random
) -> Corpus:
    """``rows`` windows of ``seq_len`` tokens of standard-library Python, labelled in batches."""
    ids = torch.tensor([next(_code_windows(tokenizer, seq_len, rng)) for _ in range(rows)])
    labels = torch.empty(rows, seq_len, target.config.hidden_size)
    with torch.inference_mode():
        for i in range(0, rows, 8):
            labels[i : i + 8] = hidden_states(target, ids[i : i + 8])
    return Corpus(ids, labels, torch.ones(rows, seq_len, dtype=torch.bool))


def _code_windows(tokenizer: Tokenizer, seq_len: int, rng: random.Random) -> Iterator[list[int]]:
    """Random ``seq_len``-token windows of random ``.py`` files under the running stdlib."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    files = sorted(f for f in root.glob("*.py") if f.stat().st_size > 4096)
    if not files:
        raise FileNotFoundError(f"no Python standard-library sources under {root}")
    while True:
        ids = tokenizer.encode(rng.choice(files).read_text(encoding="utf-8", errors="replace"))
        if len(ids) > seq_len:
            start = rng.randrange(len(ids) - seq_len)
            yield ids[start : start + seq_len]


def _sample(logits: Tensor, generator: torch.Generator) -> Tensor:
    """One draw per row of ``softmax(logits)`` ``[B, V]`` by inverting the CDF: a fifth of the
    cost of ``torch.multinomial``, which draws an exponential for every entry."""
    cdf = torch.softmax(logits, dim=-1).cumsum(-1)  # [B, V]
    u = torch.rand(logits.shape[0], 1, generator=generator) * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=logits.shape[1] - 1)


def _head(model: StageModel, h: Tensor) -> Tensor:
    """fp32 logits of ``h`` (fp32 labels) through ``model``'s head, in its dtype."""
    assert model.lm_head is not None
    out: Tensor = model.lm_head(h.to(model.dtype))
    return out.float()


def _step(model: StageModel, ids: Tensor, start: int, cache: KVCache, mask: Tensor) -> Tensor:
    """One cached forward with an explicit ``[B, 1, S, start+S]`` mask: the normed hidden."""
    assert model.embed_tokens is not None and model.norm is not None
    s = ids.shape[1]
    h = model.embed_tokens(ids)  # [B, S, D]
    rope = (
        model.rope_cos[start : start + s].to(h.dtype),
        model.rope_sin[start : start + s].to(h.dtype),
    )
    for j, layer in enumerate(model.layers):
        h = layer(h, rope, mask, cache, j, start)
    out: Tensor = model.norm(h)
    return out


def _left_to_right(ids: Tensor, labels: Tensor, valid: Tensor, pads: list[int]) -> Corpus:
    """Move each row's ``pads`` positions of left padding to its right end (then causal rows
    need no key mask)."""
    for r, pad in enumerate(pads):
        ids[r] = ids[r].roll(-pad)
        labels[r] = labels[r].roll(-pad, dims=0)
        valid[r] = valid[r].roll(-pad)
    return Corpus(ids, labels, valid)
