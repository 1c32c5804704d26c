"""A tiny checkpoint in the stored (quantized) layout, for the tests of everything around a
quantized block (``test_quant_join``, ``test_quant_audit``, ``test_quant_failover``).

``write_q4_gguf`` writes a Llama-shaped GGUF the way llama.cpp's converter does (Q/K rows
permuted, the tiny byte-level vocabulary), with every layer's linear weight in Q4_0 (int4,
groups of 32: the kernel SmolLM2's stored layers run), the embedding (and tied head) in Q8_0
and the norms in F32; ``stored_tiny`` converts it with ``shard convert``'s converter kept as
stored. Cheap: 6 layers of width 64 convert in well under a second.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from fixtures_smollm2 import (
    TINY,
    TINY_MERGES,
    TINY_TEMPLATE,
    gguf_name,
    llama_cpp_permute,
    tiny_vocab,
)
from shard.convert.gguf_import import convert_gguf

Q4_0 = gguf.GGMLQuantizationType.Q4_0
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def tensors(n_layers: int, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights of a tied tiny model with ``n_layers`` layers (HF names)."""
    rng = np.random.default_rng(seed)
    h, ffn = TINY["hidden"], TINY["ffn"]
    kv = TINY["kv_heads"] * h // TINY["heads"]
    shapes = {
        "model.embed_tokens.weight": (len(tiny_vocab()[0]), h),
        "model.norm.weight": (h,),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
    out = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith("norm.weight") else 0.3
        out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def write_q4_gguf(path: Path, *, n_layers: int = 6, seed: int = 0) -> None:
    """The tiny GGUF described in the module docstring."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(1024)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, kinds = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)
    for name, array in tensors(n_layers, seed).items():
        data = array
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(array, TINY["heads"], TINY["heads"])
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(array, TINY["heads"], TINY["kv_heads"])
        if name.endswith("norm.weight"):
            w.add_tensor(gguf_name(name), data)
        else:
            qtype = Q8_0 if name == "model.embed_tokens.weight" else Q4_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stored_tiny(root: Path, *, n_layers: int = 6, seed: int = 0) -> Path:
    """``write_q4_gguf`` converted kept as stored into ``root / "stored"``."""
    write_q4_gguf(root / "tiny-q4.gguf", n_layers=n_layers, seed=seed)
    return convert_gguf(root / "tiny-q4.gguf", root / "stored", progress=False)
