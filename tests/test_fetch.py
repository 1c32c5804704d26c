"""Verified fetch from seeders: tampered chunks rejected and fetched elsewhere, slow and
missing peers skipped, resume after interruption without re-downloading, only the block's
bytes fetched, identical logits from a fetched block, and the ring starting from fetched blocks.

Charter: 127.0.0.1 and port 0 only; every I/O test under a ``trio.fail_after`` deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from fetch_fixtures import source, tampered
from shard.messages import (
    ChunkData,
    ChunkMissing,
    ChunkRequest,
    Fault,
    Hello,
    NodeName,
    Probe,
    Welcome,
)
from shard.model.loader import load_stage
from shard.transport import Connection, WebSocketNetwork
from shard.transport.links import accept_peer, dial_peer
from shard.weights.build import build_manifest
from shard.weights.fetch import FetchError, FetchOptions, FetchProgress, FetchReport, fetch_block
from shard.weights.manifest import Manifest
from shard.weights.plan import block_chunks, chunk_keys, plan_bytes
from shard.weights.seeder import ChunkSource, DirectorySource, Seeder
from shard.weights.store import verified_chunks

CHUNK = 4096
DEADLINE_S = 30
SWARM = "test"


@asynccontextmanager
async def seeders(
    manifest: Manifest, sources: Sequence[ChunkSource]
) -> AsyncIterator[tuple[WebSocketNetwork, list[str], list[Seeder]]]:
    """Seeders on loopback port 0 serving ``sources``; yields the open network and addresses."""
    async with WebSocketNetwork() as net, trio.open_nursery() as nursery:
        made = [
            Seeder(manifest, s, node=f"seed{i}", swarm=SWARM, listen="127.0.0.1:0", network=net)
            for i, s in enumerate(sources)
        ]
        addresses = [await nursery.start(s.run) for s in made]
        yield net, addresses, made
        nursery.cancel_scope.cancel()


async def fetch(
    manifest: Manifest,
    net: WebSocketNetwork,
    peers: list[str],
    dest: Path,
    block: tuple[int, int],
    **kw: Any,
) -> FetchReport:
    options = kw.pop("options", FetchOptions(parallel=2, chunk_timeout_s=5, connect_timeout_s=5))
    return await fetch_block(
        manifest,
        first=block[0],
        last=block[1],
        peers=peers,
        network=net,
        dest=dest,
        swarm=SWARM,
        options=options,
        **kw,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    from shard.testing import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("m"), n_layers=8, seed=11)
    return model_dir, build_manifest(model_dir, model="tiny", version=1, chunk_size=CHUNK)


def file_bytes(directory: Path, name: str = "model.safetensors") -> bytes:
    return (directory / name).read_bytes()


def corrupt(path: Path, offset: int) -> None:
    """Change two bytes of ``path`` at ``offset`` (a disk error, a hand edit)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xde\xad")


def assert_same_weights(a: Path, b: Path, block: tuple[int, int]) -> None:
    left, right = load_stage(a, *block), load_stage(b, *block)
    for (name, x), (_, y) in zip(
        left.state_dict().items(), right.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name


async def test_tampered_chunk_is_rejected_and_fetched_from_another_peer(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """A seeder serving one tampered chunk is reported; the chunk comes from the other seeder
    and the tampered bytes never reach the output."""
    model_dir, manifest = model
    keys = chunk_keys(block_chunks(manifest, 3, 5))
    target = keys[2]  # with one request in flight, peers alternate: chunk 2 is asked of A
    bad = source(manifest, model_dir, tamper={target})
    good = source(manifest, model_dir)
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [bad, good]) as (net, (a, b), _):
            options = FetchOptions(parallel=1, chunk_timeout_s=5)
            report = await fetch(manifest, net, [a, b], tmp_path, (3, 5), options=options)
    assert bad.tampered == [target]
    assert report.bad_peers == (a,)
    assert target in good.asked
    assert set(bad.asked).isdisjoint(keys[3:])  # dropped for the rest of the fetch
    start, end = manifest.file(target[0]).span(target[1], CHUNK)
    original = file_bytes(model_dir, target[0])
    fetched = file_bytes(tmp_path, target[0])
    assert fetched[start:end] == original[start:end]
    assert tampered(original[start:end]) not in fetched
    assert_same_weights(tmp_path, model_dir, (3, 5))


async def test_every_chunk_tampered_with_requests_in_flight(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """With several requests in flight, a seeder tampering with everything is dropped after
    its first bad chunks and the block still arrives intact from the honest one."""
    model_dir, manifest = model
    bad, good = source(manifest, model_dir, tamper_all=True), source(manifest, model_dir)
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [bad, good]) as (net, (a, b), _):
            options = FetchOptions(parallel=4)
            report = await fetch(manifest, net, [a, b], tmp_path, (0, 3), options=options)
    assert report.bad_peers == (a,)
    assert 1 <= len(bad.asked) <= 4
    assert_same_weights(tmp_path, model_dir, (0, 3))


async def test_interrupted_fetch_resumes_without_downloading_verified_chunks(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """Cancelled mid-way, a fetch keeps its verified chunks; the rerun asks only for the rest."""
    model_dir, manifest = model
    seed = source(manifest, model_dir)
    total = len(chunk_keys(block_chunks(manifest, 2, 6)))
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [seed]) as (net, peers, _):
            with trio.CancelScope() as scope:

                def stop_after_ten(p: FetchProgress) -> None:
                    if p.chunks_done >= 10:
                        scope.cancel()

                await fetch(manifest, net, peers, tmp_path, (2, 6), progress=stop_after_ten)
            assert scope.cancelled_caught
            kept = verified_chunks(tmp_path, manifest)
            assert kept is not None
            assert 10 <= len(kept) < total
            first_run = list(seed.asked)
            seed.asked.clear()
            report = await fetch(manifest, net, peers, tmp_path, (2, 6))
    assert set(seed.asked).isdisjoint(kept)
    assert report.chunks_reused == len(kept)
    assert report.chunks_fetched == len(seed.asked) == total - len(kept)
    assert len(first_run) + len(seed.asked) <= total + 2  # at most the in-flight ones twice
    assert_same_weights(tmp_path, model_dir, (2, 6))


async def test_corrupted_local_chunk_is_fetched_again(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """A recorded chunk that no longer verifies on disk is fetched again, never loaded."""
    model_dir, manifest = model
    seed = source(manifest, model_dir)
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [seed]) as (net, peers, _):
            await fetch(manifest, net, peers, tmp_path, (0, 2))
            victim = chunk_keys(block_chunks(manifest, 0, 2))[-1]
            start, _ = manifest.file(victim[0]).span(victim[1], CHUNK)
            corrupt(tmp_path / victim[0], start + 7)
            seed.asked.clear()
            report = await fetch(manifest, net, peers, tmp_path, (0, 2))
    assert seed.asked == [victim]
    assert report.chunks_fetched == 1
    assert_same_weights(tmp_path, model_dir, (0, 2))


async def test_only_the_blocks_bytes_are_fetched(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """A middle stage of an 8-layer model downloads its chunks only: about a quarter of the
    weights, counted at the seeder; progress ends at the plan's totals."""
    model_dir, manifest = model
    seen: list[FetchProgress] = []
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [source(manifest, model_dir)]) as (net, peers, made):
            report = await fetch(manifest, net, peers, tmp_path, (3, 5), progress=seen.append)
            served = made[0].statistics()
    weights = manifest.file("model.safetensors").size
    planned = plan_bytes(manifest, chunk_keys(block_chunks(manifest, 3, 5)))
    assert served.bytes_served == report.bytes_fetched == planned
    assert served.requests == report.chunks_fetched == report.chunks_total
    print(f"middle stage fetched {planned} bytes of a {weights}-byte safetensors file")
    assert planned < 0.4 * weights
    assert [p.chunks_done for p in seen] == list(range(1, report.chunks_total + 1))
    assert seen[-1].bytes_done == seen[-1].bytes_total == planned


@pytest.mark.parametrize("sharded", [False, True])
async def test_fetched_blocks_give_identical_logits(
    tiny_checkpoint: Any, tmp_path: Path, sharded: bool
) -> None:
    """Two stages loaded from fetched blocks compute bit-identical logits to the original."""
    model_dir = tiny_checkpoint(n_layers=4, sharded=sharded)
    manifest = build_manifest(model_dir, model="tiny", version=1, chunk_size=CHUNK)
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [source(manifest, model_dir)]) as (net, peers, _):
            for i, block in enumerate([(0, 2), (2, 4)]):
                await fetch(manifest, net, peers, tmp_path / f"s{i}", block)

    def logits(head_dir: Path, tail_dir: Path) -> torch.Tensor:
        head, tail = load_stage(head_dir, 0, 2), load_stage(tail_dir, 2, 4)
        ids = torch.tensor([[5, 17, 99, 3, 42]])
        hidden = head(ids, 0, head.new_cache(16))
        return tail(hidden, 0, tail.new_cache(16))

    assert torch.equal(logits(tmp_path / "s0", tmp_path / "s1"), logits(model_dir, model_dir))


async def test_slow_peer_is_skipped(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    """A peer that never answers costs one deadline per chunk, then is dropped after its
    strikes; the block comes from the other peer."""
    model_dir, manifest = model

    async def silent(conn: Connection) -> None:
        await accept_peer(conn, Welcome(node=NodeName("slow"), role="seeder", swarm=SWARM))
        await trio.sleep_forever()

    with trio.fail_after(DEADLINE_S):
        async with (
            seeders(manifest, [source(manifest, model_dir)]) as (net, peers, _),
            trio.open_nursery() as nursery,
        ):
            slow = await nursery.start(net.serve, "127.0.0.1:0", silent)
            options = FetchOptions(parallel=2, chunk_timeout_s=0.3, max_strikes=2)
            report = await fetch(manifest, net, [slow, *peers], tmp_path, (0, 1), options=options)
            nursery.cancel_scope.cancel()
    assert report.slow_peers == (slow,)
    assert report.bad_peers == ()
    assert_same_weights(tmp_path, model_dir, (0, 1))


async def test_chunk_nobody_has_fails_then_resumes(
    model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """When no peer holds a chunk the fetch fails naming it; a rerun with a peer that has it
    fetches that chunk and what was left, nothing verified twice."""
    model_dir, manifest = model
    missing = chunk_keys(block_chunks(manifest, 6, 8))[-1]
    partial = source(manifest, model_dir, lacks={missing})
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [partial]) as (net, peers, _):
            with pytest.raises(FetchError, match=rf"{missing[0]} chunk {missing[1]}: no peer"):
                await fetch(manifest, net, peers, tmp_path, (6, 8))
        kept = verified_chunks(tmp_path, manifest)
        assert kept is not None
        full = source(manifest, model_dir)
        async with seeders(manifest, [full]) as (net, peers, _):
            await fetch(manifest, net, peers, tmp_path, (6, 8))
    assert missing in full.asked
    assert set(full.asked).isdisjoint(kept)
    assert_same_weights(tmp_path, model_dir, (6, 8))


async def test_seeder_answers_and_refuses(model: tuple[Path, Manifest]) -> None:
    """A seeder answers a known chunk with uint8 data, an unknown manifest or chunk with
    ChunkMissing, and anything else with a Fault."""
    model_dir, manifest = model
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [source(manifest, model_dir)]) as (net, peers, made):
            seeder = made[0]
            ok = seeder.answer(ChunkRequest(manifest.root, "model.safetensors", 1))
            assert isinstance(ok, ChunkData)
            assert (ok.data.dtype, ok.data.shape) == ("uint8", (CHUNK,))
            other = seeder.answer(ChunkRequest("0" * 64, "model.safetensors", 1))
            assert isinstance(other, ChunkMissing)
            assert "serves manifest" in other.reason
            beyond = seeder.answer(ChunkRequest(manifest.root, "model.safetensors", 10**6))
            assert isinstance(beyond, ChunkMissing)
            hello = Hello(node=NodeName("f"), role="fetch", swarm=SWARM)
            conn = await dial_peer(net, peers[0], hello, timeout_s=5)
            await conn.send(Probe(nonce=1, sent_at=0.0))
            assert isinstance(await conn.receive(), Fault)
            await conn.aclose()


async def test_stage_serves_what_it_holds(model: tuple[Path, Manifest], tmp_path: Path) -> None:
    """A fetched block directory seeds exactly its verified chunks to other fetchers."""
    model_dir, manifest = model
    with trio.fail_after(DEADLINE_S):
        async with seeders(manifest, [source(manifest, model_dir)]) as (net, peers, _):
            await fetch(manifest, net, peers, tmp_path / "stage", (2, 4))
        held = DirectorySource(manifest, tmp_path / "stage")
        async with seeders(manifest, [held]) as (net, peers, made):
            await fetch(manifest, net, peers, tmp_path / "again", (2, 4))
            with pytest.raises(FetchError, match="does not have it"):
                await fetch(manifest, net, peers, tmp_path / "other", (5, 7))
    assert made[0].statistics().missing >= 1
    assert_same_weights(tmp_path / "again", model_dir, (2, 4))
