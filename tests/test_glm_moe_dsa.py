"""GLM-5 (MLA + DeepSeek sparse attention's indexer + DeepSeekMoE) against transformers.

A tiny checkpoint built by transformers' ``GlmMoeDsaConfig`` / ``GlmMoeDsaForCausalLM`` from a
fixed seed and saved by ``save_pretrained`` (``family_fixtures``: ``glm_moe_dsa``): MLA as
DeepSeek-V3's fixture (low-rank query, YaRN with ``mscale`` != ``mscale_all_dim``), dense and
sparse layers interleaved by ``mlp_layer_types`` (dense, sparse, dense, sparse), and an
indexer of 16 heads of 16 keeping ``index_topk`` 4 keys a query: every prompt here is longer,
so the selection really drops keys (asserted). 16 heads, not 4: a key every head's ReLU zeroes
scores exactly 0, and with 4 heads such exact ties decided transformers' ``topk`` (whose
order among equals is unspecified) against shard's earlier-position rule.

Measured (torch 2.13 CPU, float32): logits within 1.3e-5 of transformers' (std ~3.2); every
layer's selection equal to transformers' on a 21-token prompt. The tests can fail: on that
prompt attending every key (no selection) moves the logits by 17.4, the indexer without its
rope by 17.1, its heads unweighted by 17.1. The family tests
(``test_model_families``, ``test_family_ring``: packed rows, 8 ring sessions with speculation,
the process ring) run ``glm_moe_dsa`` too.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import family_fixtures
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.dsa import Indexer
from shard.model.footprint import predict
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.model.mla import MLAttention
from shard.model.packed import Segment, forward_packed, segment_bounds
from shard.stage.chunks import kv_refusal
from test_model_split import bounds_for, greedy_tokens, run_ring
from test_model_vs_transformers import hf_greedy, shard_greedy

transformers = pytest.importorskip("transformers")
family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture
pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
NAME = "glm_moe_dsa"
BATCH = ([5, 77, 101, 260, 33, 8, 199, 42, 42, 7, 3], [9, 1, 250, 66, 12, 180, 97, 4, 4, 120, 31])
LONG = [(13 * i + 7) % 260 + 1 for i in range(21)]
SPECS = Path(__file__).resolve().parents[1] / "specs" / "models"

Selections = dict[int, list[frozenset[int]]]  # layer -> each row's kept key positions


def load_hf(model_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@contextmanager
def recorded(model: StageModel) -> Iterator[Selections]:
    """Every row's selection each layer's indexer makes while inside (batch 1)."""
    seen: Selections = defaultdict(list)
    handles = []
    for j, block in enumerate(model.blocks()):
        assert isinstance(block.self_attn, MLAttention) and block.self_attn.indexer is not None

        def hook(_m: Any, _a: Any, keep: torch.Tensor, j: int = j) -> None:
            seen[j] += [frozenset(row.nonzero().flatten().tolist()) for row in keep[0, 0]]

        handles.append(block.self_attn.indexer.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def test_logits_and_greedy_match_transformers(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """A batch prefill's logits within ATOL of transformers'; greedy ids identical over two
    prompts, each step's logits within ATOL; the indexer dropped keys on the way."""
    model_dir = family_checkpoint(NAME)
    ours, hf = load_stage(model_dir, 0, 4), load_hf(model_dir)
    ids = torch.tensor(BATCH)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = ours(ids, 0, ours.new_cache(32, batch=2))
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    worst = float((got - want).abs().max())
    for prompt in (BATCH[0], LONG):
        with recorded(ours) as seen:
            our_ids, our_logits = shard_greedy(ours, prompt, 16)
        hf_ids, hf_logits = hf_greedy(hf, prompt, 16)
        assert our_ids == hf_ids, prompt
        torch.testing.assert_close(our_logits, hf_logits, rtol=0, atol=ATOL)
        worst = max(worst, float((our_logits - hf_logits).abs().max()))
        assert all(len(kept) <= 4 for rows in seen.values() for kept in rows)
        assert any(len(kept) == 4 and max(kept) > 4 for kept in seen[0])  # keys were dropped
    report(f"{NAME}: max |logit diff| vs transformers {worst:.2g}")


def test_each_layer_selects_what_transformers_selects(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """On a 21-token prefill every layer's indexer keeps, for every row, the keys
    transformers' ``GlmMoeDsaIndexer`` keeps (its top-k within the causal mask)."""
    model_dir = family_checkpoint(NAME)
    ours, hf = load_stage(model_dir, 0, 4), load_hf(model_dir)
    theirs: list[torch.Tensor] = []
    for layer in hf.model.layers:
        layer.self_attn.indexer.register_forward_hook(lambda _m, _a, out: theirs.append(out))
    ids = torch.tensor([LONG])
    with torch.no_grad():
        hf(input_ids=ids)
    with recorded(ours) as seen:
        ours(ids, 0, ours.new_cache(32))
    n = len(LONG)
    for j, top in enumerate(theirs):  # [1, S, topk], masked keys included on early rows
        want = [frozenset(i for i in row.tolist() if i <= s) for s, row in enumerate(top[0])]
        assert seen[j] == want, f"layer {j}"
    assert sum(len(kept) < s + 1 for s, kept in enumerate(seen[0])) == n - 4


def test_every_split_is_identical(family_checkpoint: Callable[[str], Path]) -> None:
    """Blocks cut at every point, run in turn, equal the unsplit model bit for bit."""
    model_dir = family_checkpoint(NAME)
    full = load_stage(model_dir, 0, 4)
    tokens = greedy_tokens(full, torch.tensor(BATCH), 4)
    expected = run_ring([full], tokens, len(BATCH[0]))
    for bounds in bounds_for(4):
        stages = [load_stage(model_dir, a, b) for a, b in itertools.pairwise(bounds)]
        got = run_ring(stages, tokens, len(BATCH[0]))
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(g, e), f"split {bounds} differs at step {step}"


def _chunk_and_steps(
    model: StageModel, prompt: list[int], draft: list[int]
) -> tuple[torch.Tensor, torch.Tensor, Selections, Selections]:
    """``draft``'s logits and selections as one verify chunk and as its decode steps, each
    after the same prefill of ``prompt`` into a cache of its own."""
    n = len(prompt)
    a, b = model.new_cache(64), model.new_cache(64)
    model(torch.tensor([prompt]), 0, a)
    model(torch.tensor([prompt]), 0, b)
    with recorded(model) as in_chunk:
        chunk = model(torch.tensor([draft]), n, a)[0]  # [K, V]
    with recorded(model) as in_steps:
        steps = torch.cat([model(torch.tensor([[t]]), n + i, b)[0] for i, t in enumerate(draft)])
    return chunk, steps, in_chunk, in_steps


def test_a_verify_chunk_selects_and_gives_what_its_decode_steps_do(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """A chunk of 6 rows selects, in every layer and row, the keys its 6 decode steps select;
    its logits are theirs within float noise in float32 (the dense products see 6 rows, not
    1) and bit for bit with int8 weights (``rowwise``: each row scored and attended through
    its decode step's own ops and shapes)."""
    model_dir = family_checkpoint(NAME)
    draft = [44, 45, 46, 47, 48, 49]
    dense = load_stage(model_dir, 0, 4)
    chunk, steps, in_chunk, in_steps = _chunk_and_steps(dense, LONG, draft)
    worst = float((chunk - steps).abs().max())
    assert worst < 1e-4 and torch.equal(chunk.argmax(-1), steps.argmax(-1))
    assert in_chunk == in_steps and all(len(r) == 6 for r in in_chunk.values())
    quant = load_stage(model_dir, 0, 4, weights="int8")
    assert all(m.rowwise for m in quant.modules() if isinstance(m, MLAttention))
    chunk, steps, in_chunk, in_steps = _chunk_and_steps(quant, LONG, draft)
    assert torch.equal(chunk, steps)
    assert in_chunk == in_steps
    report(f"{NAME}: verify chunk vs decode steps: fp32 {worst:.2g}, int8 bit-identical")


def test_packed_sessions_select_and_give_what_each_alone_does(
    family_checkpoint: Callable[[str], Path],
) -> None:
    """Three sessions' chunks (a prefill, a decode step, a verify chunk) packed in one forward
    with int8 weights: each segment's selections and logits equal its lone run's bit for bit
    (the batch's rows never reach another row's indexer or products)."""
    model = load_stage(family_checkpoint(NAME), 0, 4, weights="int8")
    prefix = [model.new_cache(48) for _ in range(3)]
    for c in prefix:
        model(torch.tensor([LONG]), 0, c)
    chunks = [(len(LONG), [7, 8, 9, 10, 11]), (len(LONG), [3]), (len(LONG), [60, 61, 62, 63])]
    alone = [model.new_cache(48) for _ in chunks]
    packed = [model.new_cache(48) for _ in chunks]
    for c, a, p in zip(prefix, alone, packed, strict=True):
        for cache in (a, p):
            cache.k.copy_(c.k)
            cache.v.copy_(c.v)
    with recorded(model) as lone:
        want = [model(torch.tensor([ids]), s, c) for (s, ids), c in zip(chunks, alone, strict=True)]
    segs = [Segment(s, len(ids), c) for (s, ids), c in zip(chunks, packed, strict=True)]
    with recorded(model) as together:
        rows = [t for _, ids in chunks for t in ids]
        got = forward_packed(model, torch.tensor([rows]), segs)
    for (lo, hi), w in zip(segment_bounds(segs), want, strict=True):
        assert torch.equal(got[:, lo:hi], w)
    assert lone == together


def test_static_positions_and_rollback(family_checkpoint: Callable[[str], Path]) -> None:
    """``forward_at`` (positions as a tensor, the whole cache under a mask, as CUDA graphs
    run it) gives ``forward``'s logits; a rejected chunk past the frontier leaves no trace in
    the next step on either path, the indexer's keys included (rollback by overwrite)."""
    model = load_stage(family_checkpoint(NAME), 0, 4)
    a, b = model.new_cache(48), model.new_cache(48)
    x, n = torch.tensor([LONG]), len(LONG)
    torch.testing.assert_close(model(x, 0, a), model.forward_at(x, torch.arange(n), b))
    clean_a, clean_b = a.v.clone(), b.v.clone()
    model(torch.tensor([[250, 1, 77, 3]]), n, a)  # a rejected draft
    model.forward_at(torch.tensor([[250, 1, 77, 3]]), torch.arange(n, n + 4), b)
    step = torch.tensor([[42]])
    fresh = model.new_cache(48)
    model(x, 0, fresh)
    want = model(step, n, fresh)
    assert torch.equal(model(step, n, a), want)
    torch.testing.assert_close(model.forward_at(step, torch.arange(n, n + 1), b), want)
    assert torch.equal(a.v[:, :, :, :n], clean_a[:, :, :, :n])
    assert torch.equal(b.v[:, :, :, :n], clean_b[:, :, :, :n])


def test_ties_go_to_the_earlier_position(family_checkpoint: Callable[[str], Path]) -> None:
    """Keys of equal score (an indexer whose every head weighs 0): each row keeps its first
    ``index_topk`` visible keys, alone and in a chunk alike."""
    config = ModelConfig.from_dir(family_checkpoint(NAME))
    indexer = Indexer(config)  # weights_proj zero: every score is 0
    g = torch.Generator().manual_seed(1)
    q, keys = torch.randn(1, 16, 6, 16, generator=g), torch.randn(1, 1, 10, 16, generator=g)
    w = torch.zeros(1, 1, 6, 16)
    mask = torch.ones(6, 10, dtype=torch.bool).tril(4)  # rows at positions 4..9
    keep = indexer(q, w, keys, mask)[0, 0]
    assert keep.sum(-1).tolist() == [4] * 6 and bool(keep[:, :4].all())
    for i in range(6):
        alone = indexer(
            q[:, :, i : i + 1], w[:, :, i : i + 1], keys[:, :, : 5 + i], mask[i : i + 1, : 5 + i]
        )
        assert torch.equal(alone[0, 0, 0], keep[i, : 5 + i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_per_token_holds_the_indexer_key(
    family_checkpoint: Callable[[str], Path], dtype: torch.dtype
) -> None:
    """A layer caches kv_lora_rank + qk_rope_head_dim + index_head_dim numbers a position
    (32 + 8 + 16); footprint's KV pricing and the stage's KV admission agree."""
    model_dir = family_checkpoint(NAME)
    config = ModelConfig.from_dir(model_dir)
    assert config.mla is not None and config.dsa is not None
    assert config.kv_widths == (1, 32, 8 + 16)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = (32 + 8 + 16) * elem
    stage = load_stage(model_dir, 1, 3, dtype=dtype)
    cache = stage.new_cache(100)
    assert cache.nbytes == 2 * 100 * per_layer
    footprint = predict(config, "bfloat16" if dtype == torch.bfloat16 else "float32")
    assert footprint.kv(1, 3, 100) == cache.nbytes
    assert footprint.kv_token == (per_layer,) * config.n_layers
    assert kv_refusal(stage, 100, 0, cache.nbytes) is None
    assert kv_refusal(stage, 101, 0, cache.nbytes) is not None


def test_config_reads_glm5s_fields(family_checkpoint: Callable[[str], Path]) -> None:
    """The dense/sparse pattern comes from mlp_layer_types, the indexer's shape from its
    fields, and the router from GLM's defaults (one group)."""
    config = ModelConfig.from_dir(family_checkpoint(NAME))
    assert config.moe is not None and config.moe.sparse_layers == (1, 3)
    assert config.dsa is not None
    assert (config.dsa.index_n_heads, config.dsa.index_head_dim, config.dsa.index_topk) == (
        16,
        16,
        4,
    )
    assert (config.moe.n_group, config.moe.topk_group) == (1, 1)


def test_int8_quantizes_the_indexer_projections_and_keeps_its_weights_dense(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """weights="int8": the indexer's wq_b and wk run quantized, weights_proj stays a dense
    float32 matrix multiplied row by row (rowwise). The selection is discrete, so int8's noise
    (~0.01 on scores of ~0.5 here) swaps keys whose scores are that close: the first layer
    (int8 noise only, no earlier swap) keeps float's selection on most rows.

    The greedy tokens are reported, not asserted: the packed int8 kernels take bf16
    activations on every CPU (``shard.model.quant.kernel_dtype``), and on this random
    checkpoint that rounding flips a near-tied choice by the first token (float 75, int8 69;
    with float32 activations, as before, by the second). Exactness — a verify chunk equal to
    its decode steps, a batched row equal to its lone run — is asserted beside it."""
    from shard.model.dsa import IndexWeights
    from shard.model.quant import QuantLinear

    model_dir = family_checkpoint(NAME)
    stage, dense = load_stage(model_dir, 0, 4, weights="int8"), load_stage(model_dir, 0, 4)
    indexers = [m for m in stage.modules() if isinstance(m, Indexer)]
    assert len(indexers) == 4
    for m in indexers:
        assert isinstance(m.wq_b, QuantLinear) and isinstance(m.wk, QuantLinear)
        assert isinstance(m.weights_proj, IndexWeights) and m.weights_proj.rowwise
        assert m.weights_proj.weight.dtype == torch.float32
    ids = torch.tensor([LONG])
    with recorded(stage) as got, recorded(dense) as want:
        stage(ids, 0, stage.new_cache(32))
        dense(ids, 0, dense.new_cache(32))
    same = sum(a == b for a, b in zip(got[0], want[0], strict=True))
    assert same >= 3 * len(LONG) // 4
    quantized, plain = shard_greedy(stage, BATCH[0], 3)[0], shard_greedy(dense, BATCH[0], 3)[0]
    report(
        f"{NAME}: int8 keeps float's first-layer selection on {same} of {len(LONG)} rows; "
        f"greedy int8 {quantized}, float {plain}"
    )


def test_stored_weights_run_row_invariant_and_are_priced(
    family_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A checkpoint kept quantized (``weights = "stored"``, every 2-D layer weight stored as
    codes, weights_proj too): weights_proj is installed dense from its codes, a verify chunk
    equals its decode steps bit for bit with the same selections, and ``footprint.stored``
    prices each stage to the byte."""
    from shard.model.dsa import IndexWeights
    from shard.model.footprint import measured, stored
    from shard.model.quant import kernel_dtype
    from test_deepseek_v3 import stored_copy

    path = stored_copy(family_checkpoint(NAME), tmp_path / "stored")
    config = ModelConfig.from_dir(path)
    stage = load_stage(path, 0, 4)
    weights = [m for m in stage.modules() if isinstance(m, IndexWeights)]
    assert len(weights) == 4 and all(m.weight.dtype == torch.float32 for m in weights)
    chunk, steps, in_chunk, in_steps = _chunk_and_steps(stage, LONG, [44, 45, 46, 47, 48, 49])
    assert torch.equal(chunk, steps) and in_chunk == in_steps
    prices = stored(config, path, bf16_kernels=kernel_dtype(torch.device("cpu")) is torch.bfloat16)
    assert prices is not None
    for first, last in ((0, 1), (1, 3), (3, 4), (0, 4)):
        assert measured(load_stage(path, first, last)) == prices.stage(first, last)


def test_bfloat16_runs_close_to_float32_until_a_near_tie(
    family_checkpoint: Callable[[str], Path], report: Callable[[str], None]
) -> None:
    """In bfloat16 the rows that see no more than index_topk keys (no selection yet) stay
    within 5 % of the largest float32 logit, as DeepSeek-V3's do; later rows follow float's
    selection except where bf16's rounding swaps keys of near-equal score (counted)."""
    model_dir = family_checkpoint(NAME)
    f32, bf16 = load_stage(model_dir, 0, 4), load_stage(model_dir, 0, 4, dtype=torch.bfloat16)
    ids = torch.tensor([LONG])
    with recorded(f32) as want_kept, recorded(bf16) as got_kept:
        want = f32(ids, 0, f32.new_cache(32))[:, :4]
        got = bf16(ids, 0, bf16.new_cache(32))[:, :4]
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    same = sum(a == b for a, b in zip(got_kept[0], want_kept[0], strict=True))
    assert same >= len(LONG) // 2
    report(f"{NAME}: bf16 keeps float's first-layer selection on {same} of {len(LONG)} rows")


BAD = [
    ({"index_topk": 0}, "index_topk must be an integer in"),
    ({"index_topk": "2048"}, "index_topk must be an integer"),
    ({"index_n_heads": 1.5}, "index_n_heads must be an integer"),
    ({"index_n_heads": 0}, "index_n_heads must be an integer in"),
    ({"index_head_dim": 4}, "index_head_dim 4 must hold the qk_rope_head_dim 8"),
    ({"index_head_dim": True}, "index_head_dim must be an integer"),
    ({"indexer_types": ["full", "shared", "full", "full"]}, "'shared'"),
    ({"indexer_types": ["full"]}, "indexer_types must be 4 of 'full' / 'shared'"),
    ({"indexer_types": None, "index_topk_freq": 2}, "'shared'"),
    ({"indexer_types": None, "index_topk_pattern": "FSFF"}, "'shared'"),
    ({"indexer_types": None, "index_topk_pattern": "FXFF"}, "indexer_types must be"),
    ({"mlp_layer_types": ["dense", "moe", "dense", "sparse"]}, "mlp_layer_types must be 4 of"),
    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must be 4 of"),
    ({"rope_interleave": False}, "rope_interleave must be true"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave must be true"),
    ({"indexer_rope_interleave": "yes"}, "indexer_rope_interleave must be true or false"),
    ({"q_lora_rank": None}, "q_lora_rank must be an integer"),
    ({"q_lora_rank": 0}, "q_lora_rank must be an integer in"),
    ({"scoring_func": "softmax"}, "scoring_func must be"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_fields_are_refused_in_one_line(
    family_checkpoint: Callable[[str], Path], change: dict[str, Any], message: str
) -> None:
    """Each malformed, out-of-range or unsupported GLM-5 field: a one-line ModelLoadError."""
    d = json.loads((family_checkpoint(NAME) / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=message) as err:
        ModelConfig.from_hf(d | change)
    assert "\n" not in str(err.value)


def test_real_glm5_config_plans_with_its_indexer_key() -> None:
    """The published GLM-5 config (specs/models): its shapes are transformers'
    GlmMoeDsaConfig defaults, every layer runs its own indexer (top 2048 of 32 heads of
    128), a token's KV is 78 x (512 + 64 + 128) numbers (109,824 bytes in bfloat16), the
    first 3 layers are dense, and the model is ~744 B parameters."""
    config = ModelConfig.from_dir(SPECS / "glm-5")
    defaults = transformers.GlmMoeDsaConfig()
    assert config.mla is not None and config.moe is not None and config.dsa is not None
    assert (config.hidden_size, config.n_layers, config.vocab_size) == (
        defaults.hidden_size,
        defaults.num_hidden_layers,
        defaults.vocab_size,
    )
    assert (config.dsa.index_topk, config.dsa.index_n_heads, config.dsa.index_head_dim) == (
        defaults.index_topk,
        defaults.index_n_heads,
        defaults.index_head_dim,
    )
    assert (config.mla.q_lora_rank, config.mla.v_head_dim, config.moe.n_group) == (2048, 256, 1)
    assert config.moe.sparse_layers == tuple(range(3, 78))
    assert config.attn_scale == pytest.approx(256**-0.5)
    footprint = predict(config, "bfloat16")
    assert footprint.kv(0, 78) == 78 * 704 * 2
    assert 730e9 < footprint.total / 2 < 760e9
