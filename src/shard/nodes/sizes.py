"""What each layer of a swarm's model weighs on each of its nodes, for placement.

``model_facts(config, spec, model_dir)`` prices every layer, the embedding and the head as
each stage and standby holds them under its own ``weights`` format
(``shard.model.footprint.predict``; ``"stored"``: the checkpoint's own bytes, read from its
safetensors headers) and returns the ``placement.ModelFacts`` that ``SwarmSpec.blocks``
(``layers = "auto"``), ``swarm up``'s plan and the formation scheduler cut the model with.

Every node of a swarm must compute the same split, so the prices depend on nothing of the
host: the int4 kernel's scales are priced in bf16 wherever it runs (``bf16_kernels``), and
the formats are the spec's (a ``--weights`` given to one node on its command line is seen by
that node alone: with ``"auto"``, give formats in the spec).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from shard.model.config import ModelConfig
from shard.model.footprint import predict
from shard.nodes.auditing import weights_of
from shard.placement import ModelFacts
from shard.placement.problem import Sizes
from shard.spec.swarm import SwarmSpec

__all__ = ["model_facts", "sizes_of", "stored_sizes"]

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
_HEADER_LIMIT = 100 << 20  # a safetensors header is a few MB at most


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
        found = stored_sizes(config, model_dir) if model_dir is not None else None
        if found is not None:
            return found
        weights = dtype
    footprint = predict(config, weights, dtype=dtype, bf16_kernels=True)
    return Sizes(footprint.layers, footprint.embedding, footprint.head, footprint.shared_head)


def stored_sizes(config: ModelConfig, model_dir: Path) -> Sizes | None:
    """Bytes per layer, embedding and head as the checkpoint in ``model_dir`` stores them
    (its safetensors headers; a tied head is a copy of the embedding on a stage of its
    own), or None when it has no safetensors files."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    layers = [0] * config.n_layers
    embedding = head = lm_head = 0
    for path in files:
        for name, nbytes in _tensor_bytes(path):
            m = _LAYER.match(name)
            if m is not None and int(m[1]) < config.n_layers:
                layers[int(m[1])] += nbytes
            elif "embed_tokens" in name:
                embedding += nbytes
            elif "lm_head" in name:
                lm_head += nbytes
            elif m is None:
                head += nbytes  # the final norm
    if lm_head or not config.tie_word_embeddings:
        return Sizes(tuple(layers), embedding, head + lm_head)
    return Sizes(tuple(layers), embedding, head + embedding, shared_head=head)


def _tensor_bytes(path: Path) -> list[tuple[str, int]]:
    """``(name, bytes)`` of each tensor in a safetensors file, from its header alone."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return []
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            return []
        header = json.loads(f.read(length))
    out = []
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict):
            first, last = entry["data_offsets"]
            out.append((name, int(last) - int(first)))
    return out
