"""DeepSeek-V3 GGUFs (llama.cpp's ``deepseek2``), written as llama.cpp writes them, converted by
shard into its ``deepseek_v3`` family.

The tiny checkpoints are ``family_fixtures``' ``deepseek_v3`` (low-rank query, YaRN with
``mscale`` unlike ``mscale_all_dim``) and ``deepseek_v3_plain_q`` (a plain ``q_proj``, no
scaling). ``write_deepseek2`` writes one as ``conversion/deepseek.py``'s ``DeepseekV2Model``
does (names from ``gguf.get_tensor_name_map(DEEPSEEK2)``; nothing permuted; experts stacked;
``e_score_correction_bias`` as ``exp_probs_b.bias``), in either form of ``kv_b_proj``:

- ``whole`` (converters before llama.cpp's MLA split): ``attn_kv_b`` as is, ``head_count_kv``
  the query heads, ``key_length`` ``nope + rope``, ``value_length`` ``v``;
- ``split`` (today's converter): per head ``[nope + v, r]`` split into ``attn_k_b`` — the key
  rows transposed to ``[H, r, nope]`` — and ``attn_v_b`` ``[H, v, r]``; ``head_count_kv`` 1,
  ``key_length`` ``r + rope``, ``value_length`` ``r``, and ``key_length_mla`` /
  ``value_length_mla``;

with ``kv_lora_rank``, ``q_lora_rank`` where there is one, ``rope.dimension_count``, the expert
keys, the sigmoid gating the converter writes from the published config's ``scoring_func``,
and YaRN's keys with ``yarn_log_multiplier`` ``0.1 * mscale_all_dim`` (``mscale`` is dropped).

The reference is transformers' ``DeepseekV3ForCausalLM`` with the checkpoint's config as the
GGUF states it — ``rope_interleave`` true (llama.cpp rotates ``deepseek2`` in interleaved
pairs; the plain-q fixture is built rotate-half, which a GGUF cannot say) and ``mscale`` equal
to ``mscale_all_dim`` (what llama.cpp runs) — holding the weights the GGUF holds
(``_held_state``: the writer run on element indices says where each element came from).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import family_fixtures
from gguf_forge import encode, read_doc
from shard.convert.gguf_import import convert_gguf
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear
from test_gguf_moe import IDS, _check_against_dense, _logits, stored_against_float32
from test_gguf_qwen3 import write_vocab

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture

pytestmark = pytest.mark.usefixtures("one_thread")

#: (fixture, kv_b form) pairs converted here.
CASES = [
    ("deepseek_v3", "split"),
    ("deepseek_v3", "whole"),
    ("deepseek_v3_plain_q", "split"),
    ("deepseek_v3_plain_q", "whole"),
]
#: Tensors written in another type than F32 (rows of whole blocks only).
QUANT = {
    "blk.0.attn_kv_a_mqa.weight": Q.Q8_0,
    "blk.1.attn_kv_b.weight": Q.Q8_0,  # the whole form's (kept as stored, dense at load)
    "blk.1.attn_v_b.weight": Q.Q8_0,  # the split form's value half (joined as float32)
    "blk.0.ffn_up.weight": Q.Q4_1,  # a dense layer
    "blk.2.ffn_gate_exps.weight": Q.Q4_0,
    "blk.3.ffn_down_shexp.weight": Q.Q8_0,
    "blk.3.attn_output.weight": Q.F16,
}


def _to_gguf(sd: dict[str, np.ndarray], config: dict[str, Any], form: str) -> dict[str, Any]:
    """``sd`` under llama.cpp's names, laid out as its converter writes them (module
    docstring)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config["num_hidden_layers"])
    h, nope, v = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}

    def put(hf: str, suffix: str, array: np.ndarray) -> None:
        name = names.get_name(hf)
        assert name is not None, hf
        out[f"{name}.{suffix}"] = array

    for name, a in sd.items():
        parts = name.split(".")
        base, _, suffix = name.rpartition(".")
        if len(parts) > 6 and parts[4] == "experts" and parts[5].isdigit():
            stacks.setdefault(".".join(parts[:5] + parts[6:-1]), {})[int(parts[5])] = a
        elif name.endswith("e_score_correction_bias"):
            put(name.replace("e_score_correction_bias", "e_score_correction"), "bias", a)
        elif base.endswith("kv_b_proj") and form == "split":
            kv = a.reshape(h, nope + v, a.shape[-1])  # [H, nope + v, r]
            put(base.replace("kv_b_proj", "k_b_proj"), suffix, kv[:, :nope].swapaxes(1, 2))
            put(base.replace("kv_b_proj", "v_b_proj"), suffix, kv[:, nope:])
        else:
            put(base, suffix, a)
    for base, by_e in stacks.items():
        out[f"{names.get_name(base)}.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def _metadata(w: gguf.GGUFWriter, config: dict[str, Any], form: str) -> None:
    """The ``deepseek2.*`` keys llama.cpp's converter writes (``form``: module docstring)."""
    h, r = config["num_attention_heads"], config["kv_lora_rank"]
    nope, rope, v = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(h)
    w.add_head_count_kv(1 if form == "split" else h)
    w.add_key_length(r + rope if form == "split" else nope + rope)
    w.add_value_length(r if form == "split" else v)
    if form == "split":
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    w.add_kv_lora_rank(r)
    if config["q_lora_rank"] is not None:
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_rope_dimension_count(rope)
    rope_params = config["rope_parameters"]
    w.add_rope_freq_base(rope_params["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    if config["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(config["n_group"])
    w.add_expert_group_used_count(config["topk_group"])
    if rope_params["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_params["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope_params["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope_params["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope_params["mscale_all_dim"])


def write_deepseek2(src: Path, path: Path, form: str) -> dict[str, torch.Tensor]:
    """``src`` (a ``deepseek_v3`` checkpoint) as llama.cpp's GGUF at ``path`` in ``form``
    (``QUANT`` in their types); returns the HF state dict the GGUF holds."""
    config = json.loads((src / "config.json").read_text())
    hf = {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(w, config, form)
    write_vocab(w, json.loads((src / "tokenizer.json").read_text()), config)
    held = {}
    for name, array in _to_gguf(hf, config, form).items():
        qtype = QUANT.get(name, Q.F32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype in (Q.F32, Q.F16):
            stored = array.astype(np.float16 if qtype is Q.F16 else np.float32)
            w.add_tensor(name, stored)
            held[name] = stored.astype(np.float32)
        else:
            raw = gguf.quants.quantize(array, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(raw, qtype).reshape(array.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _held_state(hf, config, form, held)


def _held_state(
    hf: dict[str, np.ndarray], config: dict[str, Any], form: str, held: dict[str, np.ndarray]
) -> dict[str, torch.Tensor]:
    """The HF state dict whose every element is the GGUF's (the writer run on indices)."""
    starts = np.cumsum([0, *(v.size for v in hf.values())])
    index = {
        k: np.arange(s, s + v.size, dtype=np.float64).reshape(v.shape)
        for (k, v), s in zip(hf.items(), starts, strict=False)
    }
    flat = np.full(int(starts[-1]), np.nan)
    seen = np.zeros(int(starts[-1]), dtype=np.int64)
    for name, positions in _to_gguf(index, config, form).items():
        at = positions.astype(np.int64).ravel()
        flat[at] = held[name].ravel()
        np.add.at(seen, at, 1)
    assert (seen == 1).all(), "the writer places every element exactly once"
    return {
        k: torch.from_numpy(flat[s : s + v.size].reshape(v.shape).astype(np.float32))
        for (k, v), s in zip(hf.items(), starts, strict=False)
    }


def _reference_dir(src: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """``src``'s checkpoint as the GGUF states it (module docstring), holding ``state``."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["rope_interleave"] = True
    rope = config["rope_parameters"]
    if "mscale_all_dim" in rope:
        rope["mscale"] = rope["mscale_all_dim"]
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def built(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], tuple[Path, Path]]:
    """Per case: its GGUF and the reference checkpoint holding the GGUF's weights."""
    root = tmp_path_factory.mktemp("mla-gguf")
    out = {}
    for family, form in CASES:
        path = root / f"{family}-{form}.gguf"
        state = write_deepseek2(family_checkpoint(family), path, form)
        ref = _reference_dir(family_checkpoint(family), state, root / f"{family}-{form}-ref")
        out[family, form] = (path, ref)
    return out


@pytest.mark.parametrize(("family", "form"), CASES)
def test_float32_conversion_is_the_reference_exactly(
    built: dict[tuple[str, str], tuple[Path, Path]], family: str, form: str, tmp_path: Path
) -> None:
    """Converted with --float32, every tensor equals the reference's bit for bit (``kv_b_proj``
    joined back from the transposed split), the config reads back to the same MLA, MoE, rope
    and softmax scale, shard's logits on both are identical, transformers' own model of the
    reference agrees within 1e-4 with the same greedy ids, and transformers reads the converted
    directory into that same model (bit-identical logits)."""
    import transformers

    path, ref = built[family, form]
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    config, want = ModelConfig.from_dir(out), ModelConfig.from_dir(ref)
    assert (config.mla, config.moe, config.n_layers) == (want.mla, want.moe, want.n_layers)
    assert (config.rope_scaling, config.attn_scale) == (want.rope_scaling, want.attn_scale)
    assert config.rope_theta == want.rope_theta and config.rms_norm_eps == want.rms_norm_eps
    ours = load_stage(out, 0, config.n_layers, weights="float32")
    theirs = load_stage(ref, 0, config.n_layers, weights="float32")
    expect = theirs.state_dict()
    assert ours.state_dict().keys() == expect.keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, expect[name]), name
    cls = transformers.DeepseekV3ForCausalLM
    hf = cls.from_pretrained(ref, attn_implementation="eager").eval()
    converted = cls.from_pretrained(out, attn_implementation="eager").eval()
    for row in IDS:
        ids = torch.tensor([row])
        got = _logits(ours, ids)
        assert torch.equal(got, _logits(theirs, ids))
        with torch.no_grad():
            reference = hf(input_ids=ids).logits
            assert torch.equal(converted(input_ids=ids).logits, reference)
        assert float((got - reference).abs().max()) < 1e-4
        assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("form", ["split", "whole"])
def test_stored_conversion_keeps_the_stored_blocks(
    built: dict[tuple[str, str], tuple[Path, Path]], form: str, tmp_path: Path
) -> None:
    """Converted stored, the Q8_0 / Q4_0 / Q4_1 tensors stay codes and scales (the whole
    form's ``kv_b_proj`` too; the split form's joined one is float32), their dequantized values
    are the float32 conversion bit for bit, and loaded stored they run as quantized linears
    within a bf16 rounding of their dense twins, the logits finite."""
    path, _ = built["deepseek_v3", form]
    _, kinds, quantized, dense = stored_against_float32(path, tmp_path)
    layers = "model.layers.{}."
    want = {
        layers.format(0) + "self_attn.kv_a_proj_with_mqa.weight": "int8",
        layers.format(0) + "mlp.up_proj.weight": "int4",
        layers.format(3) + "mlp.shared_experts.down_proj.weight": "int8",
        **{layers.format(2) + f"mlp.experts.{e}.gate_proj.weight": "int4" for e in range(8)},
    }
    if form == "whole":
        want[layers.format(1) + "self_attn.kv_b_proj.weight"] = "int8"
    assert kinds == want
    assert isinstance(quantized.layers[0].self_attn.kv_a_proj_with_mqa, QuantLinear)
    _check_against_dense(quantized, dense)
    assert torch.isfinite(_logits(quantized, torch.tensor([IDS[1]]))).all()


def test_a_file_with_both_forms_reads_the_whole_one(
    built: dict[tuple[str, str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """A file holding ``attn_kv_b`` and the split halves too converts exactly as the whole form
    alone: the halves, shape-checked, are a copy and left out."""
    whole, split = (read_doc(built["deepseek_v3", form][0]) for form in ("whole", "split"))
    halves = [t for t in split.tensors if t.name.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
    both = tmp_path / "both.gguf"
    both.write_bytes(encode(attrs.evolve(whole, tensors=whole.tensors + tuple(halves))))
    a = convert_gguf(both, tmp_path / "both", progress=False, stored=False)
    b = convert_gguf(
        built["deepseek_v3", "whole"][0], tmp_path / "one", progress=False, stored=False
    )
    got, want = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
