"""DeepSeek-V4 (hyper-connections, CSA/HCA with the indexer, hash routing) beyond the family
tests.

The tiny checkpoint is ``family_fixtures``' ``deepseek_v4``: transformers' own
``DeepseekV4Config`` / ``DeepseekV4ForCausalLM`` from a fixed seed, saved by
``save_pretrained`` (the layout DeepSeek publishes, ``model.``-prefixed). 3 streams, hash-routed
layers 0 and 1, CSA (rate 4, the indexer keeping 2 entries) / HCA (rate 8) / sliding / CSA
layers, window 8. The family tests (``test_model_families``: logits and greedy against
transformers, every split; ``test_family_ring``: packed rows, 8 ring sessions with and without
speculation, the 3-stage process ring, whose first hop carries the ids layer 1 hashes) run
it too.

Measured (torch CPU, float32): logits within 1.5e-5 of transformers' over 24 greedy steps
(std ~3.2), a packed batch within 2.2e-5 of each chunk alone, a verify chunk within 1e-5 of
its decode steps. The tests can fail: keeping every compressed entry (no selection), hashing
every token to expert 0, or handing layer 1 another token's id each move the logits by > 0.1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import family_fixtures
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.deepseek_v4 import V4Stage, decode_ids, encode_ids
from shard.model.footprint import predict
from shard.model.loader import load_stage
from shard.model.packed import Segment, forward_packed

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "deepseek_v4"
PROMPT = [(13 * i + 7) % 260 + 1 for i in range(21)]
SPECS = Path(__file__).resolve().parents[1] / "specs" / "models"


def _model(family_checkpoint: Callable[[str], Path], **changes: Any) -> V4Stage:
    model_dir = family_checkpoint(NAME)
    config = ModelConfig.from_dir(model_dir)
    if changes:
        assert config.v4 is not None
        config = attrs.evolve(config, v4=attrs.evolve(config.v4, **changes))
    stage = load_stage(model_dir, 0, config.n_layers, config=config)
    assert isinstance(stage, V4Stage)
    return stage


def test_config_declares_v4s_differences(family_checkpoint: Callable[[str], Path]) -> None:
    """The saved config.json parses into V4's streams, kinds, hash layers and wire width."""
    config = ModelConfig.from_dir(family_checkpoint(NAME))
    v4 = config.v4
    assert v4 is not None
    assert v4.hc_mult == 3 and v4.hash_layers == (0, 1)
    assert [v4.ratio(i) for i in range(4)] == [4, 8, 0, 4]
    assert (v4.index_topk, v4.index_n_heads, config.sliding_window) == (2, 16, 8)
    assert v4.compress_scaling is not None and v4.compress_scaling.kind == "yarn"
    assert config.id_digits == 2  # a 262-token vocabulary
    assert config.hidden_wire_width == 3 * 64 + 2


def test_ids_cross_the_hop_inside_the_hidden_state(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """Stage [0, 1) hands on 3 streams and the ids' digits; stage [1, 4) hashes layer 1's
    experts by those ids: another id in the digits changes its logits."""
    model_dir = family_checkpoint(NAME)
    first, rest = load_stage(model_dir, 0, 1), load_stage(model_dir, 1, 4)
    ids = torch.tensor([PROMPT])
    hidden = first(ids, 0, first.new_cache(32))
    assert hidden.shape == (1, len(PROMPT), 3 * 64 + 2)
    assert torch.equal(decode_ids(hidden[..., 192:], 262), ids)
    want = rest(hidden, 0, rest.new_cache(32))
    other = hidden.clone()
    other[..., 192:] = encode_ids((ids + 1) % 262, 2, hidden.dtype)
    moved = (rest(other, 0, rest.new_cache(32)) - want).abs().max()
    assert moved > 0.1
    bad = hidden.clone()
    bad[0, 0, 193] = 255.0  # digits of an id past the vocabulary
    with pytest.raises(ValueError, match="token-id digits"):
        rest(bad, 0, rest.new_cache(32))


def test_the_indexer_and_the_hash_routes_decide_the_logits(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """Keeping every compressed entry, or routing hashed layers elsewhere, moves the logits:
    the fixture's contexts are long enough that the indexer drops entries."""
    ids = torch.tensor([PROMPT])
    base = _model(family_checkpoint)
    want = base(ids, 0, base.new_cache(32))
    wide = _model(family_checkpoint, index_topk=64)
    assert (wide(ids, 0, wide.new_cache(32)) - want).abs().max() > 0.1
    for block in base.layers:
        if block.ffn.gate.hashed:
            block.ffn.gate.tid2eid.data.zero_()
    assert (base(ids, 0, base.new_cache(32)) - want).abs().max() > 0.1


def test_a_verify_chunk_gives_what_its_decode_steps_do(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """A chunk of 6 rows closing CSA and HCA windows equals its 6 one-row steps (float noise
    only, same argmax)."""
    model = _model(family_checkpoint)
    ids = torch.tensor([PROMPT])
    chunk_cache, step_cache = model.new_cache(32), model.new_cache(32)
    model(ids[:, :10], 0, chunk_cache)
    model(ids[:, :10], 0, step_cache)
    chunk = model(ids[:, 10:16], 10, chunk_cache)
    steps = torch.cat([model(ids[:, p : p + 1], p, step_cache) for p in range(10, 16)], dim=1)
    diff = float((chunk - steps).abs().max())
    report(f"deepseek_v4: verify chunk vs its decode steps max |logit diff| {diff:.2g}")
    assert diff < 1e-4
    assert torch.equal(chunk.argmax(-1), steps.argmax(-1))


def test_rollback_is_exact(family_checkpoint: Callable[[str], Path]) -> None:
    """Rejected drafts at [10, 17) (closing CSA and HCA windows) then a chunk at 8 give bit
    for bit what the chunk at 8 gives after the prefill alone; packed beside another
    session's chunk too."""
    model = _model(family_checkpoint)
    prefill, drafts = torch.tensor([PROMPT[:10]]), torch.tensor([[3, 250, 9, 9, 1, 77, 12]])
    redo = torch.tensor([PROMPT[8:13]])
    clean, dirty = model.new_cache(32), model.new_cache(32)
    model(prefill, 0, clean)
    model(prefill, 0, dirty)
    model(drafts, 10, dirty)
    assert torch.equal(model(redo, 8, dirty), model(redo, 8, clean))
    outs = []
    for rejected in (False, True):  # the same packed layout, with and without the drafts
        mine, other = model.new_cache(32), model.new_cache(32)
        model(prefill, 0, mine)
        if rejected:
            model(drafts, 10, mine)
        x = torch.cat([redo, prefill[:, :3]], dim=1)
        outs.append(forward_packed(model, x, [Segment(8, 5, mine), Segment(0, 3, other)]))
    assert torch.equal(outs[0], outs[1])


BAD: list[tuple[dict[str, Any], str]] = [
    ({"n_shared_experts": 2}, "n_shared_experts must be 1"),
    ({"scoring_func": "relu"}, "scoring_func must be one of"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must be 4 of"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types must be 4 of"),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, "mlp_layer_types must be 4 of"),
    ({"o_groups": 3}, "o_groups must be a divisor of num_attention_heads"),
    ({"hc_mult": 0}, "hc_mult must be an integer in"),
    ({"index_topk": "2"}, "index_topk must be an integer"),
    ({"layer_types": None, "compress_ratios": [0, 4, 64, 0]}, "compress_ratios must be"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_fields_are_refused_in_one_line(
    family_checkpoint: Callable[[str], Path], change: dict[str, Any], message: str
) -> None:
    """Each malformed, out-of-range or unsupported V4 field: a one-line ModelLoadError."""
    d = json.loads((family_checkpoint(NAME) / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message) as err:
        ModelConfig.from_hf(d | change)
    assert "\n" not in str(err.value)


def test_published_v4_flash_config_plans() -> None:
    """DeepSeek's own V4-Flash config.json (legacy keys: compress_ratios with the MTP layer's
    entry, num_hash_layers, qk_rope_head_dim, a flat yarn rope_scaling) reads as transformers
    folds it; 4 streams cross a hop: (4 x 4096 + 3) x 2 = 32,774 bytes a token in bfloat16."""
    config = ModelConfig.from_dir(SPECS / "deepseek-v4-flash")
    v4 = config.v4
    assert v4 is not None and config.n_layers == 43
    assert v4.kinds[:4] == (
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    assert (v4.hash_layers, v4.hca_ratio, config.rotary_dim) == ((0, 1, 2), 128, 64)
    assert v4.compress_scaling is not None and v4.compress_scaling.attention_factor == 1.0
    assert config.hidden_wire_width * 2 == 32_774
    assert config.kv_widths == (1, 512, 5 * 512 + 5 * 128)
    footprint = predict(config, "bfloat16")
    assert 270e9 < footprint.total / 2 < 300e9
