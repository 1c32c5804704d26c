"""Which chunks a stage needs: the tensors of its block, mapped onto the manifest's chunks.

Pure functions, no I/O. The tensor selection mirrors ``shard.model.loader`` (``hf_name`` over
``StageModel``'s parameters): layers ``[first, last)``, the embedding for stage 0, the final
norm and head for the tail — where a tied head reads the embedding matrix. A test checks the
two agree. Besides its tensors' byte ranges a stage always needs every file that holds no
tensor (config, tokenizer, index) in full, and the header of every safetensors file, so
``safe_open`` and ``checkpoint_index`` work on the sparse copy.
"""

from __future__ import annotations

from collections.abc import Iterable

from shard.weights.manifest import Manifest

__all__ = [
    "ChunkKey",
    "block_chunks",
    "block_tensors",
    "chunk_keys",
    "chunk_span",
    "common_chunks",
    "plan_bytes",
]

ChunkKey = tuple[str, int]


def block_tensors(manifest: Manifest, first: int, last: int) -> tuple[str, ...]:
    """Checkpoint names of every tensor ``StageModel(config, first, last)`` loads.

    Errors: ``ValueError`` for a bad range, or ``KeyError`` when the manifest lacks one.
    """
    n = manifest.n_layers
    if not 0 <= first < last <= n:
        raise ValueError(f"bad layer range [{first}, {last}) for a {n}-layer model")
    prefixes = tuple(f"model.layers.{i}." for i in range(first, last))
    names = {name for name in manifest.tensors if name.startswith(prefixes)}
    if first == 0:
        names.add("model.embed_tokens.weight")
    if last == n:
        names.add("model.norm.weight")
        tied = manifest.tie_word_embeddings
        names.add("model.embed_tokens.weight" if tied else "lm_head.weight")
    # A tensor kept quantized (shard.convert.gguf_import) has its scales beside it.
    names |= {f"{n}.{part}" for n in names for part in ("scale", "offset")} & set(manifest.tensors)
    missing = sorted(names - set(manifest.tensors))
    if missing:
        raise KeyError(
            f"manifest {manifest.model} lacks tensors {missing[:3]} of [{first}, {last})"
        )
    return tuple(sorted(names))


def chunk_span(start: int, end: int, chunk_size: int) -> range:
    """Indexes of the chunks covering bytes ``[start, end)`` (empty for an empty range)."""
    if end <= start:
        return range(0)
    return range(start // chunk_size, (end - 1) // chunk_size + 1)


def common_chunks(manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """File -> sorted chunk indexes every stage holds whatever its block: each file that holds
    no tensor (config, tokenizer, index) in full, and each safetensors file's header. Enough
    for ``ModelConfig.from_dir`` before a block is known (a joining node's profile)."""
    size = manifest.chunk_size
    holding = {t.file for t in manifest.tensors.values()}
    need: dict[str, tuple[int, ...]] = {}
    for f in manifest.files:
        whole = f.path not in holding and f.header == 0
        need[f.path] = tuple(range(len(f.chunks)) if whole else chunk_span(0, f.header, size))
    return need


def block_chunks(manifest: Manifest, first: int, last: int) -> dict[str, tuple[int, ...]]:
    """File -> sorted chunk indexes a stage of ``[first, last)`` must hold."""
    size = manifest.chunk_size
    need = {path: set(indexes) for path, indexes in common_chunks(manifest).items()}
    for name in block_tensors(manifest, first, last):
        t = manifest.tensors[name]
        need[t.file].update(chunk_span(t.start, t.end, size))
    return {path: tuple(sorted(indexes)) for path, indexes in need.items()}


def chunk_keys(plan: dict[str, tuple[int, ...]]) -> list[ChunkKey]:
    """The plan as a flat list of ``(file, index)`` in file and offset order."""
    return [(path, i) for path in sorted(plan) for i in plan[path]]


def plan_bytes(manifest: Manifest, keys: Iterable[ChunkKey]) -> int:
    """Total bytes of the chunks ``keys``."""
    files = {f.path: f for f in manifest.files}
    total = 0
    for path, index in keys:
        start, end = files[path].span(index, manifest.chunk_size)
        total += end - start
    return total
