"""A node's part in verified fetch: the ``[fetch]`` spec table, the rollback guard of the block
cache, and a whole ring whose stages fetch their blocks from a seeder at start.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from shard.decode.reference import generate_reference
from shard.model.config import ModelConfig
from shard.model.loader import load_stage
from shard.nodes.coordinator import CoordinatorHandle
from shard.nodes.fetching import accept_manifest, fetch_stage, make_seeder
from shard.nodes.inprocess import run_swarm
from shard.spec.fetch import SeederSpec
from shard.spec.swarm import SpecError, SwarmSpec
from shard.trust.identity import NodeIdentity
from shard.weights.build import build_manifest
from shard.weights.manifest import Manifest, ManifestInvalid

DEADLINE_S = 60
PUBLISHER = NodeIdentity.from_seed(b"p" * 32)


def spec_dict(model_dir: Path, fetch: dict[str, Any] | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "swarm": {"name": "test", "model": str(model_dir), "insecure": True},
        "limits": {"max_len": 64, "prefill_chunk": 4, "connect_timeout_s": 5},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9100"},
        "stage": [
            {"name": "s0", "listen": "127.0.0.1:9101", "layers": [0, 2]},
            {"name": "s1", "listen": "127.0.0.1:9102", "layers": [2, 4]},
        ],
    }
    if fetch is not None:
        data["fetch"] = fetch
    return data


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A sharded tiny checkpoint and its signed manifest file."""
    from shard.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("pub")
    model_dir = make_tiny_checkpoint(root / "model", n_layers=4, seed=8, sharded=True)
    manifest = build_manifest(model_dir, model="tiny", version=2, chunk_size=4096)
    manifest.signed(PUBLISHER).save(root / "tiny.manifest.json")
    return model_dir, root / "tiny.manifest.json"


def test_fetch_table_reads(published: tuple[Path, Path], tmp_path: Path) -> None:
    """[fetch] resolves paths against the spec, defaults to every stage, types the seeders."""
    model_dir, manifest = published
    fetch = {
        "manifest": str(manifest),
        "publisher": PUBLISHER.public.hex(),
        "cache": "cache",
        "seeder": [{"name": "seed-a", "listen": "127.0.0.1:9110"}],
    }
    spec = SwarmSpec.from_dict(spec_dict(model_dir, fetch), base_dir=tmp_path)
    assert spec.fetch is not None
    assert spec.fetch.stages == ("s0", "s1")
    assert spec.fetch.cache == tmp_path / "cache"
    assert spec.fetch.seeders == (SeederSpec("seed-a", "127.0.0.1:9110"),)
    assert spec.fetch.fetches("s1")
    assert SwarmSpec.from_dict(spec_dict(model_dir, None)).fetch is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"stages": ["s9"]}, r"fetch.stages: no stage named 's9'"),
        ({"publisher": ""}, r"fetch.publisher: must not be empty"),
        ({"parallel": 0}, r"fetch.parallel: must be >= 1"),
        ({"mirror": 1}, r"fetch.mirror: unknown key"),
        (
            {"seeder": [{"name": "a", "listen": "127.0.0.1:9101"}]},
            r"fetch.seeder\[0\].listen: duplicate listen address",
        ),
        (
            {"seeder": [{"name": "a", "listen": "h:1"}, {"name": "a", "listen": "h:2"}]},
            r"fetch.seeder\[1\].name: duplicate seeder name",
        ),
        ({"seeder": [{"name": "a", "listen": "nowhere"}]}, r"fetch.seeder\[0\].listen"),
    ],
)
def test_fetch_table_errors(
    published: tuple[Path, Path], change: dict[str, Any], reason: str
) -> None:
    """Each mistake in [fetch] is one SpecError naming its key."""
    model_dir, manifest = published
    fetch = {"manifest": str(manifest), "publisher": PUBLISHER.public.hex(), **change}
    with pytest.raises(SpecError, match=reason):
        SwarmSpec.from_dict(spec_dict(model_dir, fetch), source="t.toml")


def test_block_cache_refuses_rollback(published: tuple[Path, Path], tmp_path: Path) -> None:
    """Once version 2 of a model was accepted, version 1 is refused; version 3 is taken."""
    model_dir, path = published
    v2 = Manifest.from_file(path)
    dest = accept_manifest(v2, tmp_path)
    assert dest.parent == tmp_path / "tiny"
    assert accept_manifest(v2, tmp_path) == dest
    v1 = build_manifest(model_dir, model="tiny", version=1, chunk_size=4096)
    with pytest.raises(ManifestInvalid, match="rollback"):
        accept_manifest(v1, tmp_path)
    v3 = build_manifest(model_dir, model="tiny", version=3, chunk_size=4096)
    assert accept_manifest(v3, tmp_path) != dest


async def test_fetch_stage_refuses_a_foreign_publisher(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """A stage whose spec names another publisher refuses the manifest before any fetch."""
    model_dir, manifest = published
    other = NodeIdentity.from_seed(b"o" * 32).public.hex()
    fetch = {"manifest": str(manifest), "publisher": other, "cache": str(tmp_path)}
    spec = SwarmSpec.from_dict(spec_dict(model_dir, fetch))
    with pytest.raises(ManifestInvalid, match="not by the expected publisher"):
        await fetch_stage(spec, "s0")


async def test_ring_of_fetching_stages_matches_the_reference(
    published: tuple[Path, Path], tmp_path: Path
) -> None:
    """Stages with [fetch] download their blocks from a seeder at start; the ring's greedy
    output equals the single-process reference on the original checkpoint."""
    model_dir, manifest = published
    fetch: dict[str, Any] = {
        "manifest": str(manifest),
        "publisher": PUBLISHER.public.hex(),
        "cache": str(tmp_path / "cache"),
        "seeder": [{"name": "seed-a", "listen": "127.0.0.1:0", "model": str(model_dir)}],
    }
    spec = SwarmSpec.from_dict(spec_dict(model_dir, fetch))
    seeder = make_seeder(spec, "seed-a", model_dir)
    assert seeder is not None
    prompt = [5, 17, 99, 3]
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(seeder.run)
            fetch["seeder"][0]["listen"] = address
            spec = SwarmSpec.from_dict(spec_dict(model_dir, fetch))
            handle: CoordinatorHandle = await nursery.start(
                lambda task_status: run_swarm(spec, model_dir=model_dir, task_status=task_status)
            )
            done = await handle.coordinator.generate(prompt, max_tokens=8)
            nursery.cancel_scope.cancel()
    config = ModelConfig.from_dir(model_dir)
    full = load_stage(model_dir, 0, config.n_layers)
    want = generate_reference(full, prompt, max_tokens=8, eos_ids=config.eos_token_ids, max_len=64)
    assert done.token_ids == want.token_ids
    blocks = sorted((tmp_path / "cache" / "tiny").glob("v2-*"))
    assert len(blocks) == 1  # both stages share one sparse copy of the block cache
    assert seeder.statistics().served > 0
