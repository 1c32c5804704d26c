"""What each layer of a swarm's model weighs on each of its nodes, for placement.

``model_facts(config, spec, model_dir)`` prices every layer, the embedding and the head as
each stage and standby holds them under its own ``weights`` format
(``shard.model.footprint.predict``; ``"stored"``: ``footprint.stored``, each tensor of the
checkpoint's safetensors headers as the loader installs it) and returns the
``placement.ModelFacts`` that ``SwarmSpec.blocks`` (``layers = "auto"``), ``swarm up``'s plan
and the formation scheduler cut the model with.

Every node of a swarm must compute the same split, so the prices depend on nothing of the
host: the int4 kernel's scales are priced in bf16 wherever it runs (``bf16_kernels``), and
the formats are the spec's (a ``--weights`` given to one node on its command line is seen by
that node alone: with ``"auto"``, give formats in the spec).
"""

from __future__ import annotations

from pathlib import Path

from shard.model.config import ModelConfig
from shard.model.footprint import predict, stored
from shard.nodes.auditing import weights_of
from shard.placement import ModelFacts
from shard.placement.problem import Sizes
from shard.spec.swarm import SwarmSpec

__all__ = ["model_facts", "sizes_of", "stored_sizes"]


def model_facts(config: ModelConfig, spec: SwarmSpec, model_dir: Path | None = None) -> ModelFacts:
    """The model's layer sizes as the swarm's format holds them, and those of every node
    whose own format differs (``nodes.auditing.weights_of``: as the node loads its block)."""
    default = sizes_of(config, spec.weights or spec.dtype, spec.dtype, model_dir)
    names = [s.name for s in spec.stages] + [s.name for s in spec.standbys]
    cache: dict[tuple[str, str], Sizes] = {(spec.weights or spec.dtype, spec.dtype): default}
    node_sizes = {}
    for name in names:
        dtype = spec.runtime(name).dtype or spec.dtype
        key = (weights_of(spec, name) or dtype, dtype)  # a hot standby: its stage's form
        if key not in cache:
            cache[key] = sizes_of(config, key[0], dtype, model_dir)
        node_sizes[name] = cache[key]
    return ModelFacts.of_sizes(default, node_sizes)


def sizes_of(config: ModelConfig, weights: str, dtype: str, model_dir: Path | None) -> Sizes:
    """Each layer's, the embedding's and the head's bytes under ``weights`` (dense parts in
    ``dtype``); ``"stored"`` from the checkpoint's headers in ``model_dir`` (priced dense in
    ``dtype`` when it has none: a GGUF file itself)."""
    if weights == "stored":
        found = stored_sizes(config, model_dir, dtype) if model_dir is not None else None
        if found is not None:
            return found
        weights = dtype
    footprint = predict(config, weights, dtype=dtype, bf16_kernels=True)
    return Sizes(footprint.layers, footprint.embedding, footprint.head, footprint.shared_head)


def stored_sizes(config: ModelConfig, model_dir: Path, dtype: str = "float32") -> Sizes | None:
    """Bytes per layer, embedding and head of the checkpoint in ``model_dir`` loaded as
    ``"stored"`` (dense tensors in ``dtype``), priced from its safetensors headers tensor by
    tensor as the loader installs it (``shard.model.footprint.stored``), or None when it has
    no safetensors files."""
    footprint = stored(config, model_dir, dtype=dtype, bf16_kernels=True)
    if footprint is None:
        return None
    return Sizes(footprint.layers, footprint.embedding, footprint.head, footprint.shared_head)
