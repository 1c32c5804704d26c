"""The fetch link of a live seeder under hostile input: the seeder never exits, and honest
fetches during and after the storm deliver bytes identical to the published checkpoint.

A real seeder process (``shard up --role seeder``, serving a tiny checkpoint under a signed
manifest) takes at least ``FRAMES`` hostile frames, before and after ``Hello``, from
``WORKERS`` concurrent connections: random bytes, valid frames mutated (flipped bits,
truncated, wrong lengths, corrupt prefixes, spliced), text frames, zstd bombs, oversized
frames, negative fields, valid frames of the wrong kind (``tests/fuzzing.py``), a ``Hello``
of another swarm or protocol. After ``Hello`` the fuzzer sends what the link keeps: chunk
requests, real and hostile (another manifest's root, unknown or path-like file names, indices
negative or out of range, requests mutated so that they still decode), and reads each answer;
then, usually, something the link must refuse. A connection the seeder closes is replaced by
a new one.

What is asserted: the seeder process is alive throughout (its PID polled) and logs no
traceback; every request is answered by the matching ``ChunkData`` (whose bytes verify
against the manifest) or ``ChunkMissing``; a refused frame, before or after ``Hello``, is
answered by the close of its connection; honest fetches of the whole model during the storm
(``fetch_block``) and after it (``fetch_block``, and ``shard fetch`` for a stage's block) give
files equal to the source, with no peer reported bad.

Plain wire only: a seeder has no sealed wire to fuzz. Chunks move over plain WebSockets even
in a secure swarm (admission has no ``seeder`` role; integrity comes from the signed manifest:
docs/manifests.md), so a man in the middle on a fetch link is what the fetcher's
verification already covers (``test_fetch``: tampered, missing and slow chunks).

Charter: 127.0.0.1 only, free ports; the seeder in a session of its own, killed by PID on
every way out (``tests/procs.py``); every wait bounded. The seed is fixed (``SEED``) and
printed; ``pytest --fuzz-seed N`` replays another.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio_websocket

from fuzzing import MUTATIONS, Frames, decoded, malformed, raw_ws
from procs import LineReader, alive, free_ports, run_shard, started_shard
from shard.messages import (
    ChunkData,
    ChunkMissing,
    ChunkRequest,
    Hello,
    Message,
    NodeName,
    Welcome,
)
from shard.transport import WebSocketNetwork
from shard.trust.identity import NodeIdentity
from shard.weights.build import build_manifest
from shard.weights.fetch import FetchOptions, FetchReport, fetch_block
from shard.weights.manifest import Manifest, ManifestError, verify_chunk
from shard.weights.plan import block_chunks, chunk_keys
from shard.wire import WireError, encode
from shard.wire.limits import INT64_MAX, INT64_MIN

pytestmark = pytest.mark.slow

SEED = 1_300_014
FRAMES = 10_000
WORKERS = 8
PRE_HELLO = 0.5  # share of connections whose first frame is hostile
N_LAYERS = 2
CHUNK = 4096
RUN_S = 120.0
STEP_S = 30.0  # bound on one fuzz connection's exchange
SWARM = "fuzz-fetch"
SEEDER = "seed-a"
PUBLISHER = NodeIdentity.from_seed(b"f" * 32)

#: How the seeder ends a fuzz connection early, as the fuzzer sees it.
CLOSED = (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError, WireError)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    chosen = request.config.getoption("--fuzz-seed")
    value = SEED if chosen is None else int(chosen)
    print(f"fuzz seed {value} (replay with pytest --fuzz-seed {value})")
    return value


# --- the seeder ------------------------------------------------------------------------------


@attrs.frozen
class Published:
    model_dir: Path
    manifest: Manifest
    spec: Path
    seeder: str  # its listen address


def publish(model_dir: Path, tmp: Path) -> Published:
    """A signed manifest of ``model_dir`` and a spec whose ``[fetch]`` names one seeder."""
    manifest = build_manifest(model_dir, model="tiny", version=1, chunk_size=CHUNK)
    manifest.signed(PUBLISHER).save(tmp / "tiny.manifest.json")
    coord, s0, s1, seeder = (f"127.0.0.1:{port}" for port in free_ports(4))
    lines = [
        "[swarm]", f"name = {json.dumps(SWARM)}", f"model = {json.dumps(str(model_dir))}",
        "insecure = true", "", "[coordinator]", 'name = "coord"', f'listen = "{coord}"',
        "", "[[stage]]", 'name = "s0"', f'listen = "{s0}"', "layers = [0, 1]",
        "", "[[stage]]", 'name = "s1"', f'listen = "{s1}"', "layers = [1, 2]",
        "", "[fetch]", f"manifest = {json.dumps(str(tmp / 'tiny.manifest.json'))}",
        f'publisher = "{PUBLISHER.public.hex()}"', f"cache = {json.dumps(str(tmp / 'cache'))}",
        "", "[[fetch.seeder]]", f'name = "{SEEDER}"', f'listen = "{seeder}"',
    ]  # fmt: skip
    spec = tmp / "spec.toml"
    spec.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Published(model_dir, manifest.signed(PUBLISHER), spec, seeder)


@asynccontextmanager
async def seeder_up(pub: Published, log: Path) -> AsyncIterator[int]:
    """``shard up --role seeder``: yields its PID once it serves."""
    args = ("up", "--role", "seeder", "--spec", str(pub.spec), "--node", SEEDER)
    async with started_shard(*args, "--model", str(pub.model_dir), stderr_path=log) as proc:
        with trio.fail_after(RUN_S):
            ready = await LineReader(proc.stdout).line_starting("SHARD READY")
        fields = dict(part.split("=", 1) for part in ready.split()[2:])
        assert fields["address"] == pub.seeder, ready
        assert int(fields["pid"]) == proc.pid
        yield proc.pid


# --- hostile frames --------------------------------------------------------------------------


def chunk_request(frames: Frames, manifest: Manifest) -> ChunkRequest:
    """A request for a real chunk (half the time), else one for a chunk no one has."""
    rng = frames.rng
    f = rng.choice(manifest.files)
    root, file, index = manifest.root, f.path, rng.randrange(len(f.chunks))
    if rng.random() < 0.5:
        return ChunkRequest(root, file, index)
    r = rng.random()
    if r < 0.3:
        root = rng.choice(["", "0" * 64, rng.randbytes(32).hex(), manifest.root[:-1] + "x"])
    elif r < 0.6:
        file = rng.choice(["", "nope", "../" + f.path, "/etc/passwd", f.path + "\x00", "é" * 300])
    else:
        index = rng.choice([-1, len(f.chunks), 10**9, INT64_MAX, INT64_MIN])
    return ChunkRequest(root, file, index)


def kept(frames: Frames, manifest: Manifest) -> tuple[bytes, ChunkRequest]:
    """A frame the fetch link keeps (a chunk request, maybe mutated so it still decodes) and
    the request it decodes to."""
    rng = frames.rng
    request = chunk_request(frames, manifest)
    frame = encode(request, compress=rng.random() < 0.3)
    if rng.random() < 0.3:
        for _ in range(20):  # most mutations no longer decode; keep one that does
            mutated = bytes(rng.choice(MUTATIONS)(rng, bytearray(frame)))
            msg = decoded(mutated)
            if isinstance(msg, ChunkRequest):
                return mutated, msg
    return frame, request


def refused(frames: Frames) -> bytes | str:
    """A frame the fetch link must answer with a close: malformed, or valid and not a
    chunk request (``Frames`` never makes one)."""
    return malformed(frames) if frames.rng.random() < 0.7 else frames.valid()


def before_hello(frames: Frames, manifest: Manifest) -> bytes | str:
    """A first frame the seeder must refuse."""
    r = frames.rng.random()
    if r < 0.1:
        return encode(Hello(NodeName("fz"), "fetch", "another-swarm"))
    if r < 0.15:
        return encode(Hello(NodeName("fz"), "fetch", SWARM, protocol=10**6))
    if r < 0.25:
        return kept(frames, manifest)[0]  # a request before Hello
    first = refused(frames)
    if isinstance(first, bytes) and isinstance(decoded(first), Hello):
        return encode(Hello(NodeName("fz"), "fetch", "another-swarm"))
    return first


# --- fuzz connections ------------------------------------------------------------------------


@attrs.define
class Tally:
    frames: int = 0
    pre_hello: int = 0
    requests: int = 0
    served: int = 0  # requests answered with verified ChunkData
    connections: int = 0
    reset: int = 0  # refused frames after Hello answered by the connection's close
    wrong: list[str] = attrs.field(factory=list)  # answers that are not what was asked
    unanswered: list[str] = attrs.field(factory=list)


async def closed(ws: trio_websocket.WebSocketConnection) -> bool:
    """Drain until the seeder closes; False if it did not within ``STEP_S``."""
    with trio.move_on_after(STEP_S):
        try:
            while True:
                await ws.get_message()
        except trio_websocket.ConnectionClosed:
            return True
    return False


def check_answer(manifest: Manifest, request: ChunkRequest, reply: Message | None) -> str | None:
    """Why ``reply`` is not the seeder's answer to ``request`` (None when it is: the matching
    ``ChunkMissing``, or the matching ``ChunkData`` whose bytes verify)."""
    if not isinstance(reply, ChunkData | ChunkMissing):
        return f"{request}: answered {reply!r:.80}"
    if (reply.root, reply.file, reply.index) != (request.root, request.file, request.index):
        return f"{request}: answered {type(reply).__name__} for {reply.file} {reply.index}"
    if isinstance(reply, ChunkData):
        try:
            verify_chunk(manifest, request.file, request.index, reply.data.data)
        except ManifestError as exc:
            return f"{request}: served bad bytes ({exc})"
    return None


async def fuzz_connection(address: str, manifest: Manifest, frames: Frames, t: Tally) -> None:
    """One connection: a hostile first frame; or Hello, chunk requests (each answer read and
    checked), then (usually) a frame the link refuses, which must close it."""
    rng = frames.rng
    t.connections += 1
    async with raw_ws(address) as ws:
        if rng.random() < PRE_HELLO:
            first = before_hello(frames, manifest)
            await ws.send_message(first)
            t.pre_hello += 1
            t.frames += 1
            if not await closed(ws):
                t.unanswered.append(f"before Hello: {first[:40]!r}")
            return
        await ws.send_message(encode(Hello(NodeName("fz"), "fetch", SWARM)))
        welcome = decoded(await ws.get_message())
        assert isinstance(welcome, Welcome), welcome
        for _ in range(rng.randint(10, 100)):
            frame, request = kept(frames, manifest)
            await ws.send_message(frame)
            t.frames += 1
            t.requests += 1
            try:
                answer = await ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                t.wrong.append(f"{request}: closed instead of an answer ({exc})")
                return
            reply = decoded(answer) if isinstance(answer, bytes) else None
            problem = check_answer(manifest, request, reply)
            if problem is not None:
                t.wrong.append(problem)
            t.served += isinstance(reply, ChunkData)
        if rng.random() < 0.1:
            return  # a fetcher that just goes away
        bad = refused(frames)
        await ws.send_message(bad)
        t.frames += 1
        if await closed(ws):
            t.reset += 1
        else:
            t.unanswered.append(f"after Hello: {bad[:40]!r}")


async def worker(address: str, manifest: Manifest, frames: Frames, t: Tally) -> None:
    while t.frames < FRAMES:
        try:
            with trio.fail_after(4 * STEP_S):
                await fuzz_connection(address, manifest, frames, t)
        except* CLOSED:
            pass  # the seeder closed first (a refusal): the next connection
        except* trio.TooSlowError:
            t.unanswered.append("a connection stalled")


# --- honest fetches --------------------------------------------------------------------------


async def honest_fetch(pub: Published, dest: Path) -> FetchReport:
    """The whole model from the seeder, as a stage fetches (every chunk verified)."""
    options = FetchOptions(parallel=2, chunk_timeout_s=STEP_S, connect_timeout_s=STEP_S)
    async with WebSocketNetwork() as network:
        report = await fetch_block(
            pub.manifest, first=0, last=N_LAYERS, peers=[pub.seeder], network=network,
            dest=dest, node="honest", swarm=SWARM, options=options,
        )  # fmt: skip
    assert report.bad_peers == () and report.chunks_fetched == report.chunks_total, report
    for f in pub.manifest.files:
        assert (dest / f.path).read_bytes() == (pub.model_dir / f.path).read_bytes(), f.path
    return report


async def shard_fetch(pub: Published) -> None:
    """``shard fetch --spec SPEC --node s0``: stage s0's block, its chunks equal the source."""
    done = await run_shard("fetch", "--spec", str(pub.spec), "--node", "s0", timeout_s=RUN_S)
    assert done.returncode == 0, done.describe()
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("fetched ")]
    fields = dict(part.split("=", 1) for part in line.split()[1:])
    assert fields["bad_peers"] == "-", line
    dest = Path(fields["path"])
    for file, index in chunk_keys(block_chunks(pub.manifest, 0, 1)):
        start, end = pub.manifest.file(file).span(index, CHUNK)
        want = (pub.model_dir / file).read_bytes()[start:end]
        assert (dest / file).read_bytes()[start:end] == want, (file, index)


# --- the test --------------------------------------------------------------------------------


async def test_fetch_link_survives_fuzzing(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, seed: int
) -> None:
    """Plain wire: hostile frames on a live seeder's fetch link, before and after Hello; the
    seeder never exits, answers every request with the chunk asked for, closes on every refused
    frame, and honest fetches during and after give the source's bytes."""
    pub = publish(tiny_checkpoint(seed=5, n_layers=N_LAYERS), tmp_path)
    log = tmp_path / "seeder.log"
    tally = Tally()
    during: list[FetchReport] = []
    async with seeder_up(pub, log) as pid:
        done = trio.Event()

        async def watch() -> None:  # the seeder alive, all along
            while not done.is_set():
                assert alive(pid), f"the seeder exited; log:\n{log.read_text()[-4000:]}"
                with trio.move_on_after(0.5):
                    await done.wait()

        async def honest_during() -> None:
            while not done.is_set() or not during:
                during.append(await honest_fetch(pub, tmp_path / f"during-{len(during)}"))

        began = trio.current_time()
        with trio.fail_after(RUN_S):
            async with trio.open_nursery() as storm:
                storm.start_soon(watch)
                storm.start_soon(honest_during)
                async with trio.open_nursery() as fuzzers:
                    for index in range(WORKERS):
                        frames = Frames(random.Random(f"{seed}-fetch-{index}"), swarm=SWARM)
                        fuzzers.start_soon(worker, pub.seeder, pub.manifest, frames, tally)
                done.set()
        elapsed = trio.current_time() - began
        await honest_fetch(pub, tmp_path / "after")
        await shard_fetch(pub)
        assert alive(pid), log.read_text()[-4000:]
    print(
        f"{tally.frames} frames on {tally.connections} connections in {elapsed:.0f} s: "
        f"{tally.pre_hello} before Hello, {tally.requests} chunk requests ({tally.served} "
        f"served), {tally.reset} resets after Hello; {len(during)} honest fetches meanwhile"
    )
    assert tally.frames >= FRAMES, tally
    assert tally.pre_hello > 0 and tally.served > 0 and tally.reset > 0, tally
    assert tally.wrong == [], tally.wrong[:10]
    assert tally.unanswered == [], tally.unanswered[:10]
    assert during
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
