"""Load one stage's block of layers from a Hugging Face safetensors checkpoint.

A stage reads only its own tensors: ``shard.model.tensorfile`` reads one named tensor's bytes
with ``pread`` (the file is never mapped, so its pages do not count in the stage's resident
memory), so a stage holding 4 of 80 layers never touches the other 76 (nor the
embedding, unless it is stage 0 or a tied tail). Every tensor's shape is checked against the
config from the file header before its data is read.

A checkpoint written by ``shard convert`` may hold tensors kept quantized (listed in the
safetensors header's ``shard.quant`` metadata: codes under the tensor's name, ``.scale`` and
``.offset`` beside it). ``weights`` (``shard.model.weights``) says what a stage makes of them:
dense floats (dequantized exactly), the stored codes run by ``shard.model.quant``, or int8/int4
quantized at load (gpt-oss's fused 3-D experts too, one ``QuantLinear`` per expert).

Errors: every problem an operator can hit (missing directory, config or safetensors, a missing
tensor, a shape mismatch, an unsupported architecture, a bad layer range) is a
``ModelLoadError`` that names the thing and says what to do.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from shard.model import heap
from shard.model.attention import Attention
from shard.model.config import ModelConfig, ModelLoadError
from shard.model.deltanet import GatedDeltaNet
from shard.model.dsa import IndexWeights
from shard.model.fp8 import fp8_weight
from shard.model.fused import join_siblings
from shard.model.held import hold_small_groups
from shard.model.linear import Linear
from shard.model.llama import StageModel
from shard.model.mla import MLAttention
from shard.model.moe import FusedExperts, Router
from shard.model.native import attach
from shard.model.quant import (
    QuantEmbedding,
    Quantized,
    QuantLinear,
    quantize_int4,
    quantize_int8,
)
from shard.model.safetensors_header import SafetensorsError, quant_entries, read_index
from shard.model.tensorfile import TensorFile, open_tensors
from shard.model.weights import QUANTIZED_WEIGHTS, check_weights, resolve_weights

QUANT_METADATA = "shard.quant"  # as shard.convert.gguf_import writes it

__all__ = ["ModelLoadError", "checkpoint_index", "hf_name", "load_stage", "load_truncated"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_stage(
    model_dir: Path,
    first: int,
    last: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
    weights: str | None = None,
    join: bool = True,
) -> StageModel:
    """Build ``StageModel(config, first, last)`` with weights read from ``model_dir``.

    The module is built on the meta device (no memory, no random init) and each parameter is
    then replaced by the checkpoint tensor, converted to ``dtype`` on ``device``: each tensor
    passes through host memory alone on its way to a GPU, so a CUDA stage never holds a CPU
    copy of its block.
    ``config`` overrides the checkpoint's own (``load_truncated`` uses it to cut the layer count).
    ``weights``: how the block holds its weights (``shard.model.weights``; None: the
    checkpoint's default, ``resolve_weights``: stored for a quantized checkpoint, dense in
    ``dtype`` for a float one). ``join``: run sibling CPU int4 products (q/k/v, gate/up) as
    one, the same bytes faster (``shard.model.fused``), and hold K-quant weights dequantized
    where a layer's add at most 16 MiB (``shard.model.held``); False keeps them apart and
    dequantizes per call, the reference both fast paths are tested against. Errors:
    ``ModelLoadError`` for a ``weights`` that contradicts ``dtype``.
    """
    try:
        check_weights(weights, dtype)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist; fetch the model first")
    weights = resolve_weights(weights, model_dir, dtype)
    if config is None:
        config = ModelConfig.from_dir(model_dir)
    if not 0 <= first < last <= config.n_layers:
        raise ModelLoadError(
            f"bad layer range [{first}, {last}) for {model_dir} which has {config.n_layers} "
            f"layers: need 0 <= first < last <= {config.n_layers}"
        )
    weight_map = checkpoint_index(model_dir)
    with torch.device("meta"):
        stage = build_stage(config, first, last)
    wanted = {name: hf_name(config, first, name) for name, _ in stage.named_parameters()}
    by_file: dict[str, list[str]] = defaultdict(list)
    for local, remote in wanted.items():
        if remote not in weight_map and f"{remote}.0" in weight_map:
            remote = f"{remote}.0"  # a fused expert weight kept stored per expert
        if remote not in weight_map:
            raise ModelLoadError(
                f"tensor {remote!r} (for layers [{first}, {last})) is missing from the "
                f"checkpoint in {model_dir}; the download is incomplete or not this model"
            )
        by_file[weight_map[remote]].append(local)
    with heap.loading():  # temporaries unmapped when freed, the heap trimmed after
        for file, locals_ in sorted(by_file.items()):
            names = {n: wanted[n] for n in locals_}
            _load_file(stage, model_dir / file, names, dtype, device, weights)
        if config.tie_word_embeddings:
            _tie_head(stage, device)
        if join:  # the siblings' packed tensors it frees are load temporaries too
            join_siblings(stage)
            hold_small_groups(list(stage.layers))  # K-quant weights dequantized once, not per call
    if weights in QUANTIZED_WEIGHTS:  # row-invariant kernels: verify equals decode bit for bit
        for module in stage.modules():
            if isinstance(
                module, Attention | MLAttention | GatedDeltaNet | Router | IndexWeights | Linear
            ):
                module.rowwise = True
    stage = stage.to(device).eval()
    if join:  # the layers in C++ where they fit: the same bytes (shard.model.native)
        attach(stage)
    return stage


def load_truncated(
    model_dir: Path,
    n_layers: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    weights: str | None = None,
) -> StageModel:
    """The first ``n_layers`` of a checkpoint plus its final norm and LM head, as one model.

    A cheap draft that needs no extra weights (its agreement with the full model is poor on
    a well-trained model — see docs/speculation.md); also the test fixture for tunable α.
    """
    full = ModelConfig.from_dir(Path(model_dir))
    if not 0 < n_layers <= full.n_layers:
        raise ModelLoadError(
            f"a truncated draft needs 1..{full.n_layers} layers of {model_dir}, got {n_layers}"
        )
    config = attrs.evolve(full, n_layers=n_layers)
    return load_stage(
        model_dir, 0, n_layers, dtype=dtype, device=device, config=config, weights=weights
    )


def build_stage(config: ModelConfig, first: int, last: int) -> StageModel:
    """The family's stage module: ``StageModel``, or DeepSeek-V4's own (``V4Stage``)."""
    if config.v4 is not None:
        from shard.model.deepseek_v4 import V4Stage

        return V4Stage(config, first, last)
    return StageModel(config, first, last)


def checkpoint_index(model_dir: Path) -> dict[str, str]:
    """Map every tensor name in the checkpoint to the safetensors file (relative) holding it.

    Uses ``model.safetensors.index.json`` when present, else the single ``model.safetensors``
    (whose header, not data, is read for the names).
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            return read_index(model_dir)
        except SafetensorsError as e:
            raise ModelLoadError(f"{e}; re-download the checkpoint") from None
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(
            f"no safetensors weights in {model_dir} (neither {SINGLE_FILE} nor {INDEX_FILE}); "
            "download the safetensors files, or convert a GGUF with `shard convert`"
        )
    try:
        with open_tensors(single) as f:  # the header only
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"cannot read {single}: {e}; re-download the checkpoint") from e


def hf_name(config: ModelConfig, first: int, local: str) -> str:
    """The checkpoint name of a ``StageModel`` parameter: local layer ``j`` is ``first + j``.

    A tied head reads the embedding matrix (tied checkpoints carry no ``lm_head.weight``).
    """
    if local == "lm_head.weight":
        tied = "model.embed_tokens.weight" if config.tie_word_embeddings else local
        return "head.weight" if config.v4 is not None and not config.tie_word_embeddings else tied
    if local.startswith("layers."):
        _, j, rest = local.split(".", 2)
        if config.moe is not None and not config.moe.bias_in_gate:  # the layer's, not the gate's
            rest = rest.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
        return f"model.layers.{first + int(j)}.{rest}"
    return f"model.{local}"


def _load_file(
    stage: StageModel,
    path: Path,
    names: dict[str, str],
    dtype: torch.dtype,
    device: torch.device | str,
    weights: str | None,
) -> None:
    """Read ``names`` (local -> checkpoint name) from one file into ``stage``, checking shapes."""
    try:
        with open_tensors(path, device) as f:
            quant = {name: attrs.asdict(q) for name, q in quant_entries(f.header).items()}
            for local, remote in names.items():
                param = stage.get_parameter(local)
                if remote not in quant and f"{remote}.0" in quant:
                    _place_experts(stage, local, f, remote, quant, dtype, weights)
                    heap.trim()
                    continue
                got = tuple(quant[remote]["shape"]) if remote in quant else f.shape(remote)
                if got != tuple(param.shape):
                    raise ModelLoadError(
                        f"tensor {remote!r} in {path.name} has shape {list(got)} but the config "
                        f"expects {list(param.shape)}; config.json and weights disagree"
                    )
                if f.header.entries[remote].dtype == "F8_E4M3":  # a published FP8 weight
                    w = _read_fp8(f, remote, stage.config)
                    if isinstance(w, Quantized):
                        _place(stage, local, w, None, dtype, device, weights)
                    else:
                        _place(stage, local, None, w.to(dtype), dtype, device, weights)
                    heap.trim()
                    continue
                owner = stage.get_submodule(local.rpartition(".")[0])
                fused = param.dim() == 3 and isinstance(owner, FusedExperts)  # not a conv1d
                if fused and remote not in quant and _fused_fits(got, weights):
                    _place_fused(stage, local, f, remote, weights)
                    heap.trim()
                    continue
                if remote in quant:
                    q = _read_quantized(f, remote, quant[remote])
                    _place(stage, local, q, None, dtype, device, weights)
                    heap.trim()  # each tensor's temporaries, before the next one's
                    continue
                # Read into torch's own (64-byte aligned) memory (``TensorFile``): CPU
                # matrix-vector kernels sum in an order that depends on the weights'
                # alignment, so a stage loaded here and one whose weights were copied
                # elsewhere would otherwise decode different low bits.
                tensor = f.get_tensor(remote).to(dtype)
                _place(stage, local, None, tensor, dtype, device, weights)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, struct.error) as e:  # a corrupt or truncated file
        raise ModelLoadError(f"cannot read {path}: {e}; re-download the checkpoint") from e


def _read_fp8(f: TensorFile, name: str, config: ModelConfig) -> Quantized | Tensor:
    """An FP8 weight and its ``weight_scale_inv`` (``shard.model.fp8``), as stored or dense."""
    scale = name.removesuffix("weight") + "weight_scale_inv"
    if config.weight_block is None:
        raise ModelLoadError(
            f"{f.path}: {name!r} is FP8 but config.json has no quantization_config with its "
            "weight_block_size; re-download the checkpoint's config.json"
        )
    if scale not in f.header.entries:
        raise ModelLoadError(
            f"{f.path}: FP8 weight {name!r} has no {scale!r} beside it in the same file"
        )
    try:
        return fp8_weight(f.get_tensor(name), f.get_tensor(scale), config.weight_block)
    except ValueError as e:
        raise ModelLoadError(f"{f.path}: {name!r}: {e}") from None


def _read_quantized(f: TensorFile, name: str, meta: dict[str, Any]) -> Quantized:
    """The ``Quantized`` stored under ``name`` (codes), ``name.scale`` and ``name.offset``."""
    keys = set(f.keys())  # each tensor read into memory of its own (``TensorFile``)
    offset = f.get_tensor(f"{name}.offset") if f"{name}.offset" in keys else None
    codes, scale = f.get_tensor(name), f.get_tensor(f"{name}.scale")
    group = int(meta["group"])
    if meta["kind"] == "int4":
        return Quantized("int4", codes, scale, offset, group)
    return Quantized("int8", codes, scale, offset, group)


def _place(
    stage: StageModel,
    local: str,
    q: Quantized | None,
    dense: Tensor | None,
    dtype: torch.dtype,
    device: torch.device | str,
    weights: str | None,
) -> None:
    """Install one weight, stored ``q`` or ``dense``, as ``weights`` says (module docstring)."""
    owner = local.rpartition(".")[0]
    # Linear layers and the embedding only: a MoE router (shard.model.moe.Router) stays dense.
    linear = isinstance(stage.get_submodule(owner), (nn.Linear, nn.Embedding))
    matrix = linear and local.endswith(".weight") and not local.endswith("norm.weight")
    if matrix and weights in ("int8", "int4"):
        w = q.dequantize() if q is not None else dense
        assert w is not None
        fits = weights == "int8" or w.shape[1] % 32 == 0
        q = (quantize_int8(w) if weights == "int8" else quantize_int4(w)) if fits else None
        dense = None if q is not None else w.to(dtype)
    if q is not None and not linear:  # a router or MLA's kv_b_proj stays a dense matrix
        dense = q.dequantize().to(dtype)
        q = None
    if q is not None and weights in ("stored", "int8", "int4"):
        if owner == "embed_tokens":
            _set_module(stage, owner, QuantEmbedding(q, dtype, device))
        else:  # a bias, loaded or still to come, moves over to the new layer
            bias = getattr(stage.get_submodule(owner), "bias", None)
            _set_module(stage, owner, QuantLinear(q, device, bias))
        return
    tensor = q.dequantize().to(dtype) if q is not None else dense
    assert tensor is not None
    _set_parameter(stage, local, nn.Parameter(tensor, requires_grad=False))


def _tie_head(stage: StageModel, device: torch.device | str) -> None:
    """A tied head on the embedding's stage runs the embedding's table (quantized or not)."""
    embed, head = stage.embed_tokens, stage.lm_head
    if embed is None or head is None:
        return
    if not isinstance(embed, QuantEmbedding):
        head.weight = embed.weight
    elif isinstance(embed.q, Quantized):  # not yet lent a head's packed table
        tied = QuantLinear(embed.q, device)  # the same stored table
        _set_module(stage, "lm_head", tied)
        if tied.path == "int8-group":  # packed once: the embedding reads the head's table
            embed.share(tied)


def _fused_fits(shape: tuple[int, ...], weights: str | None) -> bool:
    """Whether a fused ``[E, in, out]`` expert weight is quantized at load under ``weights``
    (int4 needs ``in`` a multiple of its group of 32, as for a linear in ``_place``)."""
    return weights == "int8" or (weights == "int4" and shape[1] % 32 == 0)


def _place_fused(
    stage: StageModel, local: str, f: TensorFile, remote: str, weights: str | None
) -> None:
    """Quantize a fused ``[E, in, out]`` expert weight (gpt-oss) expert by expert into
    ``QuantLinear`` s (``FusedExperts.install``), reading one expert's bytes at a time: one
    expert's float copy exists at once, never the whole fused tensor (8.5 GB in float32 for
    one gpt-oss-120b layer's ``gate_up_proj``)."""
    owner_name, _, leaf = local.rpartition(".")
    owner = stage.get_submodule(owner_name)
    if not isinstance(owner, FusedExperts):
        raise ModelLoadError(f"{local!r} is a 3-D tensor but not a fused expert weight")
    linears: list[nn.Module] = []
    for e in range(f.shape(remote)[0]):
        w = f.rows(remote, e, e + 1)[0].to(torch.float32).T  # [out, in]: column order kept
        q = quantize_int8(w) if weights == "int8" else quantize_int4(w)
        linears.append(QuantLinear(q, f.device))
    owner.install(leaf, linears)


def _place_experts(
    stage: StageModel,
    local: str,
    f: TensorFile,
    remote: str,
    quant: dict[str, Any],
    dtype: torch.dtype,
    weights: str | None,
) -> None:
    """A fused ``[E, in, out]`` expert weight kept stored one expert at a time (gpt-oss from a
    GGUF: ``remote.E``, each an ``[out, in]`` linear weight; ``shard.convert.gguf_import``),
    installed as ``weights`` says: the stored experts as ``QuantLinear`` s, int8/int4
    requantized from them, or dense (each expert dequantized and transposed back)."""
    owner_name, _, leaf = local.rpartition(".")
    owner = stage.get_submodule(owner_name)
    shape = tuple(stage.get_parameter(local).shape)
    if not isinstance(owner, FusedExperts) or len(shape) != 3:
        raise ModelLoadError(f"{remote!r} is stored per expert but {local!r} is not fused experts")
    n, k, o = shape
    stored = [f"{remote}.{e}" for e in range(n)]
    if any(tuple(quant.get(name, {}).get("shape", ())) != (o, k) for name in stored) or (
        f"{remote}.{n}" in quant
    ):
        raise ModelLoadError(
            f"{remote!r} in {f.path.name} is not {n} stored experts of shape {[o, k]}; "
            "config.json and weights disagree"
        )
    linears: list[nn.Module] = []
    dense: list[Tensor] = []
    for name in stored:
        q = _read_quantized(f, name, quant[name])
        if weights == "stored":
            linears.append(QuantLinear(q, f.device))
        elif weights in ("int8", "int4") and _fused_fits(shape, weights):
            w = q.dequantize()
            linears.append(
                QuantLinear(quantize_int8(w) if weights == "int8" else quantize_int4(w), f.device)
            )
        else:
            dense.append(q.dequantize().T.to(dtype))
    if linears:
        owner.install(leaf, linears)
    else:
        param = nn.Parameter(torch.stack(dense).to(f.device), requires_grad=False)
        _set_parameter(stage, local, param)


def _set_module(stage: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(stage.get_submodule(owner) if owner else stage, leaf, module)


def _set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, value)
