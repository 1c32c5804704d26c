"""Convert a Llama-, Mixtral-, Gemma 3-, Qwen3-, Qwen3-MoE-, Qwen3-Next-, gpt-oss-, GLM-4.5-MoE-,
DeepSeek-V3- (``deepseek2``) or MiniMax-M2-architecture GGUF checkpoint into a Hugging Face-style
model directory.

The output is what the runtime loads: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (with the model's chat template),
``generation_config.json`` and a completion marker. By default the weights stay as stored
(``stored=True``): a tensor in a format ``shard.convert.quant_gguf`` maps exactly (Q4_0, Q4_1,
Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, MXFP4) is written as its codes under its own name plus
``<name>.scale`` and ``<name>.offset``, described in the header's ``shard.quant`` metadata
(docs/model.md, "Weights that stay quantized"); everything else, and every tensor with
``stored=False`` (``shard convert --float32``, what ``transformers`` can load), is
dequantized to float32 with the ``gguf`` package. Nothing here imports torch.

llama.cpp's conventions are undone on the way (per architecture: ``shard.convert.gguf_arch``):
Llama's Q and K projection rows are permuted for its rope layout (``convert_hf_to_gguf.py``'s
``LlamaModel.permute``), Gemma 3's norm weights are stored as ``1 + w`` (``w`` is written:
the stored float32 minus one, as transformers' GGUF loader computes it), the fused 3-D expert
tensors of Mixtral, Qwen3-MoE and GLM are split into one 2-D tensor per expert (each kept
stored), gpt-oss's are put back into its fused layout (``mlp.experts.gate_up_proj`` ``[E, D,
2F]``, gate and up interleaved, and ``down_proj`` ``[E, F, D]``, with their biases) — or,
kept stored, into one 2-D linear weight per expert and projection
(``mlp.experts.gate_up_proj.E``: ``[2F, D]``, rows interleaved; ``mlp.experts.down_proj.E``:
``[D, F]``), which the loader installs as ``FusedExperts``' quantized linears — GLM's
multi-token-prediction layers are left out, ``deepseek2``'s split ``attn_k_b`` / ``attn_v_b``
are joined back into ``kv_b_proj`` (``shard.convert.gguf_mla``), ``qwen3next``'s ``A_log``,
``in_proj_qkvz`` and ``conv1d`` are put back (``shard.convert.gguf_next``), and the tokenizer is
stored as metadata arrays rather than a ``tokenizer.json`` (read here, rebuilt by
``shard.convert.gguf_vocab``).

The output directory is built next to its destination and renamed into place, with the
marker written last, so a reader never sees a half-written directory that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from shard.convert.gguf_arch import (
    ARCHES,
    FUSED_EXPERTS,
    GLOBAL_NAMES,
    ROPE_FREQS,
    ConvertError,
    GgufArch,
    arch_of,
)
from shard.convert.gguf_common import MAX_BLOCKS, count
from shard.convert.gguf_file import GgufFile
from shard.convert.gguf_mla import SPLIT_KV, join_arrays, join_kv_b
from shard.convert.gguf_next import QKVZ_PARTS, a_log, hf_shape, join_qkvz, qkvz_arrays
from shard.convert.gguf_plan import Planned, fuse_experts, split_experts
from shard.convert.gguf_tensors import check_tensors, check_types
from shard.convert.gguf_vocab import read_vocab, tokenizer_files
from shard.convert.quant_gguf import Decoded, decode, stored_layout

CONVERTER_VERSION = 2
"""Bumped whenever the output of a conversion changes, so caches keyed on it are rebuilt."""

QUANT_METADATA = "shard.quant"
"""The safetensors header's metadata key listing the tensors kept quantized (a JSON object:
name -> kind, group, logical shape)."""

COMPLETE_MARKER = "shard-convert.json"
"""Written last into a converted directory; its presence means every other file is whole."""


__all__ = [
    "COMPLETE_MARKER",
    "CONVERTER_VERSION",
    "QUANT_METADATA",
    "ConvertError",
    "OutputExists",
    "convert_gguf",
    "is_complete",
    "unpermute_qk",
]


class OutputExists(ConvertError):
    """The destination directory already exists (possibly published by a concurrent run)."""


_BLOCK_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)\.(weight|bias)")
_BARE_RE = re.compile(r"blk\.(\d+)\.(\w+)")  # a block tensor without suffix (GgufArch.bare)


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, stored: bool = True
) -> Path:
    """Convert ``gguf_path`` into a new model directory ``out_dir`` and return ``out_dir``;
    ``stored``: keep the quantized tensors as stored (module docstring), else float32.

    Everything that can be checked cheaply (the header's layout, bounded before anything is
    allocated: ``shard.convert.gguf_scan``; architecture, metadata, tensor names and shapes,
    tokenizer) is checked before the slow tensor pass, so bad input fails in well under a
    second.

    Errors: ``ConvertError`` for unreadable, inconsistent or unsupported input, one line
    starting with the file's path; ``OutputExists`` when ``out_dir`` exists and is not
    empty, before or after the conversion (a concurrent converter published first; this
    run's work is discarded).
    """
    try:
        reader = _open(gguf_path)
        config, plan = _plan(reader, stored=stored)
        tokenizer, tokenizer_config, generation_config = tokenizer_files(read_vocab(reader), config)
    except ConvertError as exc:
        raise ConvertError(f"{gguf_path}: {exc}") from exc
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


def _open(path: Path) -> GgufFile:
    """The GGUF at ``path``, its header read within bounds and checked (``GgufFile``)."""
    if not path.is_file():
        raise ConvertError("no such file; pass the path of a .gguf checkpoint")
    try:
        return GgufFile(path)
    except OSError as exc:
        raise ConvertError(f"cannot read it ({exc.strerror or exc})") from exc
    except ConvertError as exc:
        raise ConvertError(f"not a readable GGUF file: {exc}") from exc


def _plan(reader: GgufFile, *, stored: bool) -> tuple[dict[str, Any], list[Planned]]:
    """The HF ``config.json`` and the list of output tensors, both validated (``stored``:
    gpt-oss's experts are planned per expert where their format is kept)."""
    name, arch = arch_of(reader)
    if arch is None:
        raise ConvertError(
            f"general.architecture: architecture {name!r} is not supported; this converter handles "
            f"{', '.join(sorted(ARCHES))} GGUFs (Llama, Mistral, Mixtral, SmolLM, Gemma 3, Qwen3, "
            "Qwen3-MoE, Qwen3-Next, gpt-oss, GLM-4.5-MoE, DeepSeek-V3 / Kimi K2, MiniMax-M2) only"
        )
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ConvertError("tensor 'token_embd.weight': missing; the file is incomplete")
    config = arch.config(reader, int(by_name["token_embd.weight"].shape[-1]))
    config["tie_word_embeddings"] = "output.weight" not in by_name
    check_types({t.name: t.tensor_type for t in reader.tensors})
    check_tensors(name, config, {t.name: _shape(t) for t in reader.tensors})
    n_layers = config["num_hidden_layers"]
    extra = 0
    if arch.extra_blocks:
        extra = count(reader, arch.extra_blocks, 0, least=0, most=MAX_BLOCKS)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if not arch.permuted_qk:
        heads = {}
    plan = []
    fused: dict[tuple[int, str], dict[str, gguf.ReaderTensor]] = {}
    split: dict[int, dict[str, gguf.ReaderTensor]] = {}
    qkvz: dict[int, dict[str, gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        block = _BLOCK_RE.fullmatch(t.name)
        shape = _shape(t)
        bare = _BARE_RE.fullmatch(t.name)
        if bare and bare[2] in arch.bare and int(bare[1]) < n_layers:  # qwen3next's ssm_a
            hf = f"model.layers.{bare[1]}.{arch.bare[bare[2]]}"
            plan.append(Planned(hf, shape, t, None, a_log=True))
            a_log(_float32(plan[-1], t))  # refused now, not after the slow pass (tiny: [Hv])
            continue
        if t.name == ROPE_FREQS and name == "llama":
            continue  # read into rope_scaling by the config reader (Llama 3.x)
        if block and int(block[1]) >= n_layers:
            continue  # a multi-token-prediction layer (``extra``), counted below
        if block and arch.fused and block[2] in FUSED_EXPERTS:
            fused.setdefault((int(block[1]), block[3]), {})[block[2]] = t
            continue
        if block and block[2] in SPLIT_KV and name == "deepseek2" and block[3] == "weight":
            if f"blk.{block[1]}.attn_kv_b.weight" not in by_name:  # else a redundant copy
                split.setdefault(int(block[1]), {})[block[2]] = t
            continue
        if block and name == "qwen3next" and block[2] in QKVZ_PARTS and block[3] == "weight":
            qkvz.setdefault(int(block[1]), {})[block[2]] = t
            continue
        if block and block[2] in arch.experts:
            if block[3] != "weight":
                raise ConvertError(f"tensor {t.name!r}: {name} experts have no biases")
            prefix = f"model.layers.{block[1]}.{arch.experts_prefix}"
            plan += split_experts(t, shape, prefix, arch.experts[block[2]])
            continue
        hf = _hf_name(t.name, arch, name)
        plus_one = arch.norm_plus_one and t.name.endswith("norm.weight")
        plus_one = plus_one and not t.name.endswith(arch.plain_norms)
        permuted = heads.get(block[2]) if block and block[3] == "weight" else None
        if block and name == "qwen3next":
            shape = hf_shape(f"{block[2]}.{block[3]}", shape)
        plan.append(Planned(hf, shape, t, permuted, plus_one))
    for (layer, suffix), parts in sorted(fused.items()):
        plan += fuse_experts(layer, suffix, parts, stored=stored)
    plan += [join_kv_b(layer, parts) for layer, parts in sorted(split.items())]
    plan += [join_qkvz(layer, parts, config) for layer, parts in sorted(qkvz.items())]
    layers = {int(m[1]) for t in reader.tensors if (m := _BLOCK_RE.fullmatch(t.name))}
    layers |= {int(m[1]) for t in reader.tensors if (m := _BARE_RE.fullmatch(t.name))}
    if layers != set(range(n_layers + extra)):
        n = n_layers + extra
        raise ConvertError(
            f"block_count: the metadata says {n} blocks but the file has tensors for "
            f"{len(layers)} (numbered {min(layers, default=0)}..{max(layers, default=-1)})"
        )
    return config, plan


def _shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    """``t``'s shape in numpy order (GGUF lists dims innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _hf_name(name: str, arch: GgufArch, arch_name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    block = _BLOCK_RE.fullmatch(name)
    if block:
        layer, short, suffix = block[1], block[2], block[3]
        if f"{short}.{suffix}" in arch.blocks:  # a name of its own (``self_attn.sinks``)
            return f"model.layers.{layer}.{arch.blocks[f'{short}.{suffix}']}"
        if short in arch.blocks and (suffix == "weight" or short in _BIASED.get(arch_name, ())):
            return f"model.layers.{layer}.{arch.blocks[short]}.{suffix}"
    raise ConvertError(
        f"tensor {name!r} has no {arch_name} equivalent; this converter handles the plain "
        f"{arch_name} layout only (rope_freqs, and biases the family does not have, are refused)"
    )


_BIASED = {
    "gpt-oss": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"),
    "glm4moe": ("attn_q", "attn_k", "attn_v"),
}
"""The block tensors whose ``.bias`` each architecture has (every other bias is refused: the
model would silently run without it)."""


def _float32(p: Planned, source: gguf.ReaderTensor) -> npt.NDArray[np.float32]:
    """``source`` (the planned tensor's, or its ``up``) dequantized to float32, in its own
    shape (one expert's slice when ``p`` is one expert's)."""
    shape = tuple(int(d) for d in reversed(source.shape.tolist()))
    if p.expert is not None:
        shape = shape[1:]
    array = gguf.quants.dequantize(p.data(source), source.tensor_type)
    return array.astype(np.float32, copy=False).reshape(shape)


def _load(planned: Planned) -> npt.NDArray[np.float32]:
    array = _float32(planned, planned.source)
    if planned.a_log:  # qwen3next's ssm_a: -exp(A_log)
        return a_log(array)
    if planned.qkvz is not None:  # qwen3next's in_proj_qkvz, split on the way out
        assert planned.up is not None
        return qkvz_arrays(array, _float32(planned, planned.up), planned.qkvz)
    if planned.latent:  # deepseek2's split kv_b_proj
        assert planned.up is not None
        return join_arrays(array, _float32(planned, planned.up), planned.shape)
    if planned.up is not None:  # gate and up interleaved along the output axis, gate first
        axis = 0 if planned.expert is not None else 1
        up = _float32(planned, planned.up)
        array = np.stack([array, up], axis=axis + 1)
        array = array.reshape(*array.shape[:axis], -1, *array.shape[axis + 2 :])
    if planned.transpose:
        array = array.swapaxes(-1, -2)
    array = array.reshape(planned.shape)
    if planned.plus_one:
        array = array - np.float32(1)  # llama.cpp stored 1 + w (as transformers undoes it)
    return array if planned.heads is None else unpermute_qk(array, planned.heads)


def _entries(p: Planned, stored: bool) -> list[tuple[str, str, list[int], int]]:
    """The safetensors entries ``(name, dtype, shape, bytes)`` one planned tensor becomes."""
    layout = stored_layout(p.source.tensor_type) if stored and not p.dense_only else None
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


def _arrays(p: Planned, stored: bool) -> list[npt.NDArray[Any]]:
    """The data of ``_entries(p, stored)``, in that order."""
    d = None
    if len(_entries(p, stored)) > 1:
        if p.up is not None:  # one gpt-oss expert's gate and up rows, interleaved
            half = (p.shape[0] // 2, p.shape[1])
            gate = decode(p.data(), p.source.tensor_type, half)
            up = decode(p.data(p.up), p.up.tensor_type, half)
            d = None if gate is None or up is None else _interleave(gate, up)
        else:
            d = decode(p.data(), p.source.tensor_type, (p.shape[0], p.shape[1]))
    if d is None:
        return [_load(p)]
    if p.heads is not None:
        rows = np.arange(p.shape[0], dtype=np.float32).reshape(-1, 1)  # exact up to 2^24 rows
        d = d.rows(unpermute_qk(rows, p.heads).reshape(-1).astype(np.intp))
    codes, scale, offset = d.arrays()
    return [codes, scale] + ([] if offset is None else [offset])


def _interleave(a: Decoded, b: Decoded) -> Decoded:
    """The rows of ``a`` and ``b`` (same layout) alternated, ``a`` first (exact: groups run
    along each row)."""

    def rows(x: npt.NDArray[Any], y: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.stack([x, y], axis=1).reshape(2 * x.shape[0], *x.shape[1:])

    offset = None if a.offset is None or b.offset is None else rows(a.offset, b.offset)
    return attrs.evolve(
        a, codes=rows(a.codes, b.codes), scale=rows(a.scale, b.scale), offset=offset
    )


def _write_safetensors(path: Path, plan: list[Planned], *, progress: bool, stored: bool) -> None:
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
    info = {"format": "pt"}
    if quant:
        info[QUANT_METADATA] = json.dumps(quant, separators=(",", ":"))
    blob = json.dumps({"__metadata__": info, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p in _bar(plan, progress):
            for array in _arrays(p, stored):
                f.write(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
        f.flush()
        os.fsync(f.fileno())


def _bar(plan: list[Planned], progress: bool) -> Iterator[Planned]:
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
