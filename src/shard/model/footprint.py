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
(``tests/test_footprint.py``).

Kernel layouts depend on the host: the int4 kernel keeps its scales and zeros in the compute
dtype, bf16 on a GPU or a CPU with bf16 instructions and float32 elsewhere
(``shard.model.quant.kernel_dtype``); ``bf16_kernels`` says which to price.

``"stored"`` cannot be predicted from a config: a GGUF or a packed cache mixes formats
tensor by tensor. Its bytes are read from the checkpoint's own headers instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
from torch import nn

from shard.model.attention import make_norm
from shard.model.config import ModelConfig
from shard.model.llama import Block, StageModel
from shard.model.moe import FusedExperts
from shard.model.quant import KERNEL_GROUPS, QuantEmbedding, QuantLinear

__all__ = ["Footprint", "FootprintError", "measured", "predict"]

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
    #: does not quantize them (routers), over all layers.
    unquantized: int = 0

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
    ``weights`` (``float32``, ``bfloat16``, ``float16``, ``int8``, ``int4``) with dense parts
    in ``dtype``. Errors: ``FootprintError`` for ``"stored"`` or an unknown format."""
    if weights in _DENSE:
        dtype = weights
    elif weights not in ("int8", "int4"):
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
    price = _Pricer(weights, _DENSE[dtype], 2 if bf16_kernels else 4)
    layers: list[int] = []
    unquantized = 0
    shapes: dict[tuple[str, ...], tuple[int, int]] = {}
    with torch.device("meta"):
        for i in range(config.n_layers):
            block = Block(config, i)
            key = tuple(f"{n}:{tuple(p.shape)}" for n, p in block.named_parameters())
            if key not in shapes:
                shapes[key] = (price.module(block), price.left_dense(block))
            layers.append(shapes[key][0])
            unquantized += shapes[key][1]
        d, vocab = config.hidden_size, config.vocab_size
        norm = price.module(make_norm(config, d))
    embedding = price.matrix(vocab, d, embedding=True)
    head = norm + price.matrix(vocab, d, embedding=False)
    shared = norm + price.tied_head(vocab, d) if config.tie_word_embeddings else head
    return Footprint(tuple(layers), embedding, head, shared, unquantized)


@attrs.frozen
class _Pricer:
    weights: str
    dense: int  # bytes per element of a dense tensor
    kernel: int  # bytes per element of the int4 kernel's scales and zeros

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
        return n * k * self.dense  # not quantizable as asked: dense

    def tied_head(self, n: int, k: int) -> int:
        """What a head tied to an embedding on its own stage adds (``Footprint``)."""
        if self.weights == "int8":
            return self.kernel * n  # the embedding's codes, a scale of its own
        if self.weights == "int4" and k % 32 == 0 and n % 16 == 0:
            return self.matrix(n, k, embedding=False)
        return 0  # the very embedding tensor


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
        if isinstance(module, QuantLinear | QuantEmbedding):
            yield from module.tensors()
