"""A secure swarm that forms from nodes holding no weights, with real processes: a
``[formation]`` coordinator on the secure wire, a seeder process and a hostile seeder (in this
process) that tampers with every chunk, and two stages started with ``shard up --role stage
--join ... --key ... --token ...`` and no model (their spec's ``model`` is an empty
directory). Each node reads the model's config from a verified fetch, is planned a block,
fetches exactly that block's chunks — refusing every tampered one — and serves it; the output
equals ``shard generate --local``. The spec pins the boundary blocks to trusted nodes and names
none: the ring forms because the nodes' admission tokens grant the role ``trusted``. Then
three nodes that must not join try: one whose token a foreign authority signed (the
coordinator refuses its handshake), one holding a client's token (it refuses itself at
start), one with no token (a spec error); the ring serves the same output afterwards.

Loopback only; every process runs in its own session and is killed by PID on the way out
(``tests/procs.py``); every wait is bounded. Keys and tokens are fresh per test
(``provision_local``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from fetch_fixtures import source
from join_fixtures import formation_lines, formed_ring, join, local, memory_gib, write_lines
from procs import LOOPBACK, Finished, LineReader, free_ports, run_shard, started_shard
from shard.nodes.compose import LocalTrust, provision_local
from shard.transport import WebSocketNetwork
from shard.trust.identity import NodeIdentity
from shard.weights.build import build_manifest
from shard.weights.manifest import Manifest
from shard.weights.plan import block_chunks, chunk_keys
from shard.weights.seeder import Seeder
from shard.weights.store import verified_chunks

pytestmark = pytest.mark.slow

PROMPT = "the river runs to the sea"
TOKENS = 24
MAX_LEN = 128
STEP_S = 60.0  # each bounded wait; the whole test takes a fraction of the sum
SWARM = "join-secure"
NODES = ("j0", "j1")


def spec_lines(
    model: Path,
    port: int,
    trust: LocalTrust,
    manifest: Path,
    publisher: str,
    cache: Path,
    seeders: Sequence[tuple[str, int, Path | None]],
) -> list[str]:
    """The swarm's spec as one machine holds it: the model it names, its own block cache."""
    lines = formation_lines(
        model,
        port,
        name=SWARM,
        expect=len(NODES),
        max_len=MAX_LEN,
        wait_s=STEP_S,
        insecure=False,
    )
    # the boundaries are pinned to trusted nodes and the spec names none: the ring forms only
    # because the joined nodes' tokens grant the role trusted (read off the secure link)
    lines.insert(lines.index("probes = 3") + 1, "pin_boundaries = true")
    lines += [
        f"key = {json.dumps(str(trust.key('coord')))}",
        f"token = {json.dumps(str(trust.token('coord')))}",
        "[trust]",
        f"authority = {json.dumps(str(trust.authority_pub))}",
        f"client_key = {json.dumps(str(trust.key('client')))}",
        f"client_token = {json.dumps(str(trust.token('client')))}",
        "[fetch]",
        f"manifest = {json.dumps(str(manifest))}",
        f'publisher = "{publisher}"',
        f"cache = {json.dumps(str(cache))}",
        "chunk_timeout_s = 10.0",
    ]
    for name, seeder_port, served in seeders:
        lines += ["[[fetch.seeder]]", f'name = "{name}"', f'listen = "{LOOPBACK}:{seeder_port}"']
        if served is not None:
            lines.append(f"model = {json.dumps(str(served))}")
    return lines


async def generate(spec: Path) -> list[int]:
    done = await run_shard(
        "generate",
        "--spec",
        str(spec),
        "--json",
        "--max-tokens",
        str(TOKENS),
        "--ignore-eos",
        PROMPT,
        timeout_s=STEP_S,
    )
    assert done.returncode == 0, done.describe()
    (record,) = done.json_records()
    ids: list[int] = record["token_ids"]
    return ids


async def test_secure_joined_nodes_fetch_their_blocks_and_intruders_are_refused(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, report: Callable[[str], None]
) -> None:
    """Two weightless --join nodes on the secure wire fetch exactly their planned blocks
    (tampered chunks refused) and give the --local output; nodes with a foreign, a client's
    or no token are refused and the ring's output stays the same."""
    began = trio.current_time()
    model_dir = tiny_checkpoint(seed=7, n_layers=4, sharded=True)
    manifest = build_manifest(model_dir, model="tiny", version=1, chunk_size=4096)
    publisher = NodeIdentity.generate()
    manifest_path = tmp_path / "tiny.manifest.json"
    manifest.signed(publisher).save(manifest_path)
    manifest = Manifest.from_file(manifest_path)
    nodes = {
        "coord": ["coordinator"],
        "client": ["client"],
        **{n: ["stage", "trusted"] for n in NODES},
    }
    trust = provision_local(tmp_path / "keys", swarm=SWARM, nodes=nodes, now=time.time())
    rogue = provision_local(
        tmp_path / "rogue",
        swarm=SWARM,
        nodes={"coord": ["coordinator"], "client": ["client"], "j9": ["stage"]},
        now=time.time(),
    )
    port, good_port, bad_port = free_ports(3)
    seeders = [("seed-good", good_port, model_dir), ("seed-bad", bad_port, None)]
    empty = tmp_path / "no-weights"
    empty.mkdir()

    def spec_for(name: str, model: Path, keys: LocalTrust = trust) -> Path:
        lines = spec_lines(
            model,
            port,
            keys,
            manifest_path,
            publisher.public.hex(),
            tmp_path / f"cache-{name}",
            seeders,
        )
        return write_lines(tmp_path / f"{name}.toml", lines)

    spec = spec_for("coord", model_dir)
    coord_log = tmp_path / "coord.err"
    hostile = source(manifest, model_dir, tamper_all=True)
    results: dict[str, str] = {}
    referenced = trio.Event()

    async def reference() -> None:
        results["local"] = await local(
            model_dir,
            PROMPT,
            "--json",
            "--max-tokens",
            str(TOKENS),
            "--max-len",
            str(MAX_LEN),
            "--ignore-eos",
            timeout_s=STEP_S,
        )
        referenced.set()

    async with WebSocketNetwork() as net, trio.open_nursery() as nursery, AsyncExitStack() as stack:
        nursery.start_soon(reference)
        bad = Seeder(
            manifest,
            hostile,
            node="seed-bad",
            swarm=SWARM,
            listen=f"{LOOPBACK}:{bad_port}",
            network=net,
        )
        await nursery.start(bad.run)
        seeder = await stack.enter_async_context(
            started_shard(
                "up",
                "--role",
                "seeder",
                "--spec",
                str(spec),
                "--node",
                "seed-good",
                "--model",
                str(model_dir),
                stderr_path=tmp_path / "seed.err",
            )
        )
        coordinator = await stack.enter_async_context(
            started_shard(
                "up",
                "--role",
                "coordinator",
                "--spec",
                str(spec),
                "--model",
                str(model_dir),
                stderr_path=coord_log,
            )
        )
        with trio.fail_after(STEP_S):
            await LineReader(seeder.stdout).line_starting("SHARD READY")
        memory = memory_gib(model_dir, 3)  # one node cannot hold the model, two can
        for name in NODES:  # no --model: the spec names an empty directory
            await join(
                stack,
                spec_for(name, empty),
                name,
                port,
                tmp_path / f"{name}.err",
                "--key",
                str(trust.key(name)),
                "--token",
                str(trust.token(name)),
                "--memory-gib",
                memory,
                timeout_s=STEP_S,
            )
        with trio.fail_after(STEP_S):  # ready once the ring formed and the tail dialled back
            await LineReader(coordinator.stdout).line_starting("SHARD READY")
        ring, _ = formed_ring(coord_log)
        assert sorted(n for n, _, _ in ring) == sorted(NODES), coord_log.read_text()

        # each node holds exactly its block's chunks, all verified; no tampered chunk landed
        for name, first, last in ring:
            (dest,) = (tmp_path / f"cache-{name}" / "tiny").glob("v1-*")
            held = verified_chunks(dest, manifest)
            assert held == set(chunk_keys(block_chunks(manifest, first, last))), name
            log = (tmp_path / f"{name}.err").read_text()
            assert "BAD PEER" in log, log  # the hostile seeder's chunks, refused
        assert hostile.tampered  # it was asked, and everything it served was refused

        got = await generate(spec)
        with trio.fail_after(STEP_S):
            await referenced.wait()
        want = json.loads(results["local"])["token_ids"]
        assert got == want and len(got) == TOKENS

        # three nodes that must not join, at once; the ring is not disturbed
        outcomes: dict[str, Finished] = {}

        async def try_join(label: str, spec_path: Path, name: str, *creds: str) -> None:
            outcomes[label] = await run_shard(
                "up",
                "--role",
                "stage",
                "--join",
                f"{LOOPBACK}:{port}",
                "--spec",
                str(spec_path),
                "--node",
                name,
                "--memory-gib",
                memory,
                *creds,
                timeout_s=STEP_S,
            )

        foreign = spec_for("j9", empty, rogue)  # believes its own authority
        async with trio.open_nursery() as tries:
            tries.start_soon(
                try_join,
                "foreign",
                foreign,
                "j9",
                "--key",
                str(rogue.key("j9")),
                "--token",
                str(rogue.token("j9")),
            )
            tries.start_soon(
                try_join,
                "client",
                spec_for("j7", empty),
                "j7",
                "--key",
                str(trust.key("client")),
                "--token",
                str(trust.token("client")),
            )
            tries.start_soon(
                try_join, "none", spec_for("j8", empty), "j8", "--key", str(trust.key("j0"))
            )
        for label, done in outcomes.items():
            assert done.returncode != 0 and "shard: error:" in done.stderr, (label, done.describe())
        assert "refused" in outcomes["foreign"].stderr, outcomes["foreign"].describe()
        assert "not 'stage'" in outcomes["client"].stderr, outcomes["client"].describe()
        assert "--key/--token" in outcomes["none"].stderr, outcomes["none"].describe()
        assert "handshake with" in coord_log.read_text()  # the coordinator refused j9
        assert await generate(spec) == want
        nursery.cancel_scope.cancel()
    report(f"secure --join swarm with verified fetch: {trio.current_time() - began:.1f} s")
