"""``draft = "mtp"``: a checkpoint's own MTP block (``shard.decode.head.mtp``) as the drafter.

transformers builds no MTP block (its models skip those tensors), so the test checkpoints are
the family fixtures' tiny GLM-4.5 and DeepSeek-V3 with a block added in the published layout:
``model.layers.{L}.*`` taken from transformers' own model of ``L + 1`` layers (the decoder
layer under its usual names), plus random ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.{norm,head}`` and ``embed_tokens``. The reference for the block's forward is
transformers' decoder layer of that model, run on the same inputs, with the norms and
projection written out here from the formula vLLM serves (embedding first, zeroed at position
0) — independent of shard's loader and attention.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

import family_fixtures
from shard.cli.errors import operator_errors
from shard.coordinator.coordinator import Completion, Coordinator
from shard.decode.control import SpeculationConfig
from shard.decode.head.mtp import MtpError, MtpHead, has_mtp_block, mtp_layers
from shard.decode.head.proposer import HeadProposer
from shard.decode.tail import TailProposer
from shard.model.config import ModelConfig
from shard.model.fp8 import dequantize_fp8, quantize_fp8
from shard.nodes.defaults import with_checkpoint_defaults
from shard.nodes.drafter import make_drafter
from shard.spec.swarm import SwarmSpec
from shard.spec.validate import SpecError
from test_speculation_ring import reference, spec_for, with_ring

transformers = pytest.importorskip("transformers")
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["glm4_moe", "deepseek_v3"]
PROMPT = [5, 77, 101, 60, 33, 8, 99, 42, 42, 7, 3, 5, 77, 101]
MAX_TOKENS = 24
ATOL = 1e-4


def _hf_model(model_dir: Path, n_layers: int, seed: int) -> Any:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = n_layers
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    family_fixtures._redraw(model, config.model_type, torch.Generator().manual_seed(seed))
    return model


def with_mtp_block(src: Path, dst: Path, *, seed: int = 7) -> Path:
    """``src`` (a family fixture) copied to ``dst`` with one MTP block in the published
    layout and ``num_nextn_predict_layers = 1``."""
    shutil.copytree(src, dst)
    n = ModelConfig.from_dir(src).n_layers
    bigger = _hf_model(src, n + 1, seed)  # its layer n is the block's decoder layer
    layer = f"model.layers.{n}."
    tensors = load_file(dst / "model.safetensors")
    bigger.save_pretrained(dst / "bigger")  # the published names (per-expert weights)
    saved = load_file(dst / "bigger" / "model.safetensors")
    shutil.rmtree(dst / "bigger")
    tensors |= {k: v for k, v in saved.items() if k.startswith(layer)}
    gen = torch.Generator().manual_seed(seed + 1)
    d, v = bigger.config.hidden_size, bigger.config.vocab_size
    extra = {
        "enorm.weight": 1.0 + 0.1 * torch.randn(d, generator=gen),
        "hnorm.weight": 1.0 + 0.1 * torch.randn(d, generator=gen),
        "eh_proj.weight": torch.randn(d, 2 * d, generator=gen) * (2 * d) ** -0.5,
        "shared_head.norm.weight": 4.0 * (1.0 + 0.1 * torch.randn(d, generator=gen)),
        "shared_head.head.weight": torch.randn(v, d, generator=gen) * 0.1,
        "embed_tokens.weight": torch.randn(v, d, generator=gen) * 0.1,
    }
    tensors |= {layer + k: t for k, t in extra.items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def mtp_checkpoint(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            root = tmp_path_factory.mktemp("mtp")
            made[family] = with_mtp_block(family_checkpoint(family), root / family)
        return made[family]

    return get


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_logits(
    model_dir: Path, ids: list[int], scratch: Path, first: int = 0
) -> torch.Tensor:
    """The MTP block's logits at positions ``first..len(ids)-2`` (position ``t`` reads the
    target's final-norm output at ``t`` and the token ``ids[t+1]``; the block sees positions
    from ``first`` only), computed by transformers: the target itself, and the decoder layer
    ``L`` of the same files read as a model of ``L + 1`` layers (``scratch``: that copy)."""
    n = ModelConfig.from_dir(model_dir).n_layers
    target = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    shutil.copytree(model_dir, scratch)
    config = json.loads((scratch / "config.json").read_text())
    config["num_hidden_layers"] = n + 1
    (scratch / "config.json").write_text(json.dumps(config))
    block = transformers.AutoModelForCausalLM.from_pretrained(
        scratch, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    w = load_file(model_dir / "model.safetensors")
    p, eps = f"model.layers.{n}.", block.config.rms_norm_eps
    x = torch.tensor([ids])
    s = len(ids) - 1
    with torch.no_grad():
        h = target.model(input_ids=x).last_hidden_state[:, :s]  # final-norm output [1, S, D]
        e = torch.nn.functional.embedding(x[:, 1:], w[p + "embed_tokens.weight"])
        e[:, 0] = 0.0  # position 0
        e, h = _rms(e, w[p + "enorm.weight"], eps), _rms(h, w[p + "hnorm.weight"], eps)
        u = torch.cat((e, h), -1)
        u = (u @ w[p + "eh_proj.weight"].T)[:, first:]
        pos = torch.arange(first, s)[None]
        mask = torch.full((s - first, s - first), float("-inf")).triu(1)[None, None]
        rope = block.model.rotary_emb(u, pos)
        layer = block.model.layers[n]
        g = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        g = g[0] if isinstance(g, tuple) else g
        return _rms(g, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T


@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_computes_what_transformers_layer_computes(
    mtp_checkpoint: Callable[[str], Path], family: str, tmp_path: Path
) -> None:
    """``MtpHead.step`` over a prompt's final-norm features, and its readout, match the
    reference built from transformers' target and decoder layer (logits within ATOL, the
    same greedy drafts); fed in two calls (a cache, then one row) it gives the same rows."""
    model_dir = mtp_checkpoint(family)
    want = reference_logits(model_dir, PROMPT, tmp_path / "ref")[0]  # [S, V]
    target = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        h = target.model(input_ids=torch.tensor([PROMPT])).last_hidden_state
    head = MtpHead.load(model_dir)
    s = len(PROMPT) - 1
    ids = torch.tensor([PROMPT[1:]])
    cache = head.new_cache(64)
    got = head.logits(head.step(h[:, :s], ids, 0, cache))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    cache = head.new_cache(64)
    first = head.logits(head.step(h[:, : s - 1], ids[:, : s - 1], 0, cache))[0]
    last = head.logits(head.step(h[:, s - 1 : s], ids[:, s - 1 :], s - 1, cache))[0]
    torch.testing.assert_close(torch.cat((first, last)), want, rtol=0, atol=ATOL)


def test_a_block_fed_from_a_later_position_sees_nothing_before_it(
    mtp_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A session whose features start at position ``f`` (a long prompt's last window): the
    block attends to ``[f, t]`` only, as transformers' layer run on those positions does —
    the cache rows before ``f``, never written, take no part."""
    model_dir, f = mtp_checkpoint("glm4_moe"), 5
    want = reference_logits(model_dir, PROMPT, tmp_path / "ref", first=f)[0]
    target = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        h = target.model(input_ids=torch.tensor([PROMPT])).last_hidden_state
    head, s = MtpHead.load(model_dir), len(PROMPT) - 1
    g = head.step(h[:, f:s], torch.tensor([PROMPT[f + 1 :]]), f, head.new_cache(64), first=f)
    torch.testing.assert_close(head.logits(g)[0], want, rtol=0, atol=ATOL)


def mtp_spec(model_dir: Path, mtp_at: str | None = "tail") -> SwarmSpec:
    """The 3-stage tiny ring drafting with the MTP block at ``mtp_at`` (None: a spec that
    names no draft at all)."""
    spec = spec_for(model_dir, "none")
    if mtp_at is None:  # as a spec without [speculation] reads (test_a_spec_asks_for_mtp...)
        return attrs.evolve(spec, speculation=attrs.evolve(spec.speculation, given=False))
    plan = attrs.evolve(spec.speculation, draft="mtp", mtp_at=mtp_at, given=True)
    return attrs.evolve(spec, speculation=plan)


async def swarm_run(
    model_dir: Path, speculation: SpeculationConfig, mtp_at: str | None = "tail"
) -> Completion:
    spec = mtp_spec(model_dir, mtp_at)

    async def body(coordinator: Coordinator) -> Completion:
        prompt = list(PROMPT)
        return await coordinator.generate(prompt, max_tokens=MAX_TOKENS, speculation=speculation)

    done: Completion = await with_ring(spec, model_dir, body)
    return done


async def test_the_tail_drafts_what_the_coordinator_would(
    mtp_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``draft = "mtp"`` on GLM-4.5 through a 3-stage ring, the block at the tail (verdicts
    carry its drafts) and at the coordinator (fed the tail's features): both give exactly the
    single-process reference's tokens, and at depth 1 every draft is the same — each is read
    from the same committed rows and tokens. A tail feeding its block a token or a row one
    position off drafts other ids. (The random block's drafts are rarely accepted: the ids
    are compared, not the acceptance.)"""
    model_dir = mtp_checkpoint("glm4_moe")
    want = reference(model_dir, PROMPT, MAX_TOKENS).token_ids
    policy = SpeculationConfig(k=3, depth=1)
    drafts: dict[type, list[tuple[int, tuple[int, ...]]]] = {TailProposer: [], HeadProposer: []}
    real = {kind: kind.propose for kind in drafts}

    def recorder(kind: type) -> Callable[[Any, list[int], int], list[int]]:
        def recorded(self: Any, context: list[int], k: int) -> list[int]:
            out: list[int] = real[kind](self, context, k)
            drafts[kind].append((len(context), tuple(out)))
            return out

        return recorded

    for kind in drafts:
        monkeypatch.setattr(kind, "propose", recorder(kind))
    tail = await swarm_run(model_dir, policy, "tail")
    tail_drafts = list(drafts[TailProposer])
    drafts[HeadProposer].clear()  # the tail's own block proposed through one in that run
    coordinator = await swarm_run(model_dir, policy, "coordinator")
    assert tail.token_ids == want and coordinator.token_ids == want
    assert tail.stats.drafted > 0 and len(tail_drafts) == tail.stats.laps - 1  # one a verify
    assert all(len(ids) == 3 for _, ids in tail_drafts[:-1])
    # the same drafts; at the end the tail's block stops at the session's KV length, where
    # the coordinator's drafts past it are dropped unsent
    head = drafts[HeadProposer]
    assert tail_drafts[:-1] == head[:-1] and tail_drafts[-1][0] == head[-1][0]
    assert tail_drafts[-1][1] == head[-1][1][: len(tail_drafts[-1][1])]
    assert (tail.stats.drafted, tail.stats.accepted) == (
        coordinator.stats.drafted,
        coordinator.stats.accepted,
    )


async def test_a_spec_naming_no_draft_drafts_with_the_block_pipelined(
    mtp_checkpoint: Callable[[str], Path],
) -> None:
    """A spec that names no draft, over a checkpoint that holds an MTP block, drafts with it
    at the tail (``with_checkpoint_defaults``); two chunks in flight give the plain output."""
    model_dir = mtp_checkpoint("glm4_moe")
    done = await swarm_run(model_dir, SpeculationConfig(k=3, depth=2), mtp_at=None)
    assert done.token_ids == reference(model_dir, PROMPT, MAX_TOKENS).token_ids
    assert done.stats.drafted > 0 and done.stats.max_depth == 2


async def test_a_tail_without_the_block_serves_plainly(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """GLM-4.5's fixture declares a block it does not hold: with ``draft = "mtp"`` at the
    tail, the tail cannot load it (it says so in its log), serves the sessions without
    drafts, and the output is the plain output."""
    bare = family_checkpoint("glm4_moe")
    done = await swarm_run(bare, SpeculationConfig(k=3, depth=1))
    assert done.token_ids == reference(bare, PROMPT, MAX_TOKENS).token_ids
    assert done.stats.drafted == 0


def test_the_drafter_is_the_tail_or_a_head_proposer_named_mtp(
    mtp_checkpoint: Callable[[str], Path],
) -> None:
    model_dir = mtp_checkpoint("glm4_moe")
    drafter = make_drafter(mtp_spec(model_dir, "coordinator"), model_dir)
    assert drafter is not None
    proposer = drafter.session(PROMPT)
    assert isinstance(proposer, HeadProposer)
    assert proposer.name == "mtp" and proposer.features == 64 and proposer.feature_layers == ()
    drafter = make_drafter(mtp_spec(model_dir, "tail"), model_dir)
    assert drafter is not None
    tail = drafter.session(PROMPT)
    assert isinstance(tail, TailProposer)
    assert tail.name == "mtp" and tail.features == 0 and tail.tail_drafts == 16


def test_the_default_draft_is_the_block_only_where_it_is_held(
    mtp_checkpoint: Callable[[str], Path], family_checkpoint: Callable[[str], Path]
) -> None:
    """``with_checkpoint_defaults``: no draft named and a block held: mtp at the tail with
    k and depth "auto"; a draft named (even "none"), or a block only declared: unchanged."""
    held, bare = mtp_checkpoint("glm4_moe"), family_checkpoint("glm4_moe")
    assert has_mtp_block(held) and not has_mtp_block(bare)
    plan = with_checkpoint_defaults(mtp_spec(held, None), held).speculation
    assert plan.draft == "mtp" and plan.mtp_at_tail
    assert (plan.policy.k, plan.policy.depth) == (None, None)
    named = attrs.evolve(mtp_spec(held, None).speculation, given=True)
    spec = attrs.evolve(mtp_spec(held, None), speculation=named)
    assert with_checkpoint_defaults(spec, held).speculation.draft == "none"
    built = attrs.evolve(mtp_spec(held, None).speculation, draft="ngram")  # given False
    in_code = attrs.evolve(mtp_spec(held, None), speculation=built)
    assert with_checkpoint_defaults(in_code, held).speculation.draft == "ngram"
    assert with_checkpoint_defaults(mtp_spec(bare, None), bare).speculation.draft == "none"


def test_a_checkpoint_without_its_block_is_refused_before_the_swarm_starts(
    family_checkpoint: Callable[[str], Path], mtp_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """GLM-4.5's fixture declares one MTP block (transformers' default) but, saved by
    transformers, holds none of its tensors; a tensor of the wrong shape, a tensor missing and
    a bad ``num_nextn_predict_layers`` are refused too — each an ``MtpError`` naming it."""
    bare = family_checkpoint("glm4_moe")
    assert mtp_layers(bare) == 1
    with pytest.raises(MtpError, match=r"eh_proj\.weight is not in the checkpoint"):
        MtpHead.load(bare)
    with pytest.raises(MtpError):
        make_drafter(mtp_spec(bare, "coordinator"), bare)
    assert MtpError in operator_errors()

    good = mtp_checkpoint("glm4_moe")
    n = ModelConfig.from_dir(good).n_layers
    for name, change, why in [
        ("hnorm.weight", lambda t: t[:-1], "expected"),
        ("enorm.weight", None, "missing"),
        ("shared_head.norm.weight", lambda t: t.to(torch.int32), "not a float tensor"),
    ]:
        bad = tmp_path / name
        shutil.copytree(good, bad)
        tensors = load_file(bad / "model.safetensors")
        key = f"model.layers.{n}.{name}"
        if change is None:
            del tensors[key]
        else:
            tensors[key] = change(tensors[key]).contiguous()
        save_file(tensors, bad / "model.safetensors")
        with pytest.raises(MtpError, match=why):
            MtpHead.load(bad)
    for value in (-1, "1", 99):
        bad = tmp_path / f"n{value}"
        shutil.copytree(good, bad)
        config = json.loads((bad / "config.json").read_text())
        config["num_nextn_predict_layers"] = value
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(MtpError, match="num_nextn_predict_layers"):
            MtpHead.load(bad)
    no_block = tmp_path / "zero"
    shutil.copytree(good, no_block)
    config = json.loads((no_block / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (no_block / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpError, match="declares no MTP block"):
        MtpHead.load(no_block)


def test_an_fp8_projection_is_read_with_its_block_scales(
    mtp_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """DeepSeek's published blocks store ``eh_proj`` in FP8 with ``weight_scale_inv``: it is
    dequantized with the config's block; without its scales it is refused by name."""
    good = mtp_checkpoint("glm4_moe")
    n = ModelConfig.from_dir(good).n_layers
    key = f"model.layers.{n}.eh_proj.weight"
    fp8 = tmp_path / "fp8"
    shutil.copytree(good, fp8)
    tensors = load_file(fp8 / "model.safetensors")
    codes, scale = quantize_fp8(tensors[key], (16, 16))
    tensors |= {key: codes, f"{key}_scale_inv": scale}
    save_file(tensors, fp8 / "model.safetensors")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (fp8 / "config.json").write_text(json.dumps(config))
    head = MtpHead.load(fp8)
    assert torch.equal(head.eh_proj.weight, dequantize_fp8(codes, scale, (16, 16)))
    assert not torch.equal(head.eh_proj.weight, tensors[key].float())  # FP8 rounds
    del tensors[f"{key}_scale_inv"]
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(MtpError, match="FP8 without its"):
        MtpHead.load(fp8)


def test_a_spec_asks_for_mtp_without_a_head(mtp_checkpoint: Callable[[str], Path]) -> None:
    """``draft = "mtp"`` is a draft kind of its own; ``draft_head`` beside it is refused."""
    model_dir = mtp_checkpoint("glm4_moe")
    base = {
        "swarm": {"name": "m", "model": str(model_dir), "insecure": True},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "stage": [{"name": "s0", "listen": "127.0.0.1:9101", "layers": [0, 4]}],
    }
    ok = SwarmSpec.from_dict({**base, "speculation": {"draft": "mtp"}})
    assert ok.speculation.draft == "mtp" and ok.speculation.draft_head is None
    assert ok.speculation.mtp_at_tail and ok.speculation.given
    there = SwarmSpec.from_dict({**base, "speculation": {"draft": "mtp", "mtp_at": "coordinator"}})
    assert there.speculation.mtp_at == "coordinator" and not there.speculation.mtp_at_tail
    assert not SwarmSpec.from_dict(base).speculation.given
    plain = SwarmSpec.from_dict({**base, "speculation": {"k": 0}}).speculation
    assert plain.given and plain.draft == "none"  # k = 0 says plain: no default draft
    with pytest.raises(SpecError, match="draft_head"):
        SwarmSpec.from_dict({**base, "speculation": {"draft": "mtp", "draft_head": "x"}})
    with pytest.raises(SpecError, match="mtp_at"):
        SwarmSpec.from_dict({**base, "speculation": {"draft": "mtp", "mtp_at": "stage"}})
    with pytest.raises(SpecError, match="mtp_at"):
        SwarmSpec.from_dict({**base, "speculation": {"draft": "ngram", "mtp_at": "tail"}})
