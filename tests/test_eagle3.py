"""EAGLE-3 heads in their published layout: loading (every malformed file refused with an
``Eagle3Error``), the forward against an independent reference written here from the
published description, drafting through ``HeadProposer``, and speculation with the head
staying lossless.

Everything runs on tiny random checkpoints (an 8-layer target, a head written as SpecForge
writes one), in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from shard.decode.head.eagle3 import Eagle3Head
from shard.decode.head.eagle3_check import target_states
from shard.decode.head.eagle3_files import Eagle3Config, Eagle3Error, default_layers, expected
from shard.decode.head.proposer import HeadProposer
from shard.decode.reference import generate_reference
from shard.decode.verify import verify_chunk
from shard.messages import Sampling
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.testing.eagle3 import eagle3_config, write_eagle3_head

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LAYERS = 8  # default_layers(8) = (2, 4, 5)


@pytest.fixture
def target(tiny_checkpoint: Callable[..., Path]) -> StageModel:
    return load_stage(tiny_checkpoint(n_layers=LAYERS), 0, LAYERS)


def head_config(target: StageModel, **kw: Any) -> dict[str, Any]:
    c = target.config
    draft_vocab = kw.pop("draft_vocab_size", c.vocab_size // 2)
    return eagle3_config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, draft_vocab_size=draft_vocab, **kw
    )


def written(target: StageModel, path: Path, **kw: Any) -> Path:
    """A random head for ``target`` in the published layout, its embedding the target's."""
    config = head_config(target, **kw.pop("config", {}))
    assert target.embed_tokens is not None
    return write_eagle3_head(path, config, embedding=target.embed_tokens.weight, **kw)


# -- an independent reference, from the published description --------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def _rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout, ``x`` ``[H, S, Dh]`` at positions 0..S-1."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dh, 2).float() / dh)
    angles = torch.arange(x.shape[1]).float()[:, None] * inv[None, :]  # [S, Dh/2]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half = torch.cat((-x[..., dh // 2 :], x[..., : dh // 2]), dim=-1)
    return x * cos + half * sin


def reference_g(
    t: dict[str, torch.Tensor], cfg: dict[str, Any], u: torch.Tensor, nxt: torch.Tensor
) -> torch.Tensor:
    """The midlayer over inputs ``u`` ``[S, D]`` (fused or chained) and next tokens ``[S]``:
    the chained states ``[S, D]``, causal attention from position 0."""
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    s, dh = u.shape[0], cfg["hidden_size"] // h
    p = "midlayer."
    x = torch.cat(
        (
            _rms(t["embed_tokens.weight"][nxt], t[p + "input_layernorm.weight"]),
            _rms(u, t[p + "hidden_norm.weight"]),
        ),
        dim=-1,
    )  # [S, 2D]: the embedding first
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(s, h, dh).transpose(0, 1)  # [H, S, Dh]
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(s, kv, dh).transpose(0, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(s, kv, dh).transpose(0, 1)
    q, k = _rotate(q, cfg["rope_theta"]), _rotate(k, cfg["rope_theta"])
    k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)  # [H, S, Dh]
    scores = q @ k.transpose(1, 2) / dh**0.5
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, h * dh)
    residual = _rms(u, t[p + "hidden_norm.weight"]) if cfg.get("norm_before_residual") else u
    r = residual + att @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(r, t[p + "post_attention_layernorm.weight"])
    gate, up = m @ t[p + "mlp.gate_proj.weight"].T, m @ t[p + "mlp.up_proj.weight"].T
    return r + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T


def reference_draft(t: dict[str, torch.Tensor], g: torch.Tensor) -> int:
    """The target id the reference drafts from one chained state ``[D]``."""
    d = int((_rms(g, t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
    return d + int(t["d2t"][d])


def reference_chain(
    t: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    states: torch.Tensor,
    context: list[int],
    k: int,
) -> list[int]:
    """``k`` greedy drafts after ``context`` (``x_0..x_m``) from the target's states at
    positions ``0..m-1``, each further one chained on the previous chained state."""
    m = len(context) - 1
    u = states[:m] @ t["fc.weight"].T  # [m, D]
    tokens = list(context)
    out: list[int] = []
    for _ in range(k):
        g = reference_g(t, cfg, u, torch.tensor(tokens[1 : len(u) + 1]))
        out.append(reference_draft(t, g[-1]))
        tokens.append(out[-1])
        u = torch.cat((u, g[-1:]))  # g_{t-1} stands in at the next position
    return out


# -- tests --------------------------------------------------------------------------------


def test_the_published_layout_loads(target: StageModel, tmp_path: Path) -> None:
    """A head as SpecForge writes it loads: names, config keys, ``d2t``/``t2d``, layers."""
    path = written(target, tmp_path / "h", config={"layer_ids": [2, 4, 5]})
    names = set(load_file(str(path / "model.safetensors")))
    config = Eagle3Config.from_json(json.loads((path / "config.json").read_text()))
    assert names == set(expected(config))
    head = Eagle3Head.load(path)
    assert (
        head.config.layer_ids == (2, 4, 5)
        and head.config.draft_vocab == target.config.vocab_size // 2
    )
    assert head.feature_dim == 3 * target.config.hidden_size
    used = head.to_vocab(torch.arange(head.config.draft_vocab))
    assert bool(head.t2d[used].all()) and int(head.t2d.sum()) == head.config.draft_vocab
    head.config.check_target(target.config)
    assert default_layers(LAYERS) == (2, 4, 5)


@pytest.mark.parametrize("before", [False, True], ids=["specforge", "norm-before-residual"])
def test_forward_is_the_reference(target: StageModel, tmp_path: Path, before: bool) -> None:
    """The forward, in one call and through the KV cache in pieces, is the reference's (with
    the residual taken before ``hidden_norm``, as SpecForge trains, or after it, vLLM's
    ``norm_before_residual``)."""
    extra = {"norm_before_residual": True} if before else {}
    config = {**head_config(target), **extra}
    assert target.embed_tokens is not None
    path = write_eagle3_head(tmp_path / "h", config, embedding=target.embed_tokens.weight)
    head = Eagle3Head.load(path)
    t, cfg = (
        load_file(str(path / "model.safetensors")),
        json.loads((path / "config.json").read_text()),
    )
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(12, head.feature_dim, generator=gen)
    nxt = torch.randint(0, target.config.vocab_size, (12,), generator=gen)
    want = reference_g(t, cfg, states @ t["fc.weight"].T, nxt)
    torch.testing.assert_close(head(states[None], nxt[None])[0], want, atol=1e-5, rtol=1e-5)
    cache = head.new_cache(32)
    parts = [
        head.step(states[None, a:b], nxt[None, a:b], a, cache)[0]
        for a, b in ((0, 5), (5, 6), (6, 12))
    ]
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-5, rtol=1e-5)


def test_the_proposer_drafts_the_reference_chain(target: StageModel, tmp_path: Path) -> None:
    """``HeadProposer`` over the head drafts what the reference chains, from real states."""
    path = written(target, tmp_path / "h", seed=4)
    head = Eagle3Head.load(path)
    t, cfg = (
        load_file(str(path / "model.safetensors")),
        json.loads((path / "config.json").read_text()),
    )
    ids = torch.randint(
        0, target.config.vocab_size, (20,), generator=torch.Generator().manual_seed(5)
    )
    states, _ = target_states(target, ids, default_layers(LAYERS))
    proposer = HeadProposer(head, max_len=64)
    assert proposer.name == "eagle3" and proposer.features == 64
    context = ids.tolist()
    proposer.observe(0, states[:19])
    assert proposer.propose(context, 4) == reference_chain(t, cfg, states, context, 4)
    shorter = context[:12]  # a rollback: fewer observed positions matter, same rule
    proposer.observe(0, states[:11])
    assert proposer.propose(shorter, 3) == reference_chain(t, cfg, states, shorter, 3)


def test_sampled_drafts_come_from_the_draft_vocabulary(target: StageModel, tmp_path: Path) -> None:
    """Sampling draws each token from the head's q, whose ids are target ids of the draft
    vocabulary (mapped by ``d2t``), and the same generator state draws the same."""
    head = Eagle3Head.load(written(target, tmp_path / "h", seed=6))
    ids = torch.randint(
        0, target.config.vocab_size, (16,), generator=torch.Generator().manual_seed(8)
    )
    states, _ = target_states(target, ids, default_layers(LAYERS))
    proposer = HeadProposer(head, max_len=64)
    proposer.observe(0, states[:15])
    draws = [
        proposer.propose_sampled(ids.tolist(), 3, torch.Generator().manual_seed(2), 0.8)
        for _ in range(2)
    ]
    assert draws[0][0] == draws[1][0] and len(draws[0][0]) == 3
    for token, (q_ids, probs) in zip(*draws[0], strict=True):
        assert token in q_ids.tolist() and bool(head.t2d[q_ids].all())
        assert abs(float(probs.sum()) - 1.0) < 1e-5


def test_the_embedding_may_come_from_the_target(target: StageModel, tmp_path: Path) -> None:
    """A head saved without ``embed_tokens`` (as SpecForge saves it) needs the target's."""
    assert target.embed_tokens is not None
    emb = target.embed_tokens.weight
    path = written(target, tmp_path / "h", with_embedding=False)
    with pytest.raises(Eagle3Error, match="embed_tokens"):
        Eagle3Head.load(path)
    with pytest.raises(Eagle3Error, match="embed_tokens"):
        Eagle3Head.load(path, embedding=emb[:, :8])
    head = Eagle3Head.load(path, embedding=emb)
    full = Eagle3Head.load(written(target, tmp_path / "full"))
    torch.testing.assert_close(head.embed_tokens.weight, full.embed_tokens.weight)


def test_a_bfloat16_file_loads_in_the_asked_dtype(target: StageModel, tmp_path: Path) -> None:
    """Published heads are bf16 or fp16: read in, computed in the dtype asked for."""
    path = written(target, tmp_path / "h", dtype=torch.bfloat16)
    assert Eagle3Head.load(path).fc.weight.dtype == torch.float32
    assert Eagle3Head.load(path, dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t[name]

    return edit


def _add(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = value

    return edit


def _set(
    name: str, value: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = value(t[name])

    return edit


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _swap(d2t: torch.Tensor) -> torch.Tensor:
    out = d2t.clone()
    out[1] = out[0] - 1  # draft id 1 now maps where draft id 0 does
    return out


DAMAGED_TENSORS = {
    "a tensor missing": _drop("midlayer.hidden_norm.weight"),
    "d2t missing with a reduced vocabulary": _drop("d2t"),
    "a tensor no head has": _add("midlayer.self_attn.q_norm.weight", torch.ones(4)),
    "a wrong shape": _set("fc.weight", lambda w: w[:, :-1].contiguous()),
    "the attention input one hidden wide": _set(
        "midlayer.self_attn.q_proj.weight", lambda w: w[:, : w.shape[1] // 2].contiguous()
    ),
    "an integer weight": _set("norm.weight", lambda w: w.to(torch.int32)),
    "a float d2t": _set("d2t", lambda d: d.float()),
    "d2t outside the vocabulary": _set("d2t", lambda d: d + 10_000),
    "two draft ids for one token": _set("d2t", _swap),
    "t2d disagreeing with d2t": _set("t2d", lambda m: m.roll(1)),
    "a NaN weight": _set("lm_head.weight", _nan),
}


#: What each refusal says (a part of its message): the right check caught it.
REASONS = {
    "a tensor missing": "missing midlayer.hidden_norm",
    "d2t missing with a reduced vocabulary": "needs d2t",
    "a tensor no head has": "not in an EAGLE-3 head",
    "a wrong shape": "fc.weight has shape",
    "the attention input one hidden wide": "q_proj.weight has shape",
    "an integer weight": "norm.weight is I32",
    "a float d2t": "d2t is F32",
    "d2t outside the vocabulary": "outside the vocabulary",
    "two draft ids for one token": "two draft ids to one token",
    "t2d disagreeing with d2t": "t2d does not mark",
    "a NaN weight": "NaN",
    "not an EAGLE-3 architecture": "not an EAGLE-3 head",
    "two layers": "a head of 2 layers",
    "another activation": "only silu",
    "a draft vocabulary larger than the vocabulary": "draft_vocab_size",
    "a negative draft vocabulary": "draft_vocab_size",
    "layer ids not increasing": "strictly increasing",
    "layer ids not integers": "strictly increasing",
    "a broken Llama field": "num_attention_heads",
}


@pytest.mark.parametrize("damage", list(DAMAGED_TENSORS))
def test_damaged_weights_are_refused(target: StageModel, tmp_path: Path, damage: str) -> None:
    """Every malformed tensor file is an ``Eagle3Error`` naming the problem, never a crash."""
    path = written(target, tmp_path / "h")
    tensors = load_file(str(path / "model.safetensors"))
    DAMAGED_TENSORS[damage](tensors)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(Eagle3Error, match=REASONS[damage]):
        Eagle3Head.load(path)


DAMAGED_CONFIGS: dict[str, Callable[[dict[str, Any]], None]] = {
    "not an EAGLE-3 architecture": lambda c: c.update(architectures=["LlamaForCausalLM"]),
    "two layers": lambda c: c.update(num_hidden_layers=2),
    "another activation": lambda c: c.update(hidden_act="gelu"),
    "a draft vocabulary larger than the vocabulary": lambda c: c.update(draft_vocab_size=10**6),
    "a negative draft vocabulary": lambda c: c.update(draft_vocab_size=-1),
    "layer ids not increasing": lambda c: c.update(eagle_aux_hidden_state_layer_ids=[4, 2, 5]),
    "layer ids not integers": lambda c: c.update(eagle_aux_hidden_state_layer_ids=["2", 4, 5]),
    "a broken Llama field": lambda c: c.update(num_attention_heads=0),
}


@pytest.mark.parametrize("damage", list(DAMAGED_CONFIGS))
def test_damaged_configs_are_refused(target: StageModel, tmp_path: Path, damage: str) -> None:
    """Every malformed ``config.json`` is an ``Eagle3Error``."""
    path = written(target, tmp_path / "h")
    config = json.loads((path / "config.json").read_text())
    DAMAGED_CONFIGS[damage](config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Eagle3Error, match=REASONS[damage]):
        Eagle3Head.load(path)


def test_unreadable_files_are_refused(target: StageModel, tmp_path: Path) -> None:
    """No directory, no weights, weights that are not safetensors, config not JSON."""
    with pytest.raises(Eagle3Error):
        Eagle3Head.load(tmp_path / "nothing")
    path = written(target, tmp_path / "h")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(Eagle3Error):
        Eagle3Head.load(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(Eagle3Error):
        Eagle3Head.load(path)
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04")  # a pickle is never opened
    with pytest.raises(Eagle3Error, match="pickle"):
        Eagle3Head.load(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(Eagle3Error):
        Eagle3Head.load(path)


def test_a_head_for_another_target_is_refused(target: StageModel, tmp_path: Path) -> None:
    """Another vocabulary, another width, or layers the target lacks: ``check_target`` says so."""
    head = Eagle3Head.load(written(target, tmp_path / "h", config={"layer_ids": [2, 4, 9]}))
    with pytest.raises(Eagle3Error, match="layers"):
        head.config.check_target(target.config)
    c = head_config(target, target_hidden_size=32)
    other = write_eagle3_head(tmp_path / "w", c)
    with pytest.raises(Eagle3Error, match="width"):
        Eagle3Head.load(other).config.check_target(target.config)


# -- speculation with the head is lossless --------------------------------------------------


def speculate(
    target: StageModel, head: Eagle3Head, prompt: Sequence[int], n: int, k: int
) -> tuple[list[int], int, int]:
    """Greedy speculative decoding in one process: each lap the head (through
    ``HeadProposer``) sees the target's states at the committed inputs, drafts ``k``, and the
    target's logits over the chunk decide (``verify_chunk``). Returns the ``n`` new tokens,
    the drafted and the accepted counts."""
    layers = head.config.layers_for(target.config.n_layers)
    proposer = HeadProposer(head, max_len=len(prompt) + n + k + 1)
    context = list(prompt)
    drafted = accepted = 0
    while len(context) < len(prompt) + n:
        ids = torch.tensor(context)
        states, _ = target_states(target, ids[:-1], layers)  # inputs 0..m-1 ran through it
        proposer.observe(0, states)
        draft = proposer.propose(context, k)
        chunk = torch.tensor([context + draft])
        logits = target(chunk, 0, target.new_cache(chunk.shape[1]))[0, len(context) - 1 :]
        verdict = verify_chunk(logits, draft, Sampling(), len(context))
        drafted, accepted = drafted + len(draft), accepted + verdict.accepted
        context += list(verdict.target_ids)
    return context[len(prompt) : len(prompt) + n], drafted, accepted


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_with_a_random_head_is_lossless(
    target: StageModel, tmp_path: Path, k: int
) -> None:
    """Whatever a random head drafts, the output is the plain greedy reference's."""
    head = Eagle3Head.load(written(target, tmp_path / "h", seed=7))
    prompt = [5, 17, 33, 2, 9, 41]
    out, drafted, _ = speculate(target, head, prompt, 16, k)
    assert out == plain_greedy(target, prompt, 16) and drafted > 0


def plain_greedy(target: StageModel, prompt: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens, one target forward over the whole context per token (the same
    arithmetic ``speculate`` verifies with), checked against ``generate_reference``."""
    context = list(prompt)
    for _ in range(n):
        chunk = torch.tensor([context])
        context.append(int(target(chunk, 0, target.new_cache(len(context)))[0, -1].argmax()))
    out = context[len(prompt) :]
    ref = generate_reference(target, prompt, max_tokens=n, eos_ids=[], max_len=len(prompt) + n)
    assert out == list(ref.token_ids)
    return out
