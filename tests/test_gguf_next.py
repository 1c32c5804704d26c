"""Qwen3-Next GGUFs (llama.cpp's ``qwen3next``), written as llama.cpp writes them, converted by
shard into its ``qwen3_next`` family and compared with the checkpoint they came from.

The tiny checkpoints are ``family_fixtures``' ``qwen3_next`` (layer types linear, full, linear,
linear; layer 1 dense) and ``qwen3_next_6`` (linear and full alternating). ``write_qwen3next``
writes one as ``conversion/qwen.py``'s ``Qwen3NextModel`` does: names from
``gguf.get_tensor_name_map(QWEN3NEXT)``, ``A_log`` as ``-exp(A_log)`` (computed by torch in
float32, as the converter does), every ``*norm.weight`` but ``linear_attn.norm`` as ``1 + w``,
``conv1d`` squeezed, ``dt_bias`` as ``ssm_dt.bias``, experts stacked, and ``in_proj_qkvz``
either ``split`` (today's converter: ``attn_qkv`` — every key head's q, then k, then v — and
``attn_gate``, every z) or ``whole`` (older files: ``ssm_in`` as is); the ``ssm.*`` keys,
``rope.dimension_count`` ``head_dim * partial_rotary_factor`` and
``expert_shared_feed_forward_length``. Two things a real converter would not do on these
fixtures: it writes ``full_attention_interval`` from the config (default 4) and nothing else,
which states neither fixture's layer types, so this writer gives ``qwen3_next_6`` interval 2
and ``qwen3_next`` the per-layer ``attention.recurrent_layers`` flags (which llama.cpp's loader
reads first); and its ``qwen3next`` tensor map has no dense feed-forward, so layer 1's is
written under the generic ``ffn_gate`` / ``ffn_up`` / ``ffn_down``.

What round-trips exactly in float32: every tensor but two kinds. A (1+w) norm comes back as
``fl(1 + w) - 1`` (the subtraction is exact), which is ``w`` to within half an ulp of ``1 + w``
and gives the model the very ``1 + w`` it had; ``A_log`` comes back as ``log(-fl(-exp(A_log)))``
in float64, rounded to float32: within 2^-22 (absolute) of ``A_log``, and the model's
``-exp(A_log)`` is measured here equal to the stored value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

import family_fixtures
from shard.convert.gguf_import import convert_gguf
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear
from test_gguf_moe import IDS, _check_against_dense, _logits, stored_against_float32
from test_gguf_qwen3 import write_vocab

family_checkpoint = family_fixtures.family_checkpoint  # the session-scoped fixture

pytestmark = pytest.mark.usefixtures("one_thread")

#: (fixture, in_proj_qkvz form) pairs written all float32 and converted here.
CASES = [("qwen3_next", "split"), ("qwen3_next_6", "split"), ("qwen3_next", "whole")]
#: Tensors written in another type than F32 in the ``quantized`` files (whole blocks only).
QUANT = {
    "blk.0.ssm_ba.weight": Q.Q8_0,
    "blk.0.attn_qkv.weight": Q.Q8_0,  # the split form's (joined as float32)
    "blk.0.ssm_in.weight": Q.Q8_0,  # the whole form's (kept as stored)
    "blk.1.attn_q.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.Q4_0,
    "blk.2.ffn_up_shexp.weight": Q.Q8_0,
    "blk.3.ffn_gate_exps.weight": Q.Q4_0,
}


def _qkvz_split(w: np.ndarray, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The converter's split of ``in_proj_qkvz`` ``[Hk * (2 dk + 2 r dv), D]``: per key head
    q, k, v, z -> every q, every k, every v (``attn_qkv``) and every z (``attn_gate``)."""
    n_k, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vz = config["linear_num_value_heads"] // n_k * config["linear_value_head_dim"]
    per_head = w.reshape(n_k, 2 * dk + 2 * vz, w.shape[-1])  # [Hk, q k v z, D]
    q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + vz], axis=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


def _to_gguf(sd: dict[str, np.ndarray], config: dict[str, Any], form: str) -> dict[str, Any]:
    """``sd`` under llama.cpp's names, with the values its converter writes (module
    docstring)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, config["num_hidden_layers"])
    dense = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, a in sd.items():
        parts = name.split(".")
        if len(parts) > 6 and parts[4] == "experts" and parts[5].isdigit():
            stacks.setdefault(".".join(parts[:5] + parts[6:-1]), {})[int(parts[5])] = a
            continue
        if name.endswith(".A_log"):
            a = (-torch.exp(torch.from_numpy(a))).numpy()
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            a = a.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            a = a + np.float32(1)
        if name.endswith("in_proj_qkvz.weight") and form == "split":
            blk = names.get_name(name, try_suffixes=(".weight",)).split(".")[1]
            out[f"blk.{blk}.attn_qkv.weight"], out[f"blk.{blk}.attn_gate.weight"] = _qkvz_split(
                a, config
            )
        elif len(parts) == 6 and parts[3] == "mlp" and parts[4] in dense:
            out[f"blk.{parts[2]}.{dense[parts[4]]}.weight"] = a
        else:
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            out[gguf_name] = a
    for base, by_e in stacks.items():
        out[f"{names.get_name(base)}.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def _metadata(w: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The ``qwen3next.*`` keys llama.cpp's converter writes, the layer types as the module
    docstring says."""
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    w.add_block_count(n_layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = config["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(config["num_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    w.add_ssm_state_size(config["linear_key_head_dim"])
    w.add_ssm_group_count(config["linear_num_key_heads"])
    w.add_ssm_time_step_rank(config["linear_num_value_heads"])
    w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    kinds = config["layer_types"]
    period = kinds.index("full_attention") + 1
    if all((kind == "full_attention") == ((i + 1) % period == 0) for i, kind in enumerate(kinds)):
        w.add_full_attention_interval(period)
    else:
        w.add_full_attention_interval(4)  # the converter's default, overridden by:
        w.add_array("qwen3next.attention.recurrent_layers", [k != "full_attention" for k in kinds])


def write_qwen3next(src: Path, path: Path, form: str, quant: dict[str, Q]) -> None:
    """``src`` (a ``qwen3_next`` checkpoint) as llama.cpp's GGUF at ``path`` in ``form``, the
    tensors named in ``quant`` in their types."""
    config = json.loads((src / "config.json").read_text())
    hf = {k: v.float().numpy() for k, v in load_file(src / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(path), "qwen3next")
    _metadata(w, config)
    write_vocab(w, json.loads((src / "tokenizer.json").read_text()), config)
    for name, array in _to_gguf(hf, config, form).items():
        qtype = quant.get(name, Q.F32)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype is Q.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def built(
    family_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str, bool], Path]:
    """``built(family, form, quantized)`` -> its GGUF, written once."""
    root = tmp_path_factory.mktemp("next-gguf")
    made: dict[tuple[str, str, bool], Path] = {}

    def get(family: str, form: str, quantized: bool) -> Path:
        if (family, form, quantized) not in made:
            path = root / f"{family}-{form}-{'q' if quantized else 'f32'}.gguf"
            write_qwen3next(family_checkpoint(family), path, form, QUANT if quantized else {})
            made[family, form, quantized] = path
        return made[family, form, quantized]

    return get


def _unit_offset(name: str) -> bool:
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


@pytest.mark.parametrize(("family", "form"), CASES)
def test_float32_conversion_is_the_checkpoint(
    built: Callable[[str, str, bool], Path],
    family_checkpoint: Callable[[str], Path],
    family: str,
    form: str,
    tmp_path: Path,
) -> None:
    """Converted, an all-F32 file gives back the checkpoint: the same config, every tensor bit
    for bit but the (1+w) norms (within half an ulp of 1 + w, and 1 + w bit for bit) and
    ``A_log`` (within 2^-22, and -exp(A_log) bit for bit), and shard's logits on both identical
    with the same greedy ids."""
    src = family_checkpoint(family)
    out = convert_gguf(built(family, form, False), tmp_path / "out", progress=False, stored=False)
    config, want = ModelConfig.from_dir(out), ModelConfig.from_dir(src)
    assert config == want
    ours = load_stage(out, 0, config.n_layers, weights="float32")
    theirs = load_stage(src, 0, config.n_layers, weights="float32")
    expect = theirs.state_dict()
    assert ours.state_dict().keys() == expect.keys()
    for name, value in ours.state_dict().items():
        ref = expect[name]
        if _unit_offset(name):
            one = torch.ones((), dtype=torch.float32)
            assert torch.equal(one + value, one + ref), name
            ulp = torch.finfo(torch.float32).eps * (one + ref).abs()  # ulp of 1 + w, at most
            assert ((value - ref).abs() <= ulp / 2).all(), name
        elif name.endswith("A_log"):
            assert torch.equal(-value.exp(), -ref.exp()), name
            assert float((value - ref).abs().max()) <= 2**-22, name
        else:
            assert torch.equal(value, ref), name
    for row in IDS:
        ids = torch.tensor([row])
        got, reference = _logits(ours, ids), _logits(theirs, ids)
        assert torch.equal(got, reference)
        assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("form", ["split", "whole"])
def test_stored_conversion_keeps_the_stored_blocks(
    built: Callable[[str, str, bool], Path], form: str, tmp_path: Path
) -> None:
    """Converted stored, the Q8_0 / Q4_0 matrices stay codes and scales (the whole form's
    ``ssm_in`` too; the split form's joined ``in_proj_qkvz`` is float32), their dequantized
    values are the float32 conversion bit for bit, and loaded stored they run as quantized
    linears within a bf16 rounding of their dense twins, the logits finite."""
    path = built("qwen3_next", form, True)
    _, kinds, quantized, dense = stored_against_float32(path, tmp_path)
    layers = "model.layers.{}."
    want = {
        layers.format(0) + "linear_attn.in_proj_ba.weight": "int8",
        layers.format(1) + "self_attn.q_proj.weight": "int8",
        layers.format(1) + "self_attn.o_proj.weight": "int4",
        layers.format(2) + "mlp.shared_expert.up_proj.weight": "int8",
        **{layers.format(3) + f"mlp.experts.{e}.gate_proj.weight": "int4" for e in range(8)},
    }
    if form == "whole":
        want[layers.format(0) + "linear_attn.in_proj_qkvz.weight"] = "int8"
    assert kinds == want
    assert isinstance(quantized.layers[1].self_attn.q_proj, QuantLinear)
    _check_against_dense(quantized, dense)
    assert torch.isfinite(_logits(quantized, torch.tensor([IDS[1]]))).all()
