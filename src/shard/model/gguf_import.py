"""Convert a Llama-architecture GGUF checkpoint into a Hugging Face-style model directory.

The output is what the runtime loads: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (with the model's chat template),
``generation_config.json`` and a completion marker. By default the weights stay as stored
(``stored=True``): a tensor in a format ``shard.model.quant_gguf`` maps exactly (Q4_0, Q4_1,
Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) is written as its codes under its own name plus
``<name>.scale`` and ``<name>.offset``, described in the header's ``shard.quant`` metadata
(docs/model.md, "Weights that stay quantized"); everything else, and every tensor with
``stored=False`` (``shard convert --float32``, what ``transformers`` can load), is
dequantized to float32 with the ``gguf`` package. Nothing here imports torch.

Two llama.cpp conventions are undone on the way: Q and K projection rows are permuted for
its rope layout (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), and the tokenizer is
stored as metadata arrays rather than a ``tokenizer.json`` (read here, rebuilt by
``shard.model.gguf_vocab``).

The output directory is built next to its destination and renamed into place, with the
marker written last, so a reader never sees a half-written directory that looks complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import numpy.typing as npt
import tokenizers
from tqdm import tqdm

from shard.model.gguf_vocab import VocabError, read_vocab, tokenizer_files
from shard.model.quant_gguf import decode, stored_layout

CONVERTER_VERSION = 2
"""Bumped whenever the output of a conversion changes, so caches keyed on it are rebuilt."""

QUANT_METADATA = "shard.quant"
"""The safetensors header's metadata key listing the tensors kept quantized (a JSON object:
name -> kind, group, logical shape)."""

COMPLETE_MARKER = "shard-convert.json"
"""Written last into a converted directory; its presence means every other file is whole."""


class ConvertError(Exception):
    """A GGUF file cannot be converted; the message says why and what to do."""


class OutputExists(ConvertError):
    """The destination directory already exists (possibly published by a concurrent run)."""


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@attrs.frozen
class _Planned:
    """One output tensor: its HF name and shape, where it comes from, and its head count
    when it is a Q/K projection whose rows llama.cpp permuted (None otherwise)."""

    name: str
    shape: tuple[int, ...]
    source: gguf.ReaderTensor
    heads: int | None


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, stored: bool = True
) -> Path:
    """Convert ``gguf_path`` into a new model directory ``out_dir`` and return ``out_dir``;
    ``stored``: keep the quantized tensors as stored (module docstring), else float32.

    Everything that can be checked cheaply (architecture, metadata, tensor names, tokenizer)
    is checked before the slow tensor pass, so bad input fails in well under a second.

    Errors: ``ConvertError`` for unreadable or unsupported input; ``OutputExists`` when
    ``out_dir`` exists and is not empty, before or after the conversion (a concurrent
    converter published first; this run's work is discarded).
    """
    reader = _open(gguf_path)
    config, plan = _plan(reader)
    tokenizer, tokenizer_config, generation_config = _vocab(reader, config)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise OutputExists(f"{out_dir} already exists; remove it or choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared model directory private
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_safetensors(tmp / "model.safetensors", plan, progress=progress, stored=stored)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "weights": "stored" if stored else "float32",
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
        }
        _write_json(tmp / COMPLETE_MARKER, marker)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def is_complete(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a finished conversion (its completion marker exists)."""
    return (model_dir / COMPLETE_MARKER).is_file()


def unpermute_qk(weight: npt.NDArray[np.float32], n_head: int) -> npt.NDArray[np.float32]:
    """Undo llama.cpp's rope permutation of a Q or K projection weight ``[n_head * D, in]``.

    llama.cpp rotates interleaved pairs (x0, x1), HF rotates halves (x0, x_{D/2}); the
    converter reorders each head's rows ``[2, D/2] -> [D/2, 2]``. This is the inverse.
    ``n_head`` is the number of query heads for Q and of KV heads for K.
    """
    rows = weight.shape[0]
    w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])  # [H, D/2, 2, in]
    return w.swapaxes(1, 2).reshape(weight.shape)  # [H, 2, D/2, in] -> [H * D, in]


def convert_main(argv: list[str] | None = None) -> int:
    """``shard convert MODEL.gguf OUT_DIR``: convert, print where it wrote, return 0 or 2."""
    parser = _Parser(
        prog="shard convert",
        description="Convert a Llama-architecture GGUF checkpoint into a model directory "
        "(config.json, model.safetensors, tokenizer.json, tokenizer_config.json); quantized "
        "tensors stay quantized where an exact mapping exists (docs/model.md).",
    )
    parser.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="the GGUF file to read")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--float32",
        action="store_true",
        help="dequantize every tensor to float32 (a checkpoint transformers can load)",
    )
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(f"shard convert: error: {exc} (see shard convert --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        out = convert_gguf(
            args.gguf, args.out_dir, progress=not args.no_progress, stored=not args.float32
        )
    except ConvertError as exc:
        print(f"shard convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as an exception so ``convert_main`` can return 2 itself."""

    def error(self, message: str) -> Any:
        raise _UsageError(message)


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ConvertError(f"{path}: no such file; pass the path of a .gguf checkpoint")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct.error, ...
        raise ConvertError(f"{path}: not a readable GGUF file ({exc})") from exc


def _meta(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """The metadata value under ``key``; ``ConvertError`` when absent and no default given."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ConvertError(f"GGUF metadata has no {key!r}; the file is incomplete")
        return default
    return field.contents()


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 (9.999999747e-06 -> 1e-05)."""
    return float(np.format_float_scientific(np.float32(value), unique=True))


def _plan(reader: gguf.GGUFReader) -> tuple[dict[str, Any], list[_Planned]]:
    """The HF ``config.json`` and the list of output tensors, both validated."""
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(
            f"architecture {arch!r} is not supported; this converter handles Llama-architecture "
            "GGUFs (Llama, Mistral, SmolLM) only"
        )
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ConvertError("GGUF has no token_embd.weight tensor; the file is incomplete")
    config = _config(reader, vocab_rows=int(by_name["token_embd.weight"].shape[-1]))
    config["tie_word_embeddings"] = "output.weight" not in by_name
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    plan = []
    for t in reader.tensors:
        block = _BLOCK_RE.fullmatch(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        plan.append(_Planned(_hf_name(t.name), shape, t, heads.get(block[2]) if block else None))
    layers = {int(m[1]) for t in reader.tensors if (m := _BLOCK_RE.fullmatch(t.name))}
    if layers != set(range(config["num_hidden_layers"])):
        n = config["num_hidden_layers"]
        raise ConvertError(f"GGUF has tensors for {len(layers)} blocks but metadata says {n}")
    return config, plan


def _config(reader: gguf.GGUFReader, *, vocab_rows: int) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` from the ``llama.*`` metadata keys."""
    hidden = int(_meta(reader, "llama.embedding_length"))
    n_head = int(_meta(reader, "llama.attention.head_count"))
    head_dim = int(_meta(reader, "llama.attention.key_length", hidden // n_head))
    if int(_meta(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise ConvertError("partial rotary embeddings are not supported by this converter")
    scaling = _meta(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ConvertError(f"rope scaling {scaling!r} is not supported by this converter")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_meta(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_meta(reader, "llama.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(reader, "llama.context_length")),
        "rms_norm_eps": _f32(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_meta(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab_rows,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def _vocab(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> tuple[tokenizers.Tokenizer, dict[str, Any], dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and generation_config.json from the metadata."""
    try:
        return tokenizer_files(read_vocab(reader), config)
    except VocabError as exc:
        raise ConvertError(str(exc)) from None


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    block = _BLOCK_RE.fullmatch(name)
    if block and block[2] in _BLOCK_NAMES:
        return f"model.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.weight"
    raise ConvertError(
        f"tensor {name!r} has no Llama equivalent; this converter handles plain "
        "Llama-architecture GGUFs only (no biases, no rope_freqs)"
    )


def _load(planned: _Planned) -> npt.NDArray[np.float32]:
    t = planned.source
    array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    array = array.reshape(planned.shape)
    return array if planned.heads is None else unpermute_qk(array, planned.heads)


def _entries(p: _Planned, stored: bool) -> list[tuple[str, str, list[int], int]]:
    """The safetensors entries ``(name, dtype, shape, bytes)`` one planned tensor becomes."""
    layout = stored_layout(p.source.tensor_type) if stored else None
    if layout is None or len(p.shape) != 2:
        return [(p.name, "F32", list(p.shape), 4 * int(np.prod(p.shape, dtype=np.int64)))]
    kind, group, has_offset = layout
    n, k = p.shape
    width = k // 2 if kind == "int4" else k
    codes = (p.name, "U8" if kind == "int4" else "I8", [n, width], n * width)
    scales = [(f"{p.name}.scale", "F32", [n, k // group], 4 * n * (k // group))]
    if has_offset:
        scales.append((f"{p.name}.offset", "F32", [n, k // group], 4 * n * (k // group)))
    return [codes, *scales]


def _arrays(p: _Planned, stored: bool) -> list[npt.NDArray[Any]]:
    """The data of ``_entries(p, stored)``, in that order."""
    d = None
    if len(_entries(p, stored)) > 1:
        d = decode(p.source.data, p.source.tensor_type, (p.shape[0], p.shape[1]))
    if d is None:
        return [_load(p)]
    if p.heads is not None:
        rows = np.arange(p.shape[0], dtype=np.float32).reshape(-1, 1)  # exact up to 2^24 rows
        d = d.rows(unpermute_qk(rows, p.heads).reshape(-1).astype(np.intp))
    codes, scale, offset = d.arrays()
    return [codes, scale] + ([] if offset is None else [offset])


def _write_safetensors(path: Path, plan: list[_Planned], *, progress: bool, stored: bool) -> None:
    """Write the tensors one at a time, so peak memory is one tensor, not the model.

    The safetensors format is an 8-byte little-endian header length, a JSON header of
    dtypes, shapes and byte ranges (padded to 8 bytes), then the raw data in that order.
    """
    quant: dict[str, Any] = {}
    header: dict[str, Any] = {}
    offset = 0
    for p in plan:
        entries = _entries(p, stored)
        if len(entries) > 1:
            kind, group, _ = stored_layout(p.source.tensor_type) or ("", 0, False)
            quant[p.name] = {"kind": kind, "group": group, "shape": list(p.shape)}
        for name, dtype, shape, size in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    meta = {"format": "pt"}
    if quant:
        meta[QUANT_METADATA] = json.dumps(quant, separators=(",", ":"))
    blob = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p in _bar(plan, progress):
            for array in _arrays(p, stored):
                f.write(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
        f.flush()
        os.fsync(f.fileno())


def _bar(plan: list[_Planned], progress: bool) -> Iterator[_Planned]:
    bar = tqdm(plan, desc="converting", unit="tensor", disable=not progress, leave=False)
    for p in bar:
        bar.set_postfix_str(p.name, refresh=False)
        yield p


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` into place; renaming onto a non-empty directory fails,
    which is how a concurrent converter that lost the race finds out."""
    try:
        os.rename(tmp, out_dir)
    except OSError as exc:
        if out_dir.exists():
            raise OutputExists(f"{out_dir} appeared while converting; keeping it") from exc
        raise ConvertError(f"could not move the converted model into {out_dir}: {exc}") from exc
