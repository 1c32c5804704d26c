"""Mixtral, gpt-oss, GLM-4.5-MoE, MiniMax-M2 and Llama 3.x GGUFs, written as llama.cpp writes
them, converted by shard (DeepSeek-V3's ``deepseek2``: ``tests/test_gguf_mla.py``).

Each tiny checkpoint comes from ``family_fixtures``' builder (transformers' own classes, a fixed
seed). ``_to_gguf`` writes it the way llama.cpp's ``convert_hf_to_gguf.py`` does (its
``conversion/llama.py``, ``gpt_oss.py`` and ``glm.py``), tensor names from llama.cpp's own table
(``gguf.get_tensor_name_map``):

- Mixtral is a ``llama`` GGUF with ``expert_count``: Q and K rows permuted for llama.cpp's rope
  (``LlamaModel.permute``), ``block_sparse_moe.experts.E.w1|w3|w2`` stacked over experts into
  ``ffn_gate|up|down_exps``, the router ``ffn_gate_inp``.
- gpt-oss: ``gate_up_proj`` ``[E, D, 2F]`` transposed, then split gate = even rows, up = odd
  rows, into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, F, D]``, likewise the biases;
  ``down_proj`` transposed into ``ffn_down_exps``; ``self_attn.sinks`` as
  ``attn_sinks.weight``; YaRN in ``rope.scaling.*``; experts in MXFP4.
- GLM-4.5: experts stacked, ``e_score_correction_bias`` as ``exp_probs_b.bias``, shared experts
  ``ffn_*_shexp``, ``rope.dimension_count`` the rotated part, the group counts, and one
  multi-token-prediction block after the decoder blocks (``nextn_predict_layers`` 1, with
  ``nextn.*`` tensors), which shard leaves out.
- MiniMax-M2 (``conversion/minimax.py``): Mixtral's per-expert ``w1|w3|w2`` stacked, the
  correction bias as ``exp_probs_b.bias``, q/k norms over all heads as they are,
  ``rope.dimension_count`` the ``rotary_dim``, ``expert_feed_forward_length`` the
  ``intermediate_size``, the sigmoid gating its converter writes from the published
  ``config.json``'s ``scoring_func`` (transformers' config does not keep that key).
- Llama 3.x: Q and K permuted, and the rope scaling only as ``rope_freqs.weight``, the
  per-frequency divisors ``LlamaModel.generate_extra_tensors`` computes (the test computes them
  from the checkpoint's own ``rope_parameters``).

transformers' GGUF loader reads none of the MoE files as llama.cpp writes them (no Mixtral or
GLM-4.5 mapping; its gpt-oss mapping expects other tensor names), so the reference is
transformers' model of the same family with the weights the GGUF holds: ``_held_state``
inverts the writer without restating it — the writer is run once more on tensors whose
every element is its own index, which says where each stored element came from.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import family_fixtures
from shard.convert.gguf_arch import ConvertError
from shard.convert.gguf_import import convert_gguf
from shard.model import footprint
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.moe import FusedExperts
from shard.model.quant import QuantLinear, kernel_dtype
from test_gguf_qwen3 import write_common_keys, write_vocab

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture

pytestmark = pytest.mark.usefixtures("one_thread")

#: family -> (GGUF architecture, llama.cpp's arch enum).
ARCH = {
    "llama3": ("llama", gguf.MODEL_ARCH.LLAMA),
    "mixtral": ("llama", gguf.MODEL_ARCH.LLAMA),
    "gpt_oss": ("gpt-oss", gguf.MODEL_ARCH.GPT_OSS),
    "glm4_moe": ("glm4moe", gguf.MODEL_ARCH.GLM4_MOE),
    "minimax_m2": ("minimax-m2", gguf.MODEL_ARCH.MINIMAXM2),
}
#: Tensors written quantized (the rest F32), per family.
QUANT = {
    "llama3": {"blk.1.attn_q.weight": Q.Q8_0},
    "mixtral": {
        "blk.0.attn_k.weight": Q.Q8_0,  # rows permuted, then quantized
        "blk.1.ffn_up_exps.weight": Q.Q4_0,
        "blk.2.ffn_down_exps.weight": Q.Q4_1,
    },
    "gpt_oss": {
        "blk.0.attn_q.weight": Q.Q8_0,
        **{f"blk.{i}.ffn_{p}_exps.weight": Q.MXFP4 for i in (0, 3) for p in ("gate", "up", "down")},
        "blk.1.ffn_gate_exps.weight": Q.MXFP4,  # with a Q8_0 up: the same stored layout
        "blk.1.ffn_up_exps.weight": Q.Q8_0,
        "blk.2.ffn_gate_exps.weight": Q.Q4_0,  # with an F32 up: kept fused as floats
    },
    "glm4_moe": {
        "blk.0.ffn_up.weight": Q.Q4_1,  # the dense first layer
        "blk.1.ffn_gate_exps.weight": Q.Q4_0,
        "blk.2.ffn_down_shexp.weight": Q.Q8_0,
    },
    "minimax_m2": {
        "blk.0.attn_q.weight": Q.Q8_0,
        "blk.1.ffn_up_exps.weight": Q.Q4_0,
        "blk.2.ffn_down_exps.weight": Q.Q8_0,
    },
}
MOE = ["mixtral", "gpt_oss", "glm4_moe", "minimax_m2"]
IDS = [[270, *range(3, 40, 3), 5, 9, 270], [11, 200, 3, 3, 3, 64, 65, 66, 7, 1, 2, 250, 8, 9, 10]]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of a Q or K weight (rope on interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _to_gguf(family: str, sd: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors ``sd`` under llama.cpp's names, laid out as its converter
    writes them (module docstring)."""
    _, arch = ARCH[family]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"] + 1)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}

    def put(hf: str, suffix: str, array: np.ndarray) -> None:
        name = names.get_name(hf)
        assert name is not None, hf
        out[f"{name}.{suffix}"] = array

    for name, a in sd.items():
        parts = name.split(".")
        if len(parts) > 6 and parts[4] == "experts" and parts[5].isdigit():
            e = int(parts[5])  # model.layers.L.<ffn>.experts.E.<proj>.weight
            stacks.setdefault(".".join(parts[:5] + parts[6:-1]), {})[e] = a
        elif name.endswith("gate_up_proj"):  # gpt-oss [E, D, 2F]
            t = a.swapaxes(-1, -2)
            put(name.replace("gate_up_proj", "gate_proj"), "weight", t[:, ::2, :])
            put(name.replace("gate_up_proj", "up_proj"), "weight", t[:, 1::2, :])
        elif name.endswith("gate_up_proj_bias"):
            put(name.replace("gate_up_proj_bias", "gate_proj"), "bias", a[..., ::2])
            put(name.replace("gate_up_proj_bias", "up_proj"), "bias", a[..., 1::2])
        elif name.endswith("experts.down_proj"):
            put(name, "weight", a.swapaxes(-1, -2))
        elif name.endswith("experts.down_proj_bias"):
            put(name.removesuffix("_bias"), "bias", a)
        elif name.endswith("self_attn.sinks"):
            put(name, "weight", a)
        elif name.endswith("e_score_correction_bias"):
            put(name.replace("e_score_correction_bias", "e_score_correction"), "bias", a)
        else:
            base, _, suffix = name.rpartition(".")
            if ARCH[family][0] == "llama" and base.endswith(("q_proj", "k_proj")):
                heads = config["num_attention_heads" if "q_proj" in base else "num_key_value_heads"]
                a = _permute(a, heads)
            put(base, suffix, a)
    for base, by_e in stacks.items():
        put(base, "weight", np.stack([by_e[e] for e in sorted(by_e)]))
    return out


def _metadata(w: gguf.GGUFWriter, family: str, config: dict[str, Any]) -> int:
    """The ``<arch>.*`` keys llama.cpp's converter writes; returns the block count."""
    blocks = config["num_hidden_layers"] + (family == "glm4_moe")  # one MTP block
    write_common_keys(w, config, blocks)
    rope = config["rope_parameters"]
    if family in MOE:
        w.add_expert_count(config.get("num_local_experts") or config["n_routed_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
    if family == "gpt_oss":
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if family == "minimax_m2":
        w.add_expert_feed_forward_length(config["intermediate_size"])
        w.add_rope_dimension_count(config["rotary_dim"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family == "glm4_moe":
        w.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        w.add_expert_weights_norm(config["norm_topk_prob"])
        w.add_nextn_predict_layers(1)
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
    return blocks


def _rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """Llama 3's per-frequency rope divisors as llama.cpp's converter computes them."""
    rope, dim = config["rope_parameters"], config["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, context = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _mtp_block(layer: int, d: int) -> dict[str, np.ndarray]:
    """A GLM multi-token-prediction block's extra tensors (random: shard never reads them)."""
    rng = np.random.default_rng(3)
    shapes = {
        "attn_norm.weight": (d,),
        "nextn.eh_proj.weight": (d, 2 * d),
        "nextn.enorm.weight": (d,),
    }
    return {
        f"blk.{layer}.{k}": rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()
    }


def _write(family: str, src: Path, path: Path) -> dict[str, np.ndarray]:
    """``src`` as llama.cpp's GGUF at ``path`` (``QUANT`` quantized); returns the HF state
    dict the GGUF holds (quantized tensors as their dequantized values)."""
    config = json.loads((src / "config.json").read_text())
    hf = {}
    for f in sorted(src.glob("*.safetensors")):
        hf |= {k: v.float().numpy() for k, v in load_file(f).items()}
    arrays = _to_gguf(family, hf, config)
    w = gguf.GGUFWriter(str(path), ARCH[family][0])
    blocks = _metadata(w, family, config)
    write_vocab(w, json.loads((src / "tokenizer.json").read_text()), config)
    held = {}
    for name, array in arrays.items():
        qtype = QUANT[family].get(name, Q.F32)
        if qtype is Q.F32:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
            held[name] = array
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(raw, qtype).reshape(array.shape)
    if family == "llama3":
        w.add_tensor("rope_freqs.weight", _rope_freqs(config))
    if blocks > config["num_hidden_layers"]:
        for name, array in _mtp_block(config["num_hidden_layers"], config["hidden_size"]).items():
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _held_state(family, hf, config, held)


def _held_state(
    family: str, hf: dict[str, np.ndarray], config: dict[str, Any], held: dict[str, np.ndarray]
) -> dict[str, torch.Tensor]:
    """The HF state dict whose every element is the GGUF's (module docstring: the writer run
    on element indices says where each came from)."""
    sizes = {k: v.size for k, v in hf.items()}
    starts = np.cumsum([0, *sizes.values()])
    index = {
        k: np.arange(s, s + v.size, dtype=np.float64).reshape(v.shape)
        for (k, v), s in zip(hf.items(), starts, strict=False)
    }
    where = _to_gguf(family, index, config)
    flat = np.full(int(starts[-1]), np.nan)
    seen = np.zeros(int(starts[-1]), dtype=np.int64)
    for name, positions in where.items():
        at = positions.astype(np.int64).ravel()
        flat[at] = held[name].ravel()
        np.add.at(seen, at, 1)
    assert (seen == 1).all(), "the writer places every element exactly once"
    return {
        k: torch.from_numpy(flat[s : s + v.size].reshape(v.shape).astype(np.float32))
        for (k, v), s in zip(hf.items(), starts, strict=False)
    }


@pytest.fixture(scope="module")
def built(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]:
    """Per family: the source checkpoint, its GGUF and the state dict the GGUF holds."""
    root = tmp_path_factory.mktemp("moe-gguf")
    out = {}
    for family in ARCH:
        src = family_checkpoint(family)
        path = root / f"{family}.gguf"
        out[family] = (src, path, _write(family, src, path))
    return out


def _transformers(family: str, src: Path, state: dict[str, torch.Tensor], tmp: Path) -> Any:
    """transformers' own model of ``family`` with ``src``'s config, holding ``state`` (saved
    as a checkpoint and loaded by ``from_pretrained``, which maps per-expert names onto the
    fused experts transformers 5 holds in memory)."""
    import transformers

    copy = tmp / "reference"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v.contiguous() for k, v in state.items()}, copy / "model.safetensors")
    cls = getattr(transformers, family_fixtures.FAMILIES[family][1])
    model, info = cls.from_pretrained(copy, attn_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return model.eval()


def _logits(stage: Any, ids: torch.Tensor) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for row in ids:
            rows.append(stage(row[None], 0, stage.new_cache(len(row)))[0])
    return torch.stack(rows)


@pytest.mark.parametrize("family", list(ARCH))
def test_float32_conversion_equals_transformers_on_the_held_weights(
    built: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], family: str, tmp_path: Path
) -> None:
    """Converted with --float32, every tensor equals the weight the GGUF holds (Q/K unpermuted,
    experts split or re-fused, MTP left out), Llama 3's rope scaling is read back from
    ``rope_freqs`` to the checkpoint's own; the logits equal transformers' model holding the
    same weights within 1e-4 and the greedy ids are identical."""
    src, path, state = built[family]
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    config = ModelConfig.from_dir(out)
    want = ModelConfig.from_dir(src)
    assert config.moe == want.moe and config.n_layers == want.n_layers == 4
    assert config.layer_types == want.layer_types and config.rope_scaling == want.rope_scaling
    assert (config.partial_rotary, config.qk_norm) == (want.partial_rotary, want.qk_norm)
    assert (config.attention_bias, config.o_proj_bias) == (want.attention_bias, want.o_proj_bias)
    stage = load_stage(out, 0, config.n_layers, weights="float32")
    ours = stage.state_dict()
    assert len(ours) == len(state)
    for name, value in ours.items():
        key = name if name == "lm_head.weight" else f"model.{name}"
        if key not in state:  # MiniMax-M2's bias: shard's router holds it, HF's block does
            key = key.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
        assert torch.equal(value, state[key]), name
    hf = _transformers(family, src, state, tmp_path)
    for row in IDS:
        ids = torch.tensor([row])
        with torch.no_grad():
            theirs = hf(input_ids=ids).logits
        got = _logits(stage, ids)
        assert float((got - theirs).abs().max()) < 1e-4
        assert torch.equal(got.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("family", MOE)
def test_stored_conversion_keeps_the_stored_blocks(
    built: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], family: str, tmp_path: Path
) -> None:
    """Converted stored, every quantized tensor stays codes and scales (gpt-oss's MXFP4 and
    Q8_0 experts per expert, gate and up rows interleaved; a Q4_0 gate with an F32 up fused as
    floats); dequantized, the stored checkpoint is the float32 conversion bit for bit; loaded
    stored, the quantized weights run as quantized linears, each within a bf16 rounding of its
    dense twin (``_check_against_dense``), the logits finite; each stage of a 3-stage split holds
    exactly the bytes ``footprint.stored`` prices from the headers (per-expert names too)."""
    _, path, _ = built[family]
    stored, kinds, quantized, dense = stored_against_float32(path, tmp_path)
    config = ModelConfig.from_dir(stored)
    if family == "gpt_oss":
        experts = "model.layers.{}.mlp.experts.{}.{}"
        for layer in (0, 1, 3):
            assert all(kinds[experts.format(layer, "gate_up_proj", e)] == "int8" for e in range(4))
        assert experts.format(2, "gate_up_proj", 0) not in kinds
        assert {kinds[experts.format(i, "down_proj", 0)] for i in (0, 3)} == {"int8"}
        assert kinds["model.layers.0.self_attn.q_proj.weight"] == "int8"
        assert len(kinds) == 2 * (4 + 4) + 4 + 1  # layers 0 and 3, layer 1's gate_up, q_proj
        fused = [layer.mlp.experts for layer in quantized.layers]
        assert all(isinstance(x, FusedExperts) for x in fused)
        assert fused[0].gate_up_q is not None and fused[0].down_q is not None
        assert fused[2].gate_up_q is None and fused[2].gate_up_proj is not None
    elif family == "mixtral":
        assert kinds["model.layers.0.self_attn.k_proj.weight"] == "int8"
        ups = {kinds[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"] for e in range(4)}
        assert ups == {"int4"} and len(kinds) == 1 + 4 + 4
        assert isinstance(quantized.layers[1].block_sparse_moe.experts[0].w3, QuantLinear)
    elif family == "minimax_m2":
        assert kinds["model.layers.0.self_attn.q_proj.weight"] == "int8"
        ups = {kinds[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"] for e in range(8)}
        assert ups == {"int4"} and len(kinds) == 1 + 8 + 8
        assert isinstance(quantized.layers[1].block_sparse_moe.experts[0].w3, QuantLinear)
    else:
        assert kinds["model.layers.0.mlp.up_proj.weight"] == "int4"
        assert kinds["model.layers.2.mlp.shared_experts.down_proj.weight"] == "int8"
        assert len(kinds) == 1 + 8 + 1
        assert isinstance(quantized.layers[1].mlp.experts[0].gate_proj, QuantLinear)
    _check_against_dense(quantized, dense)
    assert torch.isfinite(_logits(quantized, torch.tensor([IDS[1]]))).all()
    bf16 = kernel_dtype(torch.device("cpu")) is torch.bfloat16
    priced = footprint.stored(config, stored, bf16_kernels=bf16)
    assert priced is not None
    for first, last in ((0, 1), (1, 3), (3, 4)):
        stage = load_stage(stored, first, last, weights="stored")
        assert footprint.measured(stage) == priced.stage(first, last), (first, last)


def stored_against_float32(path: Path, tmp: Path) -> tuple[Path, dict[str, str], Any, Any]:
    """Convert the GGUF ``path`` stored and in float32 under ``tmp``; assert that the stored
    checkpoint, dequantized, is the float32 conversion bit for bit. Returns the stored
    directory, each stored tensor's kind (``shard.quant``), and the whole model loaded
    ``stored`` and from the float32 conversion."""
    stored = convert_gguf(path, tmp / "stored", progress=False, stored=True)
    f32 = convert_gguf(path, tmp / "f32", progress=False, stored=False)
    with open(stored / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    kinds = {k: v["kind"] for k, v in json.loads(header["__metadata__"]["shard.quant"]).items()}
    n = ModelConfig.from_dir(stored).n_layers
    as_f32 = load_stage(stored, 0, n, weights="float32").state_dict()
    dense = load_stage(f32, 0, n, weights="float32")
    for name, value in dense.state_dict().items():
        assert torch.equal(as_f32[name], value), name
    return stored, kinds, load_stage(stored, 0, n, weights="stored"), dense


def _check_against_dense(quantized: Any, dense: Any) -> None:
    """Every stored linear's output within 1 % of its dense twin's largest, and every stored
    gpt-oss expert's (two products and the clamped SwiGLU) within 2 %: one bf16 rounding of
    the activations and scales per product (``tests/test_quant.py``). The whole model is not
    compared so: a rounding that flips a router's near-tied choice moves a tiny random MoE's
    logits far more than any one product."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    dense_modules = dict(dense.named_modules())
    checked = 0
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantLinear) and name in dense_modules and name != "lm_head":
                twin = dense_modules[name]
                h = torch.randn(5, twin.weight.shape[1], generator=torch.Generator().manual_seed(2))
                want = twin(h)
                assert float((module(h) - want).abs().max()) <= 0.01 * float(want.abs().max())
                checked += 1
            elif isinstance(module, FusedExperts) and module.gate_up_q is not None:
                twin = dense_modules[name]
                for e in range(len(module.gate_up_q)):
                    want = twin.run(e, x)
                    assert float((module.run(e, x) - want).abs().max()) <= 0.02 * float(
                        want.abs().max()
                    )
                    checked += 1
    assert checked > 0


def test_a_split_stored_gpt_oss_equals_its_unsplit_run(
    built: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    """The stored gpt-oss conversion split [0, 1) [1, 3) [3, 4): each stage reads only its
    layers' per-expert tensors, and the chained stages' logits equal the one-stage run's bit for
    bit."""
    _, path, _ = built["gpt_oss"]
    out = convert_gguf(path, tmp_path / "stored", progress=False, stored=True)
    whole = load_stage(out, 0, 4)
    ids = torch.tensor([IDS[1]])
    want = _logits(whole, ids)
    stages = [load_stage(out, a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    with torch.no_grad():
        h = ids
        for stage in stages:
            h = stage(h, 0, stage.new_cache(ids.shape[1]))
    assert torch.equal(h, want)


def test_refusals_are_one_clear_error(
    built: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    """A GLM GGUF routed by softmax, a gpt-oss GGUF without YaRN, a llama GGUF whose
    rope_freqs follow no Llama 3 curve and a gpt-oss GGUF whose down experts are not 3-D are
    refused before any tensor is converted, each with a ``ConvertError`` that says why."""
    odd = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    for family, key, value, message in (
        ("glm4_moe", "glm4moe.expert_gating_func", 1, "sigmoid"),
        ("gpt_oss", "gpt-oss.rope.scaling.type", "none", "YaRN"),
        ("llama3", "rope_freqs.weight", odd, "Llama 3's rope scaling"),
        ("gpt_oss", "blk.1.ffn_down_exps.weight", odd, r"ffn_down_exps.weight': shape \[8\]"),
    ):
        path = built[family][1]
        bad = tmp_path / f"{family}.gguf"
        _rewrite(path, bad, key, value)
        with pytest.raises(ConvertError, match=message):
            convert_gguf(bad, tmp_path / f"{family}-out", progress=False)
        assert not (tmp_path / f"{family}-out").exists()


def _rewrite(path: Path, dest: Path, key: str, value: Any) -> None:
    """``path`` copied to ``dest`` with metadata or tensor ``key`` set to ``value``."""
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dest), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == key:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, field.contents(), kind)
    if isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    for t in reader.tensors:
        if t.name == key:
            w.add_tensor(t.name, value)
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
