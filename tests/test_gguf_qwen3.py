"""Qwen3 and Qwen3-MoE GGUFs, written as llama.cpp writes them, converted by shard.

Each tiny checkpoint comes from ``family_fixtures``' builder (transformers' own classes, a fixed
seed); its tensors are written into a GGUF under llama.cpp's names (``convert_hf_to_gguf.py``'s
``Qwen3Model`` / ``Qwen3MoeModel``: Q/K rows NOT permuted — Qwen's rope rotates halves, as
transformers does — experts stacked into ``blk.N.ffn_{gate,up,down}_exps`` ``[E, out, in]``,
the router as ``ffn_gate_inp``), mostly F32 with one Q8_0 and one Q4_0 tensor. The reference is
transformers reading the SAME GGUF with its own loader (``load_gguf_checkpoint``, which
supports ``qwen3`` and ``qwen3moe``), never shard's converted directory.

The MoE checkpoint makes every layer sparse and renormalises the top-k weights, as llama.cpp's
``qwen3moe`` graph does (``family_fixtures``' ``qwen3_moe`` has a dense layer and no
renormalisation, which a llama.cpp GGUF cannot express).

Two values transformers' GGUF config mapping (5.x) drops are given to its config from the
file: ``head_dim`` (it maps no ``qwen3.attention.key_length``, so Qwen3Config's default 128
would stand, right for the real Qwen3 models, wrong for a tiny one), ``moe_intermediate_size``
(it maps no ``qwen3moe.expert_feed_forward_length``; the default 768 is Qwen3-30B-A3B's) and
``vocab_size`` (it counts the vocabulary without the added tokens; the embedding has a row for
each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from family_fixtures import FAMILIES, family_dir
from shard.convert.gguf_import import convert_gguf
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")

#: HF block names -> llama.cpp's (``gguf.TensorNameMap`` for qwen3 / qwen3moe).
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
#: Tensors written quantized (the rest F32): one Q8_0 and one Q4_0 per checkpoint.
_QUANT = {
    "blk.0.attn_q.weight": Q.Q8_0,
    "blk.1.ffn_down.weight": Q.Q4_0,
    "blk.1.ffn_up_exps.weight": Q.Q4_0,
}
IDS = [[270, *range(3, 40, 3), 5, 9, 270]]


def _gguf_names(hf: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """llama.cpp's names for an HF state dict, experts stacked ``[E, out, in]``."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in hf.items():
        array = t.float().numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = array
            continue
        _, _, layer, rest = name.split(".", 3)
        module = rest.removesuffix(".weight")
        if module.startswith("mlp.experts."):
            _, _, e, proj = module.split(".")
            experts.setdefault((layer, proj.removesuffix("_proj")), {})[int(e)] = array
        else:
            out[f"blk.{layer}.{_BLOCK[module]}.weight"] = array
    for (layer, proj), by_e in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def write_common_keys(w: gguf.GGUFWriter, config: dict[str, Any], blocks: int) -> None:
    """The ``<arch>.*`` keys every llama.cpp decoder GGUF has, from a ``config.json``."""
    w.add_block_count(blocks)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])


def write_vocab(w: gguf.GGUFWriter, tok: dict[str, Any], config: dict[str, Any]) -> None:
    """The tiny byte-level BPE tokenizer ``tok`` (a ``tokenizer.json``) as GGUF metadata."""
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    vocab = sorted({**tok["model"]["vocab"], **added}.items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    specials = set(added)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)


def _write_gguf(
    src: Path, path: Path, arch: str, quant: dict[str, Q] = _QUANT
) -> dict[str, np.ndarray]:
    """The checkpoint at ``src`` as llama.cpp's ``arch`` GGUF, the tensors named in ``quant``
    quantized; returns the tensors the GGUF holds (quantized ones dequantized), by name."""
    config = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    write_common_keys(w, config, config["num_hidden_layers"])
    if arch == "qwen3moe":
        w.add_expert_count(config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    write_vocab(w, tok, config)
    held = {}
    for name, array in _gguf_names(load_file(src / "model.safetensors")).items():
        if name in quant:
            raw = gguf.quants.quantize(array, quant[name])
            w.add_tensor(name, raw, raw_dtype=quant[name])
            held[name] = gguf.quants.dequantize(raw, quant[name])
        else:
            w.add_tensor(name, array)
            held[name] = array
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _transformers(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' model and state dict from the GGUF at ``path``, by its own loader."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    kind = parsed.pop("model_type")
    reader = gguf.GGUFReader(path)  # what transformers' config mapping leaves out (docstring)
    arch = reader.get_field("general.architecture").contents()
    parsed["head_dim"] = reader.get_field(f"{arch}.attention.key_length").contents()
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    parsed["vocab_size"] = int(embd.shape[-1])
    if arch == "qwen3moe":
        length = reader.get_field("qwen3moe.expert_feed_forward_length").contents()
        parsed["moe_intermediate_size"] = length
    cls = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[kind]
    config = getattr(transformers, f"{cls}Config")(**parsed, attn_implementation="eager")
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model, state


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per architecture: the GGUF and what it holds, from the family builder's checkpoints."""
    root = tmp_path_factory.mktemp("qwen-gguf")
    cls, model, extra = FAMILIES["qwen3_moe"]
    llama_cpp_moe = {**extra, "mlp_only_layers": [], "norm_topk_prob": True}
    dense_1 = {**extra, "mlp_only_layers": [1], "norm_topk_prob": True}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, "qwen3_moe_all_sparse", (cls, model, llama_cpp_moe))
        patch.setitem(FAMILIES, "qwen3_moe_dense_1", (cls, model, dense_1))
        srcs = {
            "qwen3": family_dir("qwen3", root),
            "qwen3moe": family_dir("qwen3_moe_all_sparse", root),
            "qwen3moe_dense_1": family_dir("qwen3_moe_dense_1", root),
        }
    out = {}
    for name, src in srcs.items():
        path = root / f"{name}.gguf"
        quant = {} if name.endswith("_dense_1") else _QUANT  # compared with its F32 source
        out[name] = (path, _write_gguf(src, path, name.removesuffix("_dense_1"), quant))
    out["qwen3moe_dense_1_source"] = (srcs["qwen3moe_dense_1"], {})
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_float32_conversion_equals_transformers_gguf_load(
    built: dict[str, tuple[Path, dict[str, Any]]], arch: str, tmp_path: Path
) -> None:
    """A tiny Qwen3 / Qwen3-MoE GGUF converted with --float32: Q/K as stored (not permuted),
    experts split per expert; every tensor equals transformers' GGUF load and the logits
    equal transformers' model's within 1e-4."""
    path, held = built[arch]
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    config = ModelConfig.from_dir(out)
    assert config.qk_norm
    stage = load_stage(out, 0, config.n_layers, weights="float32")
    ours = stage.state_dict()
    assert np.array_equal(ours["layers.0.self_attn.q_proj.weight"], held["blk.0.attn_q.weight"])
    hf, theirs = _transformers(path)
    for name, value in ours.items():
        if ".experts." in name:
            layer, e, proj = int(name.split(".")[1]), int(name.split(".")[4]), name.split(".")[5]
            if proj == "down_proj":
                want = theirs[f"model.layers.{layer}.mlp.experts.down_proj"][e]
            else:
                fused = theirs[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
                want = fused.chunk(2)[proj == "up_proj"]
            gguf_name = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight"
            assert np.array_equal(value, held[gguf_name][e]), name
        else:
            want = theirs[name if name == "lm_head.weight" else f"model.{name}"]
        assert torch.equal(value, want), name
    if arch == "qwen3moe":
        assert config.moe is not None and config.moe.norm_topk_prob
        assert config.moe.sparse_layers == tuple(range(config.n_layers))
        assert sum(".experts." in k for k in ours) == 3 * 8 * config.n_layers
    ids = torch.tensor(IDS)
    with torch.no_grad():
        want_logits = hf(input_ids=ids).logits
        got = stage(ids, 0, stage.new_cache(ids.shape[1]))
    assert float((got - want_logits).abs().max()) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_stored_conversion_keeps_quantized_tensors_and_runs(
    built: dict[str, tuple[Path, dict[str, Any]]], arch: str, tmp_path: Path
) -> None:
    """Converted stored, the Q8_0 and Q4_0 tensors (a Q4_0 expert tensor split per expert)
    stay codes and scales and load as quantized linears; the stored stage runs and its logits
    are within 1 % of the float32 conversion's largest logit (the stored kernels round)."""
    path, _ = built[arch]
    out = convert_gguf(path, tmp_path / "stored", progress=False, stored=True)
    f32 = convert_gguf(path, tmp_path / "f32", progress=False, stored=False)
    with open(out / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    quant = json.loads(header["__metadata__"]["shard.quant"])
    kinds = {name: q["kind"] for name, q in quant.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "int8"
    if arch == "qwen3":
        assert kinds["model.layers.1.mlp.down_proj.weight"] == "int4"
    else:
        assert all(
            kinds[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] == "int4" for e in range(8)
        )
    assert len(kinds) == (2 if arch == "qwen3" else 9)
    config = ModelConfig.from_dir(out)
    stored = load_stage(out, 0, config.n_layers, weights="stored")
    layer = stored.layers[1]
    held = layer.mlp.down_proj if arch == "qwen3" else layer.mlp.experts[0].up_proj
    assert isinstance(held, QuantLinear)
    dense = load_stage(f32, 0, config.n_layers, weights="float32")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        got = stored(ids, 0, stored.new_cache(ids.shape[1]))
        want = dense(ids, 0, dense.new_cache(ids.shape[1]))
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max()) < 0.01 * float(want.abs().max())


def test_moe_layer_without_router_converts_dense(
    built: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    """A Qwen3-MoE GGUF (all F32) whose layer 1 has no ffn_gate_inp (dense ffn_*): written
    as mlp_only_layers [1]; its logits equal transformers' Qwen3-MoE loaded from the source
    checkpoint (transformers' GGUF config has no mlp_only_layers) within 1e-4."""
    import transformers

    path, _ = built["qwen3moe_dense_1"]
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    config = ModelConfig.from_dir(out)
    assert config.moe is not None and config.moe.sparse_layers == (0, 2, 3)
    stage = load_stage(out, 0, config.n_layers, weights="float32")
    src, _ = built["qwen3moe_dense_1_source"]
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(src, attn_implementation="eager")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        want = hf.eval()(input_ids=ids).logits
        got = stage(ids, 0, stage.new_cache(ids.shape[1]))
    assert float((got - want).abs().max()) < 1e-4


def test_qwen2_pre_tokenizer_equals_transformers_gguf_tokenizer(
    built: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    """The converted tokenizer (byte-level BPE, pre-tokenizer ``qwen2``) encodes as
    transformers' GGUF tokenizer does: non-ASCII text, whitespace runs, specials, digits."""
    import transformers

    from shard.model.tokenizer import Tokenizer

    path, _ = built["qwen3"]
    out = convert_gguf(path, tmp_path / "out", progress=False, stored=False)
    ours = Tokenizer.from_dir(out)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        "the theme 12345 abc",
        "héllo  wörld\n\n  x",
        "<|im_start|>user\nhi<|im_end|>",
        "   spaces\t\ttabs 2024年 don't",
    ]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
