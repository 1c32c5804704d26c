"""Test helpers for the GGUF converter, the tokenizer and the bundled model.

``smollm2_dir()`` converts the bundled SmolLM2 GGUF once per machine into the user cache,
the same entry ``shard`` itself uses, so the whole suite (and later runs) share one copy.
``write_tiny_gguf`` writes a small Llama-shaped GGUF the way llama.cpp's converter does
(Q/K rows permuted, byte-level vocabulary in metadata) for fast converter and cache tests.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np

from shard.convert.bundled import resolve_model

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "layers": 2}
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@functools.cache
def smollm2_dir() -> Path:
    """The converted bundled SmolLM2 (converted on first use, about six seconds)."""
    return resolve_model("smollm2", progress=False)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + i) for i, b in enumerate(extra)},
    }


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Tokens and token types: 3 control tokens, the 256 byte tokens, then merge results."""
    tokens = [*TINY_SPECIALS, *bytes_to_unicode().values()]
    tokens += [m.replace(" ", "") for m in TINY_MERGES]
    kinds = [gguf.TokenType.CONTROL] * len(TINY_SPECIALS)
    kinds += [gguf.TokenType.NORMAL] * (len(tokens) - len(TINY_SPECIALS))
    return tokens, [int(k) for k in kinds]


def hf_tensors(seed: int, *, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny model, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)
    h, ffn = TINY["hidden"], TINY["ffn"]
    kv = TINY["kv_heads"] * h // TINY["heads"]
    vocab = len(tiny_vocab()[0])
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(TINY["layers"]):
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
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def gguf_name(hf_name: str) -> str:
    """The llama.cpp tensor name of a Hugging Face tensor name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    part = ".".join(rest[:-1])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{names[part]}.weight"


def tiny_qtype(hf_name: str) -> gguf.GGMLQuantizationType:
    """Norms and layer 0's Q/K stay float32 (exact checks); F16 and Q8_0 elsewhere."""
    if hf_name.endswith("norm.weight") or hf_name.startswith("model.layers.0.self_attn.q"):
        return F32
    if "k_proj" in hf_name or "v_proj" in hf_name:
        return F32 if ".0." in hf_name else F16
    return Q8_0


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    tied: bool = True,
    arch: str = "llama",
    pre: str = "smollm",
    chat_template: str | None = TINY_TEMPLATE,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF as llama.cpp would; return the HF tensors a converter must recover
    (already passed through the same F16/Q8_0 rounding, which commutes with row order)."""
    expected = hf_tensors(seed, tied=tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, kinds = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, array in expected.items():
        qtype = tiny_qtype(name)
        data = array
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(array, TINY["heads"], TINY["heads"])
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(array, TINY["heads"], TINY["kv_heads"])
        if qtype == F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
            expected[name] = array.astype(np.float16).astype(np.float32)
        elif qtype == Q8_0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
