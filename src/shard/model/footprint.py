"""What a block of a model weighs in memory, predicted from its ``config.json`` alone.

Placement needs each layer's real bytes before anyone downloads a weight: a mixture-of-experts
layer outweighs a dense one many times, Gemma's embedding table is most of its model, and a
quantized layer holds its codes plus scales in the kernel's own layout. ``predict`` builds the
model's modules on the meta device (no memory, no weights) and prices every weight as the
loader would install it under ``weights`` (``shard.model.loader._place``): a linear or
embedding matrix quantized at load (``int8`` per channel, ``int4`` in groups of 32, kept in
``shard.model.quant``'s layouts; gpt-oss's fused ``[E, in, out]`` experts as ``E`` such
linears of ``[out, in]``), everything else (norms, biases, routers) dense in ``dtype``.
``measured`` sums what a loaded ``StageModel`` really holds, so the two can be compared
(``tests/test_footprint.py``). ``Footprint.kv_token`` prices the KV cache a layer adds per
position (``ModelConfig.kv_widths``: keys and values, or MLA's latent and rotary key) in the
compute dtype, as ``StageModel.new_cache`` allocates it; ``Footprint.state_session`` the
bytes a linear-attention layer holds per session instead (``shard.model.recurrent``).

The int4 kernel keeps its scales and zeros in its compute dtype, bf16 on every device
(``shard.model.quant.kernel_dtype``); ``bf16_kernels=False`` prices float32 ones (a kernel
dtype a test may force).

``"stored"`` cannot be predicted from a config: a GGUF or a packed cache mixes formats
tensor by tensor. ``stored`` prices it from the checkpoint's safetensors headers instead
(each tensor's shape, and ``shard.quant``'s kind, group and logical shape of the ones kept
quantized), tensor by tensor as the loader installs it (``QuantLinear``'s paths), with the
K-quant weights a stage holds dequantized in bf16 (``shard.model.held``). A host whose CPU
multiplies them in float32 holds none, and holds up to that much less than priced
(``stored(held=False)`` prices it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
from torch import nn

from shard.model.attention import make_norm
from shard.model.config import ModelConfig
from shard.model.fused import JoinedInt4
from shard.model.held import holds
from shard.model.llama import Block, StageModel
from shard.model.moe import FusedExperts
from shard.model.quant import KERNEL_GROUPS, QuantEmbedding, QuantLinear, q8_fits
from shard.model.recurrent import layer_state_bytes
from shard.model.safetensors_header import INDEX_FILE, SafetensorsError, read_index
from shard.model.stored_headers import StoredTensor, stored_tensors

__all__ = ["Footprint", "FootprintError", "measured", "predict", "stored"]

_DENSE = {"float32": 4, "bfloat16": 2, "float16": 2}


class FootprintError(ValueError):
    """A ``weights`` format whose bytes a config alone cannot tell; the message says why."""


@attrs.frozen
class Footprint:
    """Bytes per layer (``layers[i]`` is layer ``i``), the embedding (first stage), the final
    norm and head (last stage), and the head when it shares a stage with a tied embedding
    (``shared_head``: a dense head is the embedding itself; an int8 one reuses its codes
    with a scale of its own; an int4 one is packed again for its kernel)."""

    layers: tuple[int, ...]
    embedding: int
    head: int
    shared_head: int
    #: Bytes of multi-dimensional weights left dense under ``int8``/``int4`` because shard
    #: does not quantize them (routers, MLA's ``kv_b_proj``), over all layers.
    unquantized: int = 0
    #: KV-cache bytes each layer holds per position of a session (``kv_token[i]``: layer i).
    kv_token: tuple[int, ...] = ()
    #: Bytes each layer holds per session whatever its length: a linear-attention layer's
    #: recurrent state and what its rollbacks need (``shard.model.recurrent``), else 0.
    state_session: tuple[int, ...] = ()

    def kv(self, first: int, last: int, positions: int = 1) -> int:
        """KV-cache bytes of the block ``[first, last)`` for ``positions`` positions."""
        return sum(self.kv_token[first:last]) * positions

    def state(self, first: int, last: int) -> int:
        """Bytes a session's linear-attention state takes in the block ``[first, last)``."""
        return sum(self.state_session[first:last])

    def stage(self, first: int, last: int) -> int:
        """Bytes of the block ``[first, last)`` with the ends it carries."""
        total = sum(self.layers[first:last])
        if first == 0:
            total += self.embedding
        if last == len(self.layers):
            total += self.shared_head if first == 0 else self.head
        return total

    @property
    def total(self) -> int:
        """Every weight of the model on one stage."""
        return self.stage(0, len(self.layers))


def predict(
    config: ModelConfig, weights: str, *, dtype: str = "float32", bf16_kernels: bool = True
) -> Footprint:
    """Each layer's bytes, the embedding's and the head's, for ``config`` held as
    ``weights`` (``float32``, ``bfloat16``, ``float16``, ``int8``, ``int4``, or ``fp8``: a
    published FP8 checkpoint kept stored, ``shard.model.fp8``, its embedding, head, routers
    and MLA's ``kv_b_proj`` dense) with dense parts in ``dtype``. Errors: ``FootprintError``
    for ``"stored"``, ``fp8`` without an FP8 ``quantization_config``, or an unknown format."""
    if weights in _DENSE:
        dtype = weights
    elif weights == "fp8" and config.weight_block is None:
        raise FootprintError("weights 'fp8' needs a config whose quantization_config is FP8")
    elif weights not in ("int8", "int4", "fp8"):
        raise FootprintError(
            f"weights {weights!r} cannot be sized from a config alone"
            + (
                " (stored formats differ tensor by tensor: give the checkpoint)"
                if weights == "stored"
                else ""
            )
        )
    if dtype not in _DENSE:
        raise FootprintError(f"dtype {dtype!r} is not one of {', '.join(_DENSE)}")
    price = _Pricer(weights, _DENSE[dtype], 2 if bf16_kernels else 4, config.weight_block)
    layers: list[int] = []
    unquantized = 0
    shapes: dict[tuple[object, ...], tuple[int, int]] = {}
    with torch.device("meta"):
        for i in range(config.n_layers):
            key = _layer_kind(config, i)  # one Block built per kind: 256 experts x 61 is slow
            if key not in shapes:
                block = _block(config, i)
                shapes[key] = (price.module(block), price.left_dense(block))
            layers.append(shapes[key][0])
            unquantized += shapes[key][1]
        d, vocab = config.hidden_size, config.vocab_size
        norm = price.module(make_norm(config, d))
    embedding = price.matrix(vocab, d, embedding=True)
    # a published FP8 checkpoint keeps its head in bf16, as its embedding
    head = norm + price.matrix(vocab, d, embedding=weights == "fp8")
    shared = norm + price.tied_head(vocab, d) if config.tie_word_embeddings else head
    kv, state = _kv_token(config, dtype), _state_session(config, dtype)
    return Footprint(tuple(layers), embedding, head, shared, unquantized, kv, state)


def _block(config: ModelConfig, i: int) -> nn.Module:
    """Layer ``i`` as its stage builds it (DeepSeek-V4: ``shard.model.deepseek_v4.V4Block``)."""
    if config.v4 is None:
        return Block(config, i)
    from shard.model.deepseek_v4 import V4Block

    return V4Block(config, i)


def _layer_kind(config: ModelConfig, i: int) -> tuple[object, ...]:
    """What makes layer ``i``'s modules differ from another's (``Block.__init__`` reads no
    more of its index): its feed-forward, window, rope kind and declared layer type."""
    kind: object = config.layer_types[i] if config.layer_types is not None else None
    if config.v4 is not None:  # its attention kind and whether it hashes
        kind = (config.v4.kinds[i], i in config.v4.hash_layers)
    return (config.is_sparse(i), config.window_of(i), config.local_rope(i), kind)


def _kv_token(config: ModelConfig, dtype: str) -> tuple[int, ...]:
    """Each layer's KV-cache bytes per position in the compute ``dtype`` (none for a
    linear-attention layer: its state does not grow)."""
    per = config.kv_elements * _DENSE[dtype]
    return tuple(0 if config.is_linear(i) else per for i in range(config.n_layers))


def _state_session(config: ModelConfig, dtype: str) -> tuple[int, ...]:
    """Each layer's bytes per session whatever its length (``Footprint.state_session``)."""
    one = layer_state_bytes(config, _DENSE[dtype])
    return tuple(one if config.is_linear(i) else 0 for i in range(config.n_layers))


@attrs.frozen
class _Pricer:
    weights: str
    dense: int  # bytes per element of a dense tensor
    kernel: int  # bytes per element of the int4 kernel's scales and zeros
    block: tuple[int, int] | None = None  # an FP8 checkpoint's scale block (``fp8``)

    def module(self, module: nn.Module) -> int:
        total = 0
        for name, param in module.named_parameters():
            owner = module.get_submodule(name.rpartition(".")[0])
            matrix = isinstance(owner, nn.Linear | nn.Embedding) and name.endswith(".weight")
            if matrix and param.dim() == 2 and "norm" not in name:
                n, k = param.shape
                total += self.matrix(n, k, embedding=isinstance(owner, nn.Embedding))
            elif self._fused(owner, param):
                e, k, n = param.shape  # [E, in, out]: E linears of weight [out, in]
                total += e * self.matrix(n, k, embedding=False)
            else:
                total += param.numel() * self.dense
        return total

    def left_dense(self, module: nn.Module) -> int:
        """Bytes of ``module``'s multi-dimensional weights a quantized format leaves dense."""
        if self.weights not in ("int8", "int4"):
            return 0
        total = 0
        for name, p in module.named_parameters():
            owner = module.get_submodule(name.rpartition(".")[0])
            if p.dim() >= 2 and not isinstance(owner, nn.Linear) and not self._fused(owner, p):
                total += p.numel() * self.dense
        return total

    def _fused(self, owner: nn.Module, param: torch.Tensor) -> bool:
        """A fused ``[E, in, out]`` expert weight the loader quantizes expert by expert
        (``shard.model.loader._fused_fits``: int8 always, int4 when ``in`` is a multiple of 32)."""
        if not isinstance(owner, FusedExperts) or param.dim() != 3:
            return False
        return self.weights == "int8" or (self.weights == "int4" and param.shape[1] % 32 == 0)

    def matrix(self, n: int, k: int, *, embedding: bool) -> int:
        """A ``[n, k]`` weight as the loader installs it (``QuantLinear``'s paths)."""
        if self.weights == "int8":
            if embedding:  # QuantEmbedding keeps the codes and a float32 scale per row
                return n * k + 4 * n
            return n * k + self.kernel * n  # int8-channel: codes + a scale per row
        if self.weights == "int4" and k % 32 == 0:
            groups = n * (k // 32)
            if embedding or 32 not in KERNEL_GROUPS or n % 16:
                return n * k // 2 + 2 * 4 * groups  # kept as codes + float32 scale, offset
            return n * k // 2 + 2 * self.kernel * groups  # packed + scales and zeros
        if self.weights == "fp8" and not embedding and self.block and k % self.block[1] == 0:
            return n * k + 4 * n * (k // self.block[1])  # e4m3 codes + a scale per row block
        return n * k * self.dense  # not quantizable as asked: dense

    def tied_head(self, n: int, k: int) -> int:
        """What a head tied to an embedding on its own stage adds (``Footprint``)."""
        if self.weights == "int8":
            return self.kernel * n  # the embedding's codes, a scale of its own
        if self.weights == "int4" and k % 32 == 0 and n % 16 == 0:
            return self.matrix(n, k, embedding=False)
        return 0  # the very embedding tensor


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EMBED = "model.embed_tokens.weight"
_KERNEL = {2: "BF16", 4: "F32"}  # the int4 kernel's scale bytes as a safetensors dtype


def stored(
    config: ModelConfig,
    model_dir: Path,
    *,
    dtype: str = "float32",
    bf16_kernels: bool = True,
    held: bool = True,
) -> Footprint | None:
    """Each layer's bytes, the embedding's and the head's, for the checkpoint in
    ``model_dir`` loaded with ``weights = "stored"`` (dense tensors in ``dtype``), from its
    safetensors headers alone, tensor by tensor as ``shard.model.loader`` installs it: a
    quantized embedding as stored, every other quantized weight in ``QuantLinear``'s layout
    (``_Installed``), a tied head on a stage without the embedding built from the table.
    ``held``: each layer with the K-quant weights it holds dequantized (``shard.model.held``:
    a bf16 host's stage, and the plan's price), else as stored (a float32 host's stage).
    None when ``model_dir`` has no safetensors files. Errors: ``FootprintError`` for an
    unknown ``dtype`` or a header that cannot be read."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    if dtype not in _DENSE:
        raise FootprintError(f"dtype {dtype!r} is not one of {', '.join(_DENSE)}")
    if (model_dir / INDEX_FILE).exists():  # checked as strictly as the loader checks it
        try:
            read_index(model_dir)
        except SafetensorsError as e:
            raise FootprintError(f"{e}; re-download the checkpoint") from None
    price = _Installed(_DENSE[dtype], 2 if bf16_kernels else 4)
    tensors: dict[str, StoredTensor] = {}
    try:
        for path in files:
            tensors |= stored_tensors(path, config.weight_block)
    except SafetensorsError as e:
        raise FootprintError(f"{e}; re-download or re-convert the checkpoint") from None
    layers, norm = [0] * config.n_layers, 0
    costs = [0] * config.n_layers  # what holding each layer's K-quant weights would add
    owners = _Owners(config)
    for name, t in tensors.items():
        m = _LAYER.match(name)
        if m is not None and int(m[1]) < config.n_layers:
            if t.kind is not None and owners.keeps_dense(int(m[1]), name[m.end() :]):
                t = attrs.evolve(t, kind=None)  # a router / kv_b_proj: dequantized at load
            layers[int(m[1])] += price.linear(t)
            costs[int(m[1])] += price.hold_cost(t)
        elif name.startswith("model.norm."):
            norm += price.linear(t)
    embed = tensors.get(_EMBED)
    head_t = embed if config.tie_word_embeddings else tensors.get("lm_head.weight")
    embedding = 0 if embed is None else price.embedding(embed)
    head = norm + (0 if head_t is None else price.linear(head_t))
    shared = head
    if config.tie_word_embeddings and head_t is not None:
        shared = norm + price.tied_head(head_t)
    layers = [n + (c if held and holds(c) else 0) for n, c in zip(layers, costs, strict=True)]
    return Footprint(tuple(layers), embedding, head, shared, kv_token=_kv_token(config, dtype))


class _Owners:
    """Which stored layer tensors the loader installs dense although kept quantized: those
    whose module is not a ``Linear`` (routers, MLA's ``kv_b_proj``; ``loader._place``)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.blocks: dict[bool, Block] = {}  # by sparseness: the only per-layer difference

    def keeps_dense(self, layer: int, rest: str) -> bool:
        sparse = self.config.is_sparse(layer)
        if sparse not in self.blocks:
            with torch.device("meta"):
                self.blocks[sparse] = Block(self.config, layer)
        try:
            owner = self.blocks[sparse].get_submodule(rest.rpartition(".")[0])
        except AttributeError:  # not a tensor this model holds: priced as stored
            return False
        return not isinstance(owner, nn.Linear)


@attrs.frozen
class _Installed:
    """Bytes of a stored weight once loaded (``shard.model.quant.QuantLinear._pack``)."""

    dense: int  # bytes per element of a dense tensor
    kernel: int  # bytes per element of the int4 kernel's scales and zeros

    def path(self, t: StoredTensor) -> str:
        """``QuantLinear.path`` for ``t`` on a CPU (``dense`` for an unquantized tensor)."""
        if t.kind is None:
            return "dense"
        n, k = t.shape
        fits = t.group in KERNEL_GROUPS and k % t.group == 0 and n % 16 == 0
        if t.kind == "int4" and fits:
            return "int4"
        if t.kind == "int8" and t.group == k and not t.offset:
            return "int8-channel"
        return "int8-group" if t.kind == "int8" and q8_fits(k, t.group) else "dequantize"

    def hold_cost(self, t: StoredTensor) -> int:
        """What holding ``t`` dequantized adds (``QuantLinear.holdable``, ``hold_cost``): its
        bf16 bytes less the stored codes; 0 for any other."""
        if self.path(t) != "dequantize" or t.kind not in ("int4", "int8") or t.group >= 32:
            return 0
        n, k = t.shape
        return n * k * 2 - t.nbytes

    def embedding(self, t: StoredTensor) -> int:
        """A ``QuantEmbedding`` keeps the stored codes, scales and offsets as read."""
        return t.nbytes if t.kind is not None else self._dense(t)

    def linear(self, t: StoredTensor) -> int:
        """Any other weight: dense in the activation dtype, or a ``QuantLinear``."""
        path = self.path(t)
        if path == "dense":
            return self._dense(t)
        n, k = t.shape
        groups = n * (k // t.group)
        if path == "int4":  # packed codes, [K/g, N, 2] scales and zeros
            return n * k // 2 + 2 * self.kernel * groups
        if path == "int8-channel":  # the codes as stored, a scale per row
            return n * k + self.kernel * n
        if path == "int8-group":  # the codes as stored, float32 scales (and offsets)
            return n * k + 4 * groups * (2 if t.offset else 1)
        return t.nbytes  # dequantized per call from the stored codes

    def tied_head(self, t: StoredTensor) -> int:
        """What a head built from the embedding ``t`` on the embedding's stage adds
        (``loader._tie_head``): a packed copy, or nothing where it shares the table (an
        ``int8-group`` head packs the table once and the embedding reads it, its own stored
        table freed: the float32 scales less the stored ones)."""
        path = self.path(t)
        if path == "int4":
            return self.linear(t)
        if path == "int8-group":
            return self.linear(t) - t.nbytes
        if path == "int8-channel":  # the table's codes; its scales unless already the kernel's
            return 0 if _KERNEL[self.kernel] == t.scale_dtype else self.kernel * t.shape[0]
        return 0  # the very embedding tensor, or its stored codes

    def _dense(self, t: StoredTensor) -> int:
        count = 1
        for d in t.shape:
            count *= d
        return count * self.dense


def measured(stage: StageModel) -> int:
    """Bytes the loaded ``stage`` holds in weights: each storage once (a tied head that is
    the embedding, an int8 head reusing its codes), parameters and every quantized layer's
    codes, scales and zeros."""
    seen: set[int] = set()
    total = 0
    for tensor in _tensors(stage):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _tensors(stage: StageModel) -> Iterator[torch.Tensor]:
    for param in stage.parameters():
        yield param.data
    for module in stage.modules():
        if isinstance(module, QuantLinear | QuantEmbedding | JoinedInt4):
            yield from module.tensors()
