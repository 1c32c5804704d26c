"""A node started with ``--join`` and no weights: ``[fetch]`` covers it by name or ``"all"``,
it reads the model's config from a verified fetch of what every block holds (no layer
weights), and a block no seeder serves verified fails that ``Activate``, never the node.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
The whole ring from joined, fetching, secure processes: ``test_join_fetch_procs``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from fetch_fixtures import source
from shard.failover.control import OrderFailed
from shard.messages import Activate, NodeProfile
from shard.model.config import ModelConfig
from shard.nodes.auditing import auditing
from shard.nodes.fetching import fetch_common, make_seeder
from shard.nodes.joining import fetches_weights, joined_spec
from shard.nodes.stage import _StageNode
from shard.nodes.stage_config import stage_config
from shard.spec.swarm import SpecError, SwarmSpec
from shard.transport import WebSocketNetwork
from shard.trust.identity import NodeIdentity
from shard.weights.build import build_manifest
from shard.weights.manifest import Manifest
from shard.weights.plan import block_chunks, chunk_keys, common_chunks
from shard.weights.seeder import Seeder
from shard.weights.store import verified_chunks

DEADLINE_S = 30
PUBLISHER = NodeIdentity.from_seed(b"j" * 32)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A sharded tiny checkpoint and its signed manifest file (small chunks: many of them)."""
    from shard.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("pub")
    model_dir = make_tiny_checkpoint(root / "model", n_layers=4, seed=9, sharded=True)
    manifest = build_manifest(model_dir, model="tiny", version=1, chunk_size=4096)
    manifest.signed(PUBLISHER).save(root / "tiny.manifest.json")
    return model_dir, root / "tiny.manifest.json"


def formation_dict(model: Path, fetch: dict[str, Any] | None) -> dict[str, Any]:
    """A [formation] spec (``model`` must exist for the spec to load; these nodes never read
    it: they fetch)."""
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model), "insecure": True},
        "limits": {"connect_timeout_s": 2.0},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "formation": {"expect": 2},
    }
    if fetch is not None:
        data["fetch"] = fetch
    return data


def fetch_table(manifest: Path, cache: Path, *seeders: str, **more: Any) -> dict[str, Any]:
    return {
        "manifest": str(manifest),
        "publisher": PUBLISHER.public.hex(),
        "cache": str(cache),
        "seeder": [{"name": f"seed{i}", "listen": a} for i, a in enumerate(seeders)],
        **more,
    }


def test_fetch_covers_joined_nodes_by_name_or_all(published: tuple[Path, Path]) -> None:
    """In a [formation] spec, ``stages = "all"`` (the default) covers every joining node and a
    list covers the nodes it names, though no [[stage]] holds those names."""
    model_dir, manifest = published

    def spec(**more: Any) -> SwarmSpec:
        data = formation_dict(model_dir, fetch_table(manifest, Path("/c"), **more))
        return joined_spec(
            SwarmSpec.from_dict(data), "gpu-a", join="127.0.0.1:9100", listen="127.0.0.1:0"
        )

    assert fetches_weights(spec(), "gpu-a")
    assert fetches_weights(spec(stages="all"), "gpu-a")
    assert fetches_weights(spec(stages=["gpu-a"]), "gpu-a")
    assert not fetches_weights(spec(stages=["gpu-b"]), "gpu-a")
    plain = SwarmSpec.from_dict(formation_dict(model_dir, None))
    assert not fetches_weights(plain, "gpu-a")


def test_fetch_names_outside_a_formation_must_be_stages(published: tuple[Path, Path]) -> None:
    """Without [formation] a name in ``stages`` that no [[stage]] holds is still refused."""
    model_dir, manifest = published
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "stage": [{"name": "s0", "listen": "127.0.0.1:9101", "layers": [0, 4]}],
        "fetch": fetch_table(manifest, Path("/c"), stages=["gpu-a"]),
    }
    with pytest.raises(SpecError, match=r"fetch.stages: no stage named 'gpu-a'"):
        SwarmSpec.from_dict(data)


@asynccontextmanager
async def serving(seeders: list[Seeder]) -> AsyncIterator[list[str]]:
    """``seeders`` running on loopback for the body; yields their addresses."""
    async with trio.open_nursery() as nursery:
        yield [await nursery.start(s.run) for s in seeders]
        nursery.cancel_scope.cancel()


async def test_config_comes_from_a_verified_fetch_without_layer_weights(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """``fetch_common`` fetches config, tokenizer and headers only — no chunk of any layer —
    and the model's config reads from it as from the checkpoint."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    seeder_spec = SwarmSpec.from_dict(
        formation_dict(model_dir, fetch_table(manifest_path, tmp_path, "127.0.0.1:0"))
    )
    seeder = make_seeder(seeder_spec, "seed0", model_dir)
    assert seeder is not None
    with trio.fail_after(DEADLINE_S):
        async with serving([seeder]) as (address,):
            table = fetch_table(manifest_path, tmp_path, address)
            spec = SwarmSpec.from_dict(formation_dict(model_dir, table))
            report = await fetch_common(spec, "gpu-a")
    assert ModelConfig.from_dir(report.path) == ModelConfig.from_dir(model_dir)
    held = verified_chunks(report.path, manifest)
    assert held == set(chunk_keys(common_chunks(manifest)))
    layer = set(chunk_keys(block_chunks(manifest, 1, 2))) - held
    assert layer  # the layer's tensors are elsewhere: none of their chunks was fetched
    assert report.bytes_fetched < sum(f.size for f in manifest.files) // 2


async def test_a_block_no_seeder_serves_verified_fails_the_order_not_the_node(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """With only a seeder that tampers with every chunk, the joined node's ``Activate`` fails
    with ``OrderFailed`` naming the block (the control link answers it ``ok=False``); the
    tampered chunks never land and the node holds no block."""
    model_dir, manifest_path = published
    manifest = Manifest.from_file(manifest_path)
    bad = source(manifest, model_dir, tamper_all=True)
    with trio.fail_after(DEADLINE_S):
        async with WebSocketNetwork() as net:
            hostile = Seeder(
                manifest, bad, node="evil", swarm="test", listen="127.0.0.1:0", network=net
            )
            async with serving([hostile]) as (address,):
                data = formation_dict(model_dir, fetch_table(manifest_path, tmp_path, address))
                spec = joined_spec(
                    SwarmSpec.from_dict(data), "gpu-a", join="127.0.0.1:9100",
                    listen="127.0.0.1:0",
                )  # fmt: skip
                node = _StageNode(
                    stage_config(spec, "gpu-a", fetch=True),
                    auditing(spec, "gpu-a", net, None, supervised=True),
                    model_dir=Path("not-here"), listen="127.0.0.1:0", timeout_s=2.0,
                    block=None, profile=NodeProfile("cpu", 1 << 30, 1.0, 1.0, 5),
                )  # fmt: skip
                with pytest.raises(OrderFailed, match=r"could not fetch layers \[0, 2\)"):
                    await node._obey(Activate("gpu-a", 0, 2, "127.0.0.1:9"))
    assert bad.tampered  # it was asked, and served tampered bytes
    assert node._block is None
    dest = next((tmp_path / "tiny").glob("v1-*"))
    assert not set(bad.tampered) & (verified_chunks(dest, manifest) or set())
