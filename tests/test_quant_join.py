"""Verified fetch of quantized blocks: a stored checkpoint's manifest covers its codes, scales
and offsets (and, in the safetensors header every block fetches, the ``shard.quant``
metadata); a node joining a weights = "stored" swarm fetches exactly its block's chunks —
int4 codes and their scales, no float32 copy, no other layer — verifies them, refuses a
tampered quantized chunk, and loads the block to the same bits as the local stored load; a
ring whose middle stage fetched its block gives the local stored run's tokens.

A tiny checkpoint in the stored layout (Q4_0 layers, Q8_0 embedding: ``quant_fixtures``).
Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from fetch_fixtures import source
from quant_fixtures import stored_tiny
from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.model.quant import QuantLinear
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.fetching import fetch_layers, make_seeder
from shard.nodes.inprocess import run_swarm
from shard.nodes.joining import joined_spec
from shard.nodes.loading import load_block as _load
from shard.spec.swarm import SwarmSpec
from shard.transport import WebSocketNetwork
from shard.weights.build import build_manifest
from shard.weights.fetch import FetchError
from shard.weights.manifest import Manifest
from shard.weights.plan import block_chunks, block_tensors, chunk_keys, chunk_span, plan_bytes
from shard.weights.seeder import Seeder
from shard.weights.store import verified_chunks
from test_join_fetch import PUBLISHER, fetch_table, formation_dict, serving

DEADLINE_S = 60
CHUNK = 1024  # small chunks: a block's edges cost at most a chunk each
FIRST, LAST = 2, 4  # the joining node's block (a middle one: no embedding, no head)
PROMPTS = ([5, 17, 99, 3, 8, 8, 41], [200, 31, 7, 7, 64, 12], [42, 42, 42])


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The stored tiny checkpoint (6 layers) and its signed manifest file."""
    root = tmp_path_factory.mktemp("quant-join")
    model_dir = stored_tiny(root)
    manifest = build_manifest(model_dir, model="tiny-q4", version=1, chunk_size=CHUNK)
    manifest.signed(PUBLISHER).save(root / "tiny-q4.manifest.json")
    return model_dir, root / "tiny-q4.manifest.json"


def joining(model_dir: Path, fetch: dict[str, Any]) -> SwarmSpec:
    """A weights = "stored" [formation] swarm as node ``gpu-a``, started with ``--join``,
    sees it."""
    data = formation_dict(model_dir, fetch)
    data["swarm"]["weights"] = "stored"
    return joined_spec(
        SwarmSpec.from_dict(data), "gpu-a", join="127.0.0.1:9100", listen="127.0.0.1:0"
    )


def _same_outputs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two blocks give the same bits on one random chunk of hidden states."""
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        return torch.equal(a(x, 0, a.new_cache(16)), b(x, 0, b.new_cache(16)))  # type: ignore[operator]


def test_the_manifest_covers_codes_scales_and_the_quant_metadata(
    published: tuple[Path, Path],
) -> None:
    """Each linear weight of a block is listed as its int4 codes (U8, half the columns) with
    its float32 ``.scale`` and ``.offset`` (one per group of 32), and the safetensors header
    — in every block's plan — holds the ``shard.quant`` entry saying so."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    names = set(block_tensors(manifest, FIRST, LAST))
    weight = "model.layers.2.mlp.down_proj.weight"
    assert {weight, f"{weight}.scale", f"{weight}.offset"} <= names
    assert manifest.tensors[weight].dtype == "U8" and manifest.tensors[weight].shape == (64, 48)
    assert manifest.tensors[f"{weight}.scale"].shape == (64, 3)
    header = chunk_span(0, manifest.file("model.safetensors").header, CHUNK)
    assert set(header) <= set(block_chunks(manifest, FIRST, LAST)["model.safetensors"])
    raw = (model_dir / "model.safetensors").read_bytes()
    meta = json.loads(raw[8 : manifest.file("model.safetensors").header])["__metadata__"]
    assert json.loads(meta["shard.quant"])[weight] == {
        "kind": "int4",
        "group": 32,
        "shape": [64, 96],
    }


async def test_a_joining_node_fetches_only_its_blocks_quantized_bytes(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """What a joined node's ``Activate`` runs (``fetch_layers``, then ``_load``) for layers
    [2, 4) of a stored swarm: the seeder is asked for exactly the block's chunks, each once;
    the bytes fetched are the block's stored tensors (codes + scales + offsets, under a fifth
    of their float32 size) plus the config, tokenizer and header, and at most a chunk at
    each end of the block; the block loads quantized, to the local stored load's bits."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    recorder = source(manifest, model_dir)
    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork() as net:
            seeder = Seeder(
                manifest, recorder, node="seed0", swarm="test", listen="127.0.0.1:0", network=net
            )
            async with serving([seeder]) as (address,):
                spec = joining(model_dir, fetch_table(manifest_path, tmp_path, address))
                report = await fetch_layers(spec, "gpu-a", FIRST, LAST)
                block = await _load(spec, "gpu-a", report.path, FIRST, LAST)
    keys = chunk_keys(block_chunks(manifest, FIRST, LAST))
    assert sorted(recorder.asked) == sorted(keys)  # each chunk once, none outside the block
    assert verified_chunks(report.path, manifest) == set(keys)
    assert report.bytes_fetched == plan_bytes(manifest, keys)
    names = block_tensors(manifest, FIRST, LAST)
    stored = sum(manifest.tensors[n].end - manifest.tensors[n].start for n in names)
    spans = {("model.safetensors", i) for n in names for i in chunk_span(
        manifest.tensors[n].start, manifest.tensors[n].end, CHUNK)}  # fmt: skip
    assert stored <= plan_bytes(manifest, spans) < stored + 2 * CHUNK
    codes = [n for n in names if manifest.tensors[n].dtype == "U8"]
    assert len(codes) == 7 * (LAST - FIRST)  # q, k, v, o, gate, up, down per layer
    as_float32 = sum(8 * math.prod(manifest.tensors[n].shape) for n in codes)  # 2 codes a byte
    print(f"block [{FIRST}, {LAST}): {stored} stored bytes fetched, {as_float32} in float32")
    assert stored < as_float32 / 5
    assert isinstance(block.model.layers[0].mlp.down_proj, QuantLinear)
    assert _same_outputs(block.model, load_stage(model_dir, FIRST, LAST, weights="stored"))


async def test_a_tampered_quantized_chunk_is_refused(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """A seeder that alters one chunk of layer 2's int4 codes: the fetch fails naming no
    unverified byte as held — the tampered chunk never lands — and a later fetch from an
    honest seeder completes the block, which loads to the local stored load's bits."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    code = manifest.tensors["model.layers.2.mlp.gate_proj.weight"]
    key = ("model.safetensors", (code.start + code.end) // 2 // CHUNK)
    hostile = source(manifest, model_dir, tamper={key})
    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork() as net:
            evil = Seeder(
                manifest, hostile, node="evil", swarm="test", listen="127.0.0.1:0", network=net
            )
            async with serving([evil]) as (address,):
                spec = joining(model_dir, fetch_table(manifest_path, tmp_path, address))
                with pytest.raises(FetchError):
                    await fetch_layers(spec, "gpu-a", FIRST, LAST)
            assert hostile.tampered == [key]
            dest = next((tmp_path / "tiny-q4").glob("v1-*"))
            assert key not in (verified_chunks(dest, manifest) or set())
            honest = Seeder(
                manifest, source(manifest, model_dir), node="seed0", swarm="test",
                listen="127.0.0.1:0", network=net,
            )  # fmt: skip
            async with serving([honest]) as (address,):
                spec = joining(model_dir, fetch_table(manifest_path, tmp_path, address))
                report = await fetch_layers(spec, "gpu-a", FIRST, LAST)
                block = await _load(spec, "gpu-a", report.path, FIRST, LAST)
    assert key in (verified_chunks(report.path, manifest) or set())
    assert _same_outputs(block.model, load_stage(model_dir, FIRST, LAST, weights="stored"))


async def test_a_ring_whose_middle_stage_fetched_its_stored_block_equals_local(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """A 3-stage ring with weights = "stored" whose s1 fetches layers [2, 4) from a seeder at
    start (s0 and s2 read the checkpoint): three concurrent requests each give the tokens
    of the local stored run, and the block cache holds exactly s1's chunks."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    fetch: dict[str, Any] = {
        "manifest": str(manifest_path),
        "publisher": PUBLISHER.public.hex(),
        "cache": str(tmp_path / "cache"),
        "stages": ["s1"],
        "seeder": [{"name": "seed-a", "listen": "127.0.0.1:0", "model": str(model_dir)}],
    }

    def spec() -> SwarmSpec:
        data: dict[str, Any] = {
            "swarm": {"name": "test", "model": str(model_dir), "insecure": True,
                      "weights": "stored"},
            "limits": {"max_len": 64, "prefill_chunk": 4, "connect_timeout_s": 5},
            "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
            "stage": [
                {"name": f"s{i}", "listen": f"127.0.0.1:{9101 + i}", "layers": [2 * i, 2 * i + 2]}
                for i in range(3)
            ],
            "fetch": fetch,
        }  # fmt: skip
        return SwarmSpec.from_dict(data)

    seeder = make_seeder(spec(), "seed-a", model_dir)
    assert seeder is not None
    done: dict[int, tuple[int, ...]] = {}
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            fetch["seeder"][0]["listen"] = await nursery.start(seeder.run)
            swarm = spec()
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(swarm, model_dir=model_dir, task_status=task_status)
            )

            async def one(i: int) -> None:
                out = await handle.coordinator.generate(list(PROMPTS[i]), max_tokens=10)
                done[i] = out.token_ids

            async with trio.open_nursery() as requests:
                for i in range(len(PROMPTS)):
                    requests.start_soon(one, i)
            nursery.cancel_scope.cancel()
    config = ModelConfig.from_dir(model_dir)
    local = load_stage(model_dir, 0, config.n_layers, weights="stored")
    for i, prompt in enumerate(PROMPTS):
        want = generate_reference(
            local, list(prompt), max_tokens=10, eos_ids=config.eos_token_ids, max_len=64,
            prefill_chunk=4,
        )  # fmt: skip
        assert done[i] == want.token_ids, i
    (block,) = (tmp_path / "cache" / "tiny-q4").glob("v1-*")
    assert verified_chunks(block, manifest) == set(chunk_keys(block_chunks(manifest, 2, 4)))
