"""Hostile GGUF files: every lie, bad type and oversized declaration is one ``ConvertError``
naming the file and the field, found quickly and without a large allocation.

Each file is the tiny valid GGUF of ``fixtures_smollm2.write_tiny_gguf``, read into plain
records (``gguf_forge.Doc``) and written back by ``encode`` with ``struct``, so a test can
declare what ``gguf.GGUFWriter`` would never write: a 2^40-element array, an unaligned or
overlapping offset, a count that is a string. The property test at the end mutates the bytes
and the fields of the same file (seeded, derandomized: the same 150 cases every run) and
asserts the outcome is a one-line ``ConvertError`` or a conversion shard can load (equal to
the reference where the header was left alone) — never another exception.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import family_fixtures
from fixtures_smollm2 import write_tiny_gguf
from gguf_forge import FORMATS, Doc, encode, read_doc
from shard.cli import main
from shard.convert.gguf_import import ConvertError, convert_gguf
from shard.convert.gguf_tensors import check_tensors
from shard.model.config import ModelConfig
from test_gguf_mla import write_deepseek2
from test_gguf_moe import _write as write_moe_gguf
from test_gguf_next import write_qwen3next

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture

#: What a refusal may cost: time (generous for a loaded CI box) and traced Python memory.
SECONDS = 2.0
PEAK_BYTES = 64 << 20


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Doc:
    """The tiny valid GGUF as records (re-encoded: ``encode`` round-trips it)."""
    path = tmp_path_factory.mktemp("base") / "tiny.gguf"
    write_tiny_gguf(path)
    doc = read_doc(path)
    assert encode(doc) == path.read_bytes()
    return doc


@pytest.fixture
def refuse(tmp_path: Path) -> Callable[..., str]:
    """``refuse(bytes_or_doc, field)``: write the file, convert it, and assert one
    ``ConvertError`` naming the file and ``field``, quickly and within ``PEAK_BYTES``;
    returns the message."""
    n = iter(range(1000))

    def run(data: bytes | Doc, field: str) -> str:
        raw = encode(data) if isinstance(data, Doc) else data
        i = next(n)
        path = tmp_path / f"hostile{i}.gguf"
        path.write_bytes(raw)
        out = tmp_path / f"out{i}"
        tracemalloc.start()
        start = time.perf_counter()
        try:
            with pytest.raises(ConvertError) as caught:
                convert_gguf(path, out, progress=False)
        finally:
            elapsed = time.perf_counter() - start
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        message = str(caught.value)
        assert message.startswith(f"{path}: "), message
        assert field in message, message
        assert message.isprintable(), message  # one line
        assert elapsed < SECONDS, (elapsed, message)
        assert peak < PEAK_BYTES, (peak, message)
        assert not out.exists()
        return message

    return run


def _header(counts: tuple[int, int], version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, *counts)


# --- declared sizes, checked before anything loops or allocates --------------------------


def test_array_of_2_40_elements_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A token array declaring 2^40 elements is refused by its length, not read."""
    doc = base.field("tokenizer.ggml.tokens", length=1 << 40)
    refuse(doc, "tokenizer.ggml.tokens (array length)")


def test_array_longer_than_the_file_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """An array within the maximum but longer than the bytes left is refused."""
    doc = base.field("tokenizer.ggml.merges", length=1 << 19)
    assert "room" in refuse(doc, "tokenizer.ggml.merges (array length)")


def test_the_largest_arrays_the_bounds_allow_are_read_quickly(base: Doc, tmp_path: Path) -> None:
    """2^20 tokens and about as many token types (the most the bounds let through) are read
    and refused in seconds, not the minute gguf.GGUFReader's per-element parse took."""
    n = 1 << 20
    doc = base.field("tokenizer.ggml.tokens", value=[f"t{i}" for i in range(n)])
    doc = doc.field("tokenizer.ggml.token_type", value=[1] * (n - 16))
    path = tmp_path / "big.gguf"
    path.write_bytes(encode(doc))
    start = time.perf_counter()
    with pytest.raises(ConvertError, match=r"tokenizer.ggml.tokens: 1048576 tokens for 264"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert time.perf_counter() - start < 5 * SECONDS


@pytest.mark.parametrize("blocks", [1 << 31, (1 << 32) - 1, 4097])
def test_huge_block_count_is_refused(base: Doc, refuse: Callable[..., str], blocks: int) -> None:
    """A block count of 2^31 (or any above 4096) is refused, not planned layer by layer."""
    refuse(base.field("llama.block_count", value=blocks), "llama.block_count")


def test_block_count_2_40_as_uint64_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """2^40 blocks as a uint64 is refused the same way."""
    doc = base.field("llama.block_count", kind=V.UINT64, value=1 << 40)
    refuse(doc, "llama.block_count")


def test_context_of_2_30_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A context length of 2^30 would cost gigabytes of rope table at load: refused."""
    refuse(base.field("llama.context_length", value=1 << 30), "llama.context_length")


@pytest.mark.parametrize(
    ("counts", "field"),
    [((1 << 40, 0), "tensor count"), ((0, 1 << 40), "metadata key count")],
)
def test_huge_header_counts_are_refused(
    refuse: Callable[..., str], counts: tuple[int, int], field: str
) -> None:
    """n_tensors or n_kv of 2^40 is refused before the header is walked."""
    refuse(_header(counts) + bytes(64), field)


def test_huge_string_length_is_refused(refuse: Callable[..., str]) -> None:
    """A key whose length says 2^40 bytes is refused."""
    refuse(_header((0, 1)) + struct.pack("<Q", 1 << 40) + bytes(64), "metadata key")


def test_nested_array_and_unknown_value_type_are_refused(
    base: Doc, refuse: Callable[..., str]
) -> None:
    """An array of arrays, or a value type GGUF does not define, is refused by key."""
    nested = base.field("general.x", kind=V.ARRAY, item=V.ARRAY, value=[])
    refuse(nested, "general.x: an array of arrays")
    refuse(base.field("general.x", kind=99, value=0), "general.x: unknown value type 99")


@pytest.mark.parametrize(
    ("version", "why"),
    [(struct.pack("<I", 1), "version: 1 "), (struct.pack(">I", 3), "big-endian")],
)
def test_versions_not_read_here_are_refused(
    base: Doc, refuse: Callable[..., str], version: bytes, why: str
) -> None:
    """GGUF version 1 (32-bit counts) and a big-endian file are refused by their version."""
    raw = encode(base)
    assert why in refuse(raw[:4] + version + raw[8:], "version: ")


def test_truncated_file_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A file cut inside its last tensor, or inside its header, is refused."""
    raw = encode(base)
    refuse(raw[: len(raw) - 600], "run past the end of the file")
    refuse(raw[:300], "")


@pytest.mark.parametrize(
    ("dims", "qtype", "field"),
    [
        ((64, 1, 1, 1, 1), Q.F32, "n_dims: 5"),
        ((64, 0), Q.F32, "has a dimension below 1"),
        ((1 << 20, 1 << 20), Q.F32, "bytes at"),
        ((1 << 40, 1 << 40), Q.F32, "too many elements"),
        ((64, 64), 200, "is not a known ggml type"),
    ],
)
def test_bad_tensor_dims_and_types_are_refused(
    base: Doc, refuse: Callable[..., str], dims: tuple[int, ...], qtype: int, field: str
) -> None:
    """More than 4 dims, a zero dim, a product too large, an unknown ggml type: refused."""
    doc = base.tensor("blk.1.ffn_down.weight", dims=dims, qtype=qtype)
    assert field in refuse(doc, "tensor 'blk.1.ffn_down.weight'")


# --- wrong types and values -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "changes", "why"),
    [
        ("llama.block_count", {"kind": V.STRING, "value": "30"}, "must be one integer"),
        ("llama.block_count", {"kind": V.FLOAT32, "value": math.nan}, "must be one integer"),
        ("llama.block_count", {"kind": V.ARRAY, "item": V.UINT32, "value": [2]}, "integer"),
        ("llama.block_count", {"value": 0}, "outside 1..4096"),
        ("llama.attention.head_count", {"value": 0}, "outside"),
        ("llama.attention.head_count", {"kind": V.STRING, "value": "4"}, "integer"),
        ("llama.attention.head_count", {"value": 3}, "do not divide the embedding width"),
        ("llama.attention.head_count_kv", {"value": 3}, "does not divide the 4 query heads"),
        ("llama.attention.head_count_kv", {"value": 8}, "outside 1..4"),
        ("llama.embedding_length", {"kind": V.INT32, "value": -64}, "outside"),
        ("llama.feed_forward_length", {"kind": V.BOOL, "value": True}, "integer"),
        ("llama.attention.layer_norm_rms_epsilon", {"value": math.nan}, "finite positive"),
        ("llama.attention.layer_norm_rms_epsilon", {"value": -1e-5}, "finite positive"),
        ("llama.attention.layer_norm_rms_epsilon", {"kind": V.STRING, "value": "x"}, "number"),
        ("llama.rope.freq_base", {"value": 0.0}, "finite positive"),
        ("llama.rope.freq_base", {"value": math.inf}, "finite positive"),
        ("llama.rope.freq_base", {"kind": V.FLOAT64, "value": 1e300}, "float32"),
        ("llama.rope.dimension_count", {"value": 17}, "outside 2..16"),
        ("llama.rope.dimension_count", {"value": 8}, "partial rotary"),
        ("tokenizer.ggml.bos_token_id", {"value": 10**6}, "outside 0.."),
        ("tokenizer.ggml.eos_token_id", {"kind": V.INT32, "value": -1}, "outside 0.."),
        ("tokenizer.ggml.tokens", {"item": V.INT32, "value": list(range(264))}, "string"),
        ("tokenizer.ggml.token_type", {"value": [7] * 264}, "not a llama.cpp token type"),
        ("tokenizer.ggml.token_type", {"item": V.FLOAT32, "value": [1.0] * 264}, "array of"),
        ("tokenizer.ggml.merges", {"value": ["Ġ t", "zz qq"]}, "merge 1 'zz qq'"),
        ("tokenizer.ggml.merges", {"value": ["nospace"]}, "merge 0"),
        ("tokenizer.ggml.add_bos_token", {"kind": V.STRING, "value": "no"}, "must be bool"),
        ("general.alignment", {"value": 0}, "not a power of two"),
        ("general.alignment", {"value": 48}, "not a power of two"),
        ("general.alignment", {"kind": V.STRING, "value": "32"}, "must be a uint32"),
    ],
)
def test_wrong_types_and_values_are_refused(
    base: Doc, refuse: Callable[..., str], key: str, changes: dict[str, Any], why: str
) -> None:
    """Counts that are strings, NaN, arrays, zero or indivisible; eps and rope bases that
    are not finite and positive; special ids outside the vocabulary; unknown token types;
    merges of unknown tokens; a bad alignment: each refused, naming the key."""
    message = refuse(base.field(key, **changes), key)
    assert why in message, message


def test_tokenizer_bos_beyond_the_tokens_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A BOS id within the embedding rows but naming no token is refused, not dropped."""
    tokens = next(f for f in base.fields if f.key == "tokenizer.ggml.tokens").value
    kinds = next(f for f in base.fields if f.key == "tokenizer.ggml.token_type").value
    doc = base.field("tokenizer.ggml.tokens", value=tokens[:-4])
    doc = doc.field("tokenizer.ggml.token_type", value=kinds[:-4])
    doc = doc.field("tokenizer.ggml.bos_token_id", value=len(tokens) - 2)
    refuse(doc, "tokenizer.ggml.bos_token_id: 262 is not a token id")


def test_token_too_long_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A 5,000-character token (whose SentencePiece splits would cost its length squared)
    is refused."""
    tokens = list(next(f for f in base.fields if f.key == "tokenizer.ggml.tokens").value)
    tokens[200] = "x" * 5000
    doc = base.field("tokenizer.ggml.tokens", value=tokens)
    refuse(doc, "tokenizer.ggml.tokens: token 200 has 5000 characters; at most 1024")


@pytest.mark.parametrize("qtype", [Q.I8, Q.F64, Q.Q8_K])
def test_tensor_type_the_converter_cannot_read_is_refused(
    base: Doc, refuse: Callable[..., str], qtype: Q
) -> None:
    """A weight stored as an integer, F64 or Q8_K tensor (which nothing decodes) is refused
    before the tensor pass, not a NotImplementedError halfway through it."""
    t = next(t for t in base.tensors if t.name == "blk.1.ffn_down.weight")  # [64, 96]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    dims = (256, 24)  # a whole number of blocks for every type
    doc = base.tensor(t.name, qtype=qtype, dims=dims, data=bytes(256 * 24 // block * size))
    refuse(doc, f"tensor {t.name!r} type: {qtype.name} is not a weight type")


def test_quantized_row_not_whole_blocks_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A Q8_0 tensor whose row is not a whole number of 32-value groups is refused."""
    t = next(t for t in base.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.qtype == Q.Q8_0
    doc = base.tensor(t.name, dims=(48, 64))
    refuse(doc, "is not a whole number of Q8_0 blocks")


# --- lies about the layout and the model ----------------------------------------------------


def test_unaligned_offset_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A tensor offset that is not a multiple of the alignment is refused."""
    t = base.tensors[3]
    doc = base.tensor(t.name, offset=len(base.tensors[0].data) + 4)
    refuse(doc, f"tensor {t.name!r} offset")
    refuse(doc, "is not a multiple of general.alignment 32")


def test_two_tensors_at_one_offset_are_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A tensor placed on the one before it (the same offset) is refused as an overlap."""
    a, b = base.tensors[4], base.tensors[5]
    offset = sum(-(-len(t.data) // 32) * 32 for t in base.tensors[:4])
    doc = base.tensor(b.name, offset=offset)
    assert f"overlaps tensor {a.name!r}" in refuse(doc, f"tensor {b.name!r} offset")


def test_size_that_does_not_match_dims_and_type_is_refused(
    base: Doc, refuse: Callable[..., str]
) -> None:
    """A tensor whose dims say more (or fewer) bytes than the file gives it is refused,
    naming it and its size."""
    t = next(t for t in base.tensors if t.name == "blk.0.attn_q.weight")  # F32 [64, 64]
    bigger = base.tensor(t.name, dims=(64, 128), data=t.data)
    assert "whose dims [64, 128] of F32 take 32768 bytes" in refuse(bigger, "overlaps")
    smaller = base.tensor(t.name, dims=(64, 32), data=t.data)
    assert "leaves a gap after tensor 'blk.0.attn_q.weight'" in refuse(smaller, "offset")


def test_duplicate_names_and_keys_are_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A tensor name or a metadata key appearing twice is refused."""
    twice = attrs.evolve(base, tensors=(*base.tensors, base.tensors[1]))
    refuse(twice, f"tensor {base.tensors[1].name!r}: the name appears twice")
    keys = attrs.evolve(base, fields=(*base.fields, base.fields[1]))
    refuse(keys, f"{base.fields[1].key}: the key appears twice")


def test_names_that_are_not_utf8_or_too_long_are_refused(
    base: Doc, refuse: Callable[..., str]
) -> None:
    """A key that is not UTF-8, or a tensor name over llama.cpp's 63 bytes, is refused."""
    raw = encode(base)
    refuse(raw.replace(b"llama.block_count", b"llama.block\xffcount"), "metadata key: not UTF-8")
    refuse(base.tensor("output_norm.weight", name="x" * 64), "tensor 1 name")


@pytest.mark.parametrize(
    "name", ["blk.1.ffn_down.weight", "output_norm.weight", "blk.0.attn_norm.weight"]
)
def test_missing_tensor_is_refused(base: Doc, refuse: Callable[..., str], name: str) -> None:
    """A block or global tensor the architecture needs, left out, is refused rather than
    converted into a broken checkpoint."""
    refuse(base.tensor(name, drop=True), f"tensor {name!r}: missing")


def test_shape_contradicting_the_metadata_is_refused(base: Doc, refuse: Callable[..., str]) -> None:
    """A K projection with the Q projection's rows (64, not 2 heads of 16) is refused."""
    k = next(t for t in base.tensors if t.name == "blk.0.attn_k.weight")
    doc = base.tensor(k.name, dims=(64, 64), data=k.data * 2)
    refuse(doc, "tensor 'blk.0.attn_k.weight': shape [64, 64] contradicts the metadata")


def test_expert_tensors_must_match_the_expert_count() -> None:
    """A Qwen3-MoE layer's experts must number ``expert_count`` and be as wide as the
    metadata says, its router must be there, and experts times blocks is bounded (checked on
    names and shapes alone)."""
    config = {
        "num_hidden_layers": 1,
        "hidden_size": 8,
        "head_dim": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 6,
        "moe_intermediate_size": 6,
        "num_experts": 4,
        "vocab_size": 10,
        "mlp_only_layers": [],
    }
    shapes = {
        "token_embd.weight": (10, 8),
        "output_norm.weight": (8,),
        **{f"blk.0.{n}.weight": (8,) for n in ("attn_norm", "ffn_norm")},
        **{f"blk.0.{n}.weight": (4,) for n in ("attn_q_norm", "attn_k_norm")},
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_gate_inp.weight": (4, 8),
        "blk.0.ffn_gate_exps.weight": (4, 6, 8),
        "blk.0.ffn_up_exps.weight": (4, 6, 8),
        "blk.0.ffn_down_exps.weight": (4, 8, 6),
    }
    check_tensors("qwen3moe", config, shapes)
    with pytest.raises(ConvertError, match=r"'blk.0.ffn_up_exps.weight': shape \[3, 6, 8\]"):
        check_tensors("qwen3moe", config, {**shapes, "blk.0.ffn_up_exps.weight": (3, 6, 8)})
    with pytest.raises(ConvertError, match=r"'blk.0.ffn_down_exps.weight': shape \[4, 8, 7\]"):
        check_tensors("qwen3moe", config, {**shapes, "blk.0.ffn_down_exps.weight": (4, 8, 7)})
    many = {**config, "num_experts": 4096, "num_hidden_layers": 65}
    with pytest.raises(ConvertError, match="expert_count: 4096 experts in each of 65 blocks"):
        check_tensors("qwen3moe", many, shapes)
    del shapes["blk.0.ffn_gate_inp.weight"]
    with pytest.raises(ConvertError, match=r"'blk.0.ffn_gate_inp.weight': missing"):
        check_tensors("qwen3moe", config, shapes)


# --- the frontier architectures: deepseek2 (MLA), minimax-m2 and qwen3next ----------------


@pytest.fixture(scope="module")
def frontier(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Doc]:
    """Valid ``deepseek2`` (split ``attn_k_b`` / ``attn_v_b``, low-rank query, YaRN),
    ``minimax-m2`` and ``qwen3next`` (split ``in_proj_qkvz``, per-layer ``recurrent_layers``)
    GGUFs of the tiny family checkpoints, as records."""
    root = tmp_path_factory.mktemp("frontier")
    write_deepseek2(family_checkpoint("deepseek_v3"), root / "ds.gguf", "split")
    write_moe_gguf("minimax_m2", family_checkpoint("minimax_m2"), root / "mm.gguf")
    write_qwen3next(family_checkpoint("qwen3_next"), root / "qn.gguf", "split", {})
    return {
        "deepseek2": read_doc(root / "ds.gguf"),
        "minimax-m2": read_doc(root / "mm.gguf"),
        "qwen3next": read_doc(root / "qn.gguf"),
    }


_DS = "deepseek2"
_QN = "qwen3next"
_FRONTIER_CASES: list[tuple[str, str, dict[str, Any], str]] = [
    (_DS, "blk.3.attn_v_b.weight", {"drop": True}, "tensor 'blk.3.attn_v_b.weight': missing"),
    (_DS, "blk.0.attn_q_b.weight", {"drop": True}, "tensor 'blk.0.attn_q_b.weight': missing"),
    (_DS, "blk.2.exp_probs_b.bias", {"drop": True}, "tensor 'blk.2.exp_probs_b.bias': missing"),
    # k_b left untransposed ([H, nope, r]: the bytes fit, the layout does not)
    (_DS, "blk.2.attn_k_b.weight", {"dims": (32, 16, 4)}, "'blk.2.attn_k_b.weight': shape [4, 16"),
    (_DS, "blk.2.attn_v_b.weight", {"dims": (12, 32, 4)}, "'blk.2.attn_v_b.weight': shape [4, 32"),
    (_DS, "deepseek2.attention.head_count_kv", {"value": 2}, "head_count_kv: 2; a GGUF with"),
    (_DS, "deepseek2.attention.head_count", {"value": 8}, "contradicts the metadata"),
    (_DS, "deepseek2.attention.head_count", {"value": 0}, "head_count: 0 is outside"),
    (_DS, "deepseek2.attention.kv_lora_rank", {"value": 16}, "contradict kv_lora_rank 16"),
    (_DS, "deepseek2.attention.key_length_mla", {"value": 8}, "leaves no unrotated part"),
    (_DS, "deepseek2.attention.q_lora_rank", {"kind": None}, "has no attention.q_lora_rank"),
    (_DS, "deepseek2.expert_gating_func", {"kind": None}, "expert_gating_func: absent"),
    (_DS, "deepseek2.rope.scaling.yarn_log_multiplier", {"kind": None}, "yarn_log_multiplier"),
    ("minimax-m2", "minimax-m2.expert_gating_func", {"value": 1}, "sigmoid (2), not 1"),
    ("minimax-m2", "blk.1.attn_q_norm.weight", {"dims": (16,)}, "attn_q_norm.weight': shape"),
    (_QN, "blk.0.ssm_a", {"drop": True}, "tensor 'blk.0.ssm_a': missing"),
    (_QN, "blk.2.attn_gate.weight", {"drop": True}, "tensor 'blk.2.attn_gate.weight': missing"),
    (_QN, "blk.1.attn_k_norm.weight", {"drop": True}, "'blk.1.attn_k_norm.weight': missing"),
    (_QN, "blk.3.ffn_gate_inp_shexp.weight", {"drop": True}, "ffn_gate_inp_shexp.weight': miss"),
    # conv1d left unsqueezed ([C, 1, K]: the bytes fit, the layout does not)
    (_QN, "blk.0.ssm_conv1d.weight", {"dims": (4, 1, 80)}, "ssm_conv1d.weight': shape [80, 1, 4]"),
    (_QN, "qwen3next.ssm.conv_kernel", {"value": 3}, "ssm_conv1d.weight': shape [80, 4] contra"),
    (_QN, "qwen3next.ssm.conv_kernel", {"value": 1000}, "conv_kernel: 1000 is outside"),
    (_QN, "qwen3next.ssm.group_count", {"value": 4}, "contradicts the metadata"),
    (_QN, "qwen3next.ssm.group_count", {"value": 3}, "4 value heads are not a multiple of the 3"),
    (_QN, "qwen3next.ssm.time_step_rank", {"value": 0}, "time_step_rank: 0 is outside"),
    (_QN, "qwen3next.ssm.inner_size", {"value": 50}, "inner_size: 50 is not a whole value head"),
    (_QN, "qwen3next.attention.head_count", {"value": 2}, "contradicts the metadata"),
    (_QN, "qwen3next.attention.value_length", {"value": 8}, "value heads are as wide"),
    (_QN, "qwen3next.rope.dimension_count", {"value": 32}, "dimension_count: 32 is outside"),
    (_QN, "qwen3next.expert_gating_func", {"value": 2}, "expert_gating_func: 2; Qwen3-Next's"),
    (_QN, "qwen3next.attention.recurrent_layers", {"value": [1, 0, 1]}, "one flag (0 or 1)"),
    (_QN, "qwen3next.attention.recurrent_layers", {"value": [1, 0, 2, 1], "item": V.INT32}, "0 or"),
]


@pytest.mark.parametrize(("arch", "what", "change", "message"), _FRONTIER_CASES)
def test_frontier_lies_are_refused(
    frontier: dict[str, Doc],
    refuse: Callable[..., str],
    arch: str,
    what: str,
    change: dict[str, Any],
    message: str,
) -> None:
    """A ``deepseek2`` file missing a tensor, with ``attn_k_b`` / ``attn_v_b`` laid out
    otherwise, head counts or ``kv_lora_rank`` its tensors contradict, a query form without its
    key, softmax routing or YaRN without its multiplier — or a ``minimax-m2`` file with another
    router or a per-head q norm, or a ``qwen3next`` file missing a tensor, with ``conv1d``
    unsqueezed, DeltaNet head counts its tensors contradict or value heads not a multiple of
    the key heads, another router or layer flags that are not one per layer — is one quick
    ``ConvertError``."""
    doc = frontier[arch]
    if what.startswith("blk."):
        t = next(t for t in doc.tensors if t.name == what)
        if "dims" in change:
            count = math.prod(change["dims"])
            change = {**change, "data": t.data[: 4 * count].ljust(4 * count, b"\0")}
        doc = doc.tensor(what, **change)
    else:
        doc = doc.field(what, **change)
    refuse(doc, message)


def test_a_kv_lora_rank_the_tensors_contradict_is_refused(
    frontier: dict[str, Doc], refuse: Callable[..., str]
) -> None:
    """``kv_lora_rank`` 16 with ``key_length`` and ``value_length`` agreeing with it (the
    metadata consistent in itself) contradicts the latent tensors' shapes: refused."""
    doc = frontier["deepseek2"].field("deepseek2.attention.kv_lora_rank", value=16)
    doc = doc.field("deepseek2.attention.key_length", value=16 + 8)
    doc = doc.field("deepseek2.attention.value_length", value=16)
    refuse(doc, "shape [32] contradicts the metadata (expected [16])")


@pytest.mark.parametrize(
    ("interval", "message"),
    [
        (0, "full_attention_interval: 0 is outside"),
        ("4", "full_attention_interval: must be one integer"),
        (4, "tensor 'blk.1.ssm_conv1d.weight': missing"),  # layer 1 linear, 3 full: a lie
    ],
)
def test_a_bad_full_attention_interval_is_refused(
    frontier: dict[str, Doc], refuse: Callable[..., str], interval: Any, message: str
) -> None:
    """Without ``recurrent_layers``, a ``full_attention_interval`` of 0, a string, or one
    whose full layers the tensors contradict is refused."""
    doc = frontier[_QN].field("qwen3next.attention.recurrent_layers", kind=None)
    kind = V.STRING if isinstance(interval, str) else V.UINT32
    refuse(doc.field("qwen3next.full_attention_interval", kind=kind, value=interval), message)


def test_both_forms_of_in_proj_qkvz_are_refused(
    frontier: dict[str, Doc], refuse: Callable[..., str]
) -> None:
    """A block holding ``ssm_in`` beside ``attn_qkv`` / ``attn_gate`` would write
    ``in_proj_qkvz`` twice: refused."""
    doc = frontier[_QN]
    qkv = next(t for t in doc.tensors if t.name == "blk.0.attn_qkv.weight")
    whole = attrs.evolve(qkv, name="blk.0.ssm_in.weight", dims=(64, 128), data=qkv.data * 2)
    whole = attrs.evolve(whole, data=whole.data[: 4 * 64 * 128])
    refuse(attrs.evolve(doc, tensors=(*doc.tensors, whole)), "holds in_proj_qkvz twice")


def test_a_positive_ssm_a_is_refused(frontier: dict[str, Doc], refuse: Callable[..., str]) -> None:
    """``ssm_a`` is ``-exp(A_log)``: a value not below zero has no ``A_log`` and is refused
    before the slow pass."""
    doc = frontier[_QN]
    t = next(t for t in doc.tensors if t.name == "blk.2.ssm_a")
    data = struct.pack("<f", 0.5) + t.data[4:]
    refuse(doc.tensor("blk.2.ssm_a", data=data), "ssm_a: every value must be negative")


# --- the commands -----------------------------------------------------------------------


def test_shard_convert_prints_one_line_and_exits_2(
    base: Doc, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard convert` on a hostile file: exit 2, one `shard convert: error:` line naming
    the file and the field."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(encode(base.field("llama.block_count", kind=V.STRING, value="30")))
    assert main(["convert", str(path), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shard convert: error: {path}: llama.block_count: "), err


def test_shard_plan_of_a_hostile_gguf_is_one_line(
    base: Doc, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shard plan` over a spec whose model is a hostile GGUF refuses it the same way: one
    line naming the file and the field (exit 1, as plan reports a model it cannot read)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    path.write_bytes(encode(base.tensor("blk.1.ffn_down.weight", drop=True)))
    spec = tmp_path / "swarm.toml"
    stages = "".join(
        f'[[stage]]\nname = "s{i}"\nlisten = "127.0.0.1:{7901 + i}"\nlayers = "auto"\n'
        for i in range(2)
    )
    spec.write_text(
        f'[swarm]\nname = "t"\nmodel = "{path}"\ninsecure = true\n'
        f'[coordinator]\nlisten = "127.0.0.1:7900"\n{stages}'
    )
    assert main(["plan", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"shard: error: {path}: tensor 'blk.1.ffn_down.weight': missing"), err


# --- the property: a mutated file is refused or read correctly -----------------------------


@pytest.fixture(scope="module")
def reference(base: Doc, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The valid file's conversion (config and tensors), to compare accepted mutants with."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "tiny.gguf").write_bytes(encode(base))
    out = convert_gguf(tmp / "tiny.gguf", tmp / "out", progress=False)
    return {
        "config": json.loads((out / "config.json").read_text()),
        "weights": (out / "model.safetensors").read_bytes(),
    }


def _mutations(base: Doc) -> st.SearchStrategy[tuple[str, Any]]:
    raw = encode(base)
    header = len(raw) - sum(-(-len(t.data) // 32) * 32 for t in base.tensors)
    positions = st.integers(0, len(raw) - 1)
    header_positions = st.integers(0, header - 1)
    names = st.sampled_from([t.name for t in base.tensors])
    values = st.one_of(
        st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]),
        st.integers(0, 255),
    )
    return st.one_of(
        st.tuples(st.just("byte"), st.tuples(header_positions, values)),
        st.tuples(st.just("byte"), st.tuples(positions, values)),
        st.tuples(st.just("truncate"), positions),
        st.tuples(
            st.just("u64"),
            st.tuples(header_positions, st.sampled_from([0, 1, 1 << 31, 1 << 40, 2**64 - 1])),
        ),
        st.tuples(
            st.just("field"),
            st.tuples(
                st.sampled_from([f.key for f in base.fields]),
                st.sampled_from(list(FORMATS)),
                st.sampled_from([0, 1, -1, 3, 1 << 31, math.nan, math.inf, 0.5]),
            ),
        ),
        st.tuples(st.just("tensor"), st.tuples(names, _TENSOR_CHANGES)),
        st.tuples(st.just("tensor"), st.tuples(names, _TENSOR_CHANGES)),  # drawn twice as often
        st.tuples(st.just("drop field"), st.sampled_from([f.key for f in base.fields])),
    )


_RENAMES = (
    *("blk.2.attn_q.weight", "blk.0.attn_q.bias", "rope_freqs.weight", "output.weight"),
    *("blk.1.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight", "x"),
)
_TENSOR_CHANGES = st.one_of(
    st.just({"drop": True}),
    st.fixed_dictionaries({"dims": st.sampled_from([(64,), (32, 64), (64, 96), (256, 24)])}),
    st.fixed_dictionaries({"qtype": st.sampled_from([Q.F16, Q.BF16, Q.Q4_K, Q.I8, Q.Q8_K])}),
    st.fixed_dictionaries({"name": st.sampled_from(_RENAMES)}),
)
"""What a tensor mutation changes (its data is resized to what its dims and type take)."""


def _retensor(base: Doc, name: str, changes: dict[str, Any]) -> Doc:
    """``base`` with tensor ``name`` changed, its data zeroed to the size its new dims and
    type take (so the layout stays consistent and the change itself is what is judged)."""
    if changes.get("drop"):
        return base.tensor(name, drop=True)
    t = next(t for t in base.tensors if t.name == name)
    dims, qtype = changes.get("dims", t.dims), changes.get("qtype", t.qtype)
    block, size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    if dims[0] % block:
        dims = (block, *dims[1:])
    data = bytes(math.prod(dims) // block * size)
    return base.tensor(name, **{**changes, "dims": dims, "qtype": qtype, "data": data})


def _apply(base: Doc, mutation: tuple[str, Any]) -> tuple[bytes, bool]:
    """The mutated file, and whether its header (everything before the tensor data) is
    unchanged."""
    kind, arg = mutation
    original = encode(base)
    raw = bytearray(original)
    if kind == "byte":
        at, value = arg
        raw[at] = value
    elif kind == "truncate":
        del raw[arg:]
    elif kind == "tensor":
        raw = bytearray(encode(_retensor(base, *arg)))
    elif kind == "drop field":
        raw = bytearray(encode(base.field(arg, kind=None)))
    elif kind == "u64":
        at, value = arg
        raw[at : at + 8] = struct.pack("<Q", value)[: len(raw) - at]
    else:
        key, value_type, value = arg
        fmt = FORMATS[value_type]
        if fmt in "fd":
            value = float(value)
        elif fmt == "?":
            value = bool(value) if value == value else True
        elif not isinstance(value, int) or not _packs(fmt, value):
            value = 1
        raw = bytearray(encode(base.field(key, kind=value_type, value=value, item=None)))
    header = original.index(base.tensors[0].data[:64])
    return bytes(raw), len(raw) == len(original) and raw[:header] == original[:header]


def _packs(fmt: str, value: int) -> bool:
    try:
        struct.pack("<" + fmt, value)
    except struct.error:
        return False
    return True


def test_mutated_files_are_refused_or_read_correctly(
    base: Doc, reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any one-byte, 8-byte, truncating, retyping or dropping mutation of a valid GGUF's
    bytes, fields or tensors (dims, type, name; seeded, derandomized) ends in a one-line
    ``ConvertError`` naming the file, or in a conversion shard can load; one that left the
    header alone converts to the reference's config and layout."""
    tmp = tmp_path_factory.mktemp("mutants")
    counter = iter(range(10**6))

    @settings(
        max_examples=150,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_mutations(base))
    def check(mutation: tuple[str, Any]) -> None:
        data, header_intact = _apply(base, mutation)
        i = next(counter)
        path = tmp / f"m{i}.gguf"
        path.write_bytes(data)
        out = tmp / f"out{i}"
        start = time.perf_counter()
        error: ConvertError | None = None
        try:
            convert_gguf(path, out, progress=False)
        except ConvertError as exc:
            error = exc
        finally:
            path.unlink()
        elapsed = time.perf_counter() - start
        if error is not None:
            assert str(error).startswith(f"{path}: "), error
            assert str(error).isprintable(), error  # one line, even for a key like "a\nb"
            assert not out.exists()
        else:
            ModelConfig.from_dir(out)  # a checkpoint shard can load, not a broken one
            if header_intact:
                assert json.loads((out / "config.json").read_text()) == reference["config"]
                weights = (out / "model.safetensors").read_bytes()
                assert weights[:8] == reference["weights"][:8]
                (n,) = struct.unpack("<Q", weights[:8])
                assert weights[: 8 + n] == reference["weights"][: 8 + n]
            shutil.rmtree(out)
        assert elapsed < SECONDS, mutation

    check()


def test_valid_file_still_converts(base: Doc, reference: dict[str, Any]) -> None:
    """The unmutated file converts (the reference the property compares against)."""
    assert reference["config"]["num_hidden_layers"] == 2
    assert np.frombuffer(reference["weights"][:8], "<u8")[0] > 0
