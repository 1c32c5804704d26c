"""Every link kind of a live swarm under hostile input, plain and sealed: no node exits, and
an honest request during and after the storm gives the tokens of ``shard generate --local``.

A swarm of real processes (``shard swarm up``: coordinator + two stages) takes, per link kind
— client, control, monitor and return at the coordinator, ring at the stages — at least
``FRAMES_PER_KIND`` hostile frames, before and after ``Hello``, from a few dozen concurrent
connections: random bytes, valid frames mutated (flipped bits, truncated, wrong lengths,
corrupt prefixes, spliced), text frames, zstd bombs, oversized frames, negative fields,
valid frames of the wrong kind. On the sealed wire the fuzzer is an admitted peer (a client,
a monitor, a stage: what a stolen key gives) that runs the secure handshake itself and then
also does what a man in the middle could: flips bits in, truncates, replays, reorders and
reflects sealed records, and sends plaintext or garbage during the handshake. A connection the
node closes is replaced by a new one; one it keeps is reused.

What is asserted: every node process is alive throughout (its PID polled), honest requests
during and after match the reference, and a malformed frame after Hello is answered by the
close of its connection. The API link (HTTP) is not fuzzed here; fetch links are fuzzed
against a live seeder process by ``test_fuzz_fetch`` (plain wire only: seeders have no sealed
wire).

Charter: 127.0.0.1 only, free ports; processes in their own session, killed by PID on every
way out (``tests/procs.py``); every wait bounded. The seed is fixed (``SEED``) and printed;
``pytest --fuzz-seed N`` replays another.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio_websocket

from fuzzing import MUTATIONS, Frames, decoded, harmless, malformed, raw_ws
from procs import LineReader, alive, run_shard, started_shard, write_spec
from shard.coordinator.client import request
from shard.errors import HandshakeError
from shard.messages import (
    GenerateRequest,
    Hello,
    Message,
    NodeName,
    Register,
    StatusReset,
    Welcome,
)
from shard.nodes.compose import (
    LocalTrust,
    client_network,
    load_credentials,
    provision_local,
    trust_policy,
)
from shard.spec.swarm import SwarmSpec, load_spec
from shard.trust.handshake import DialerHandshake
from shard.trust.sealer import SessionSealer
from shard.wire import WireError, encode

pytestmark = pytest.mark.slow

SEED = 1_300_013
FRAMES_PER_KIND = 10_000
KINDS = ("client", "control", "monitor", "return", "ring")
WORKERS_PER_KIND = 5
PRE_HELLO = 0.5  # share of connections whose first frame is hostile
PROMPT = "The capital of France is"
MAX_TOKENS = 12
MAX_LEN = 256
RUN_S = 150.0
STEP_S = 60.0  # bound on one fuzz connection's exchange (a busy node drains its queue first)
LIMITS = {"max_len": MAX_LEN, "connect_timeout_s": 5.0, "max_peer_connections": 512}
SWARM = "fuzz-links"


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(seed=3, n_layers=4)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    chosen = request.config.getoption("--fuzz-seed")
    value = SEED if chosen is None else int(chosen)
    print(f"fuzz seed {value} (replay with pytest --fuzz-seed {value})")
    return value


# --- the swarm -------------------------------------------------------------------------------


@attrs.frozen
class Peer:
    """Credentials of a hostile but admitted peer (sealed wire), by the role it holds."""

    key: Path
    token: Path


def plain_spec(path: Path, model_dir: Path) -> Path:
    write_spec(path, model_dir=model_dir, blocks=[(0, 2), (2, 4)], name=SWARM, limits=LIMITS)
    # A flood can starve a node's heartbeats on a small machine; this test is about exits
    # and outputs, not about how fast a silent node is declared dead.
    with path.open("a", encoding="utf-8") as spec:
        spec.write("\n[failover]\nheartbeat_s = 0.5\ndead_after_s = 30.0\n")
    return path


def sealed_spec(path: Path, model_dir: Path) -> tuple[Path, LocalTrust]:
    """The plain spec made secure, with keys for the nodes and for three hostile peers."""
    nodes: dict[str, list[str]] = {"coord": ["coordinator"], "client": ["client"]}
    nodes |= {"s0": ["stage"], "s1": ["stage"], "evil-stage": ["stage"]}
    nodes |= {"evil-monitor": ["monitor"]}
    keys = provision_local(path.parent / "keys", swarm=SWARM, nodes=nodes, now=time.time())
    plain_spec(path, model_dir)
    lines = []
    for line in path.read_text().splitlines():
        lines.append(line.replace("insecure = true", "insecure = false"))
        if line.startswith("name = ") and line != f"name = {json.dumps(SWARM)}":
            name = line.split('"')[1]
            lines += [f'key = "{keys.key(name)}"', f'token = "{keys.token(name)}"']
    lines += ["", "[trust]", f'authority = "{keys.authority_pub}"']
    lines += [f'client_key = "{keys.key("client")}"', f'client_token = "{keys.token("client")}"']
    path.write_text("\n".join(lines) + "\n")
    return path, keys


@asynccontextmanager
async def swarm_up(spec: Path, model_dir: Path, log: Path) -> AsyncIterator[dict[str, int]]:
    """``shard swarm up SPEC``: yields node name -> PID once every node is ready."""
    args = ("swarm", "up", str(spec), "--model", str(model_dir))
    async with started_shard(*args, stderr_path=log) as launcher:
        with trio.fail_after(RUN_S):
            up = await LineReader(launcher.stdout).line_starting("SHARD SWARM UP")
        fields = dict(part.split("=", 1) for part in up.split()[3:])
        yield {name: int(pid) for name, pid in fields.items() if name != "coordinator"}


async def local_tokens(model_dir: Path) -> list[int]:
    done = await run_shard(
        "generate", "--local", "--json", "--model", str(model_dir), "--max-tokens",
        str(MAX_TOKENS), "--max-len", str(MAX_LEN), PROMPT, timeout_s=RUN_S,
    )  # fmt: skip
    assert done.returncode == 0, done.describe()
    (record,) = done.json_records()
    return list(record["token_ids"])


# --- hostile frames --------------------------------------------------------------------------


def kept(frames: Frames, kind: str) -> bytes:
    """One frame that decodes and that this link kind may see without harming an honest
    request (another kind's message, a compute for a session no one opened, ...)."""
    while True:
        frame = frames.mutated() if frames.rng.random() < 0.5 else frames.valid()
        msg = decoded(frame)
        if msg is None or not harmless(msg) or isinstance(msg, GenerateRequest):
            continue  # a GenerateRequest would start real work
        if kind == "monitor" and frames.rng.random() < 0.05:
            return encode(StatusReset(NodeName("fuzz")))
        return frame


# --- fuzz connections ------------------------------------------------------------------------


@attrs.define
class Tally:
    frames: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    pre_hello: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    connections: int = 0
    reset: int = 0  # malformed frames after Hello answered by the connection's close
    unanswered: list[str] = attrs.field(factory=list)
    refused: int = 0  # connections refused at the handshake (role, swarm, credentials)


@attrs.frozen
class Target:
    kind: str
    address: str
    hello: Hello
    peer: Peer | None  # sealed wire: whose credentials the fuzzer shows
    role: str


class Link:
    """One raw fuzz connection: a WebSocket; on the sealed wire also this side's sealer and
    the records seen, for replays and reflections."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, sealer: SessionSealer | None):
        self.ws = ws
        self.sealer = sealer
        self.sent: list[bytes] = []
        self.received: list[bytes] = []

    async def frame(self, frame: bytes | str, rng: random.Random) -> bool:
        """Send ``frame`` (sealed, maybe hostile on the sealed wire); True when the record
        itself is bad (the node must then close)."""
        if isinstance(frame, str) or self.sealer is None:
            await self.ws.send_message(frame)
            return False
        r = rng.random()
        if r < 0.985 or not self.sent:
            record = self.sealer.seal(frame)
            self.sent.append(record)
            await self.ws.send_message(record)
            return False
        if r < 0.99:
            record = bytearray(self.sealer.seal(frame))
            record[rng.randrange(len(record))] ^= 1 << rng.randrange(8)  # a flipped bit
        elif r < 0.993:
            record = bytearray(rng.choice(self.sent))  # a replay
        elif r < 0.996 and self.received:
            record = bytearray(rng.choice(self.received))  # a reflection
        elif r < 0.998:
            first, second = self.sealer.seal(frame), self.sealer.seal(frame)
            await self.ws.send_message(second)  # reordered
            record = bytearray(first)
        else:
            record = bytearray(frame)  # plaintext on a sealed connection
        await self.ws.send_message(bytes(record))
        return True

    async def receive(self) -> Message | None:
        data = await self.ws.get_message()
        if isinstance(data, str):
            return None
        if self.sealer is not None:
            self.received.append(data)
            data = self.sealer.open(data)
        return decoded(data)

    async def closed(self) -> bool:
        """Drain until the node closes; False if it did not within ``STEP_S``."""
        with trio.move_on_after(STEP_S):
            try:
                while True:
                    await self.ws.get_message()
            except trio_websocket.ConnectionClosed:
                return True
        return False


async def secure_handshake(
    ws: trio_websocket.WebSocketConnection, spec: SwarmSpec, target: Target, frames: Frames
) -> SessionSealer | None:
    """Run the dialer's secure handshake; now and then break it instead (garbage, plaintext,
    a mutated offer). Returns None when it was broken (the node must have closed)."""
    assert target.peer is not None
    policy = trust_policy(spec)
    creds = load_credentials(
        target.peer.key, target.peer.token, policy, role=target.role, now=time.time(), who="fz"
    )
    side = DialerHandshake(creds, policy, role=target.role, now=time.time(), peer=target.address)
    r = frames.rng.random()
    if r < 0.03:
        garbage = frames.rng.choice([frames.garbage(), frames.valid(), "text"])
        await ws.send_message(garbage)
        return None
    offer = side.offer()
    if r < 0.06:
        await ws.send_message(bytes(frames.rng.choice(MUTATIONS)(frames.rng, bytearray(offer))))
        return None
    await ws.send_message(offer)
    await ws.send_message(side.on_answer(await ws.get_message()))
    return side.on_verdict(await ws.get_message())


async def fuzz_connection(spec: SwarmSpec, target: Target, frames: Frames, tally: Tally) -> None:
    """One connection: a hostile first frame; or Hello, frames the link keeps, then (usually)
    a malformed one, which must close it."""
    rng, kind = frames.rng, target.kind
    tally.connections += 1
    async with raw_ws(target.address) as ws:
        sealer = None
        if target.peer is not None:
            sealer = await secure_handshake(ws, spec, target, frames)
            if sealer is None:
                tally.pre_hello[kind] += 1
                tally.frames[kind] += 1
                tally.refused += 1
                return
        link = Link(ws, sealer)
        if rng.random() < PRE_HELLO:
            first = malformed(frames) if rng.random() < 0.7 else frames.valid()
            if isinstance(decoded(first) if isinstance(first, bytes) else None, Hello):
                first = encode(Hello(NodeName("fz"), target.role, "another-swarm"))
            await link.frame(first, rng)
            tally.pre_hello[kind] += 1
            tally.frames[kind] += 1
            if not await link.closed():
                tally.unanswered.append(f"{kind}: before Hello: {first[:40]!r}")
            return
        await link.frame(encode(target.hello), rng)
        welcome = await link.receive()
        if not isinstance(welcome, Welcome):
            tally.refused += 1
            return
        if kind == "control" and rng.random() < 0.7:
            node = target.hello.node
            await link.frame(encode(Register(node, "standby", "127.0.0.1:9", -1, -1)), rng)
        for _ in range(rng.randint(10, 100)):
            bad = await link.frame(kept(frames, kind), rng)
            tally.frames[kind] += 1
            if bad:
                break
        else:
            await link.frame(malformed(frames), rng)
            tally.frames[kind] += 1
        if await link.closed():
            tally.reset += 1
        else:
            tally.unanswered.append(f"{kind}: after Hello")


async def worker(spec: SwarmSpec, target: Target, frames: Frames, tally: Tally) -> None:
    while tally.frames[target.kind] < FRAMES_PER_KIND:
        try:
            with trio.fail_after(4 * STEP_S):
                await fuzz_connection(spec, target, frames, tally)
        except* CLOSED:
            pass  # the node closed first (a refusal, a reset): the next connection
        except* trio.TooSlowError:
            tally.unanswered.append(f"{target.kind}: a connection stalled")


#: How the node ends a fuzz connection early, as the fuzzer sees it.
CLOSED = (
    trio_websocket.ConnectionClosed,
    trio_websocket.HandshakeError,
    OSError,
    HandshakeError,
    WireError,
)


def targets(spec: SwarmSpec, peers: dict[str, Peer] | None, index: int) -> list[Target]:
    """Where each link kind is reached, as whom (``peers``: sealed wire credentials)."""
    coord = str(spec.coordinator.listen)
    me = NodeName(f"fz{index}")
    tail = NodeName(spec.stages[-1].name)
    stage = str(spec.stages[index % len(spec.stages)].listen)

    def peer(role: str) -> Peer | None:
        return None if peers is None else peers[role]

    return [
        Target("client", coord, Hello(me, "client", spec.name), peer("client"), "client"),
        Target("control", coord, Hello(me, "stage", spec.name, link="control"), peer("stage"),
               "stage"),
        Target("monitor", coord, Hello(me, "monitor", spec.name), peer("monitor"), "monitor"),
        Target("return", coord, Hello(tail, "stage", spec.name), peer("stage"), "stage"),
        Target("ring", stage, Hello(me, "stage", spec.name), peer("stage"), "stage"),
    ]  # fmt: skip


#: Log lines every fuzz frame causes (the node answering the fuzzer); left out of a digest.
FUZZ_NOISE = ("ignored", "unexpected", "refused", "WireError", "ignoring")


def log_text(log: Path) -> str:
    return log.read_text(errors="replace")


def log_digest(log: Path, lines: int = 80) -> str:
    """The swarm log's last ``lines`` lines that are not the nodes answering fuzz frames,
    after the innermost traceback it holds (a node's exit is a deep exception group whose
    cause comes last, past what a CI report keeps)."""
    text = log_text(log).splitlines()
    kept = [line for line in text if not any(noise in line for noise in FUZZ_NOISE)]
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    inner = "\n".join(text[starts[-1] : starts[-1] + 40]) if starts else "(no traceback)"
    return f"innermost traceback:\n{inner}\n--- log:\n" + "\n".join(kept[-lines:])


# --- the test --------------------------------------------------------------------------------


async def honest(spec: SwarmSpec, n: int) -> list[int]:
    """One honest request through the swarm's client link; its token ids."""
    network = client_network(spec)
    async with network:
        req = GenerateRequest(request=n, prompt=PROMPT, max_tokens=MAX_TOKENS)
        done = await request(network, str(spec.coordinator.listen), req, swarm=spec.name)
    assert done.finish_reason != "error", done.error
    return list(done.token_ids)


async def fuzz_swarm(spec_path: Path, model_dir: Path, peers: dict[str, Peer] | None, seed: int,
                     log: Path) -> None:  # fmt: skip
    spec = load_spec(spec_path)
    want: list[int] = []
    tally = Tally()
    during: list[list[int]] = []
    async with trio.open_nursery() as nursery:

        async def reference() -> None:
            want.extend(await local_tokens(model_dir))

        nursery.start_soon(reference)
        async with swarm_up(spec_path, model_dir, log) as pids:
            assert set(pids) == {"coord", "s0", "s1"}
            done = trio.Event()

            async def watch() -> None:  # every node alive, all along
                while not done.is_set():
                    dead = [name for name, pid in pids.items() if not alive(pid)]
                    assert not dead, f"{dead} exited; log:\n{log_digest(log)}"
                    with trio.move_on_after(0.5):
                        await done.wait()

            async def honest_during() -> None:
                n = 1
                while not done.is_set() or not during:
                    try:
                        during.append(await honest(spec, n))
                    except Exception as exc:  # say which node went, and what the log says
                        up = {name: alive(pid) for name, pid in pids.items()}
                        raise AssertionError(
                            f"honest request {n} failed: {exc!r}; alive: {up}; "
                            f"log without fuzz noise:\n{log_digest(log)}"
                        ) from exc
                    n += 1

            began = trio.current_time()
            async with trio.open_nursery() as storm:
                storm.start_soon(watch)
                storm.start_soon(honest_during)
                async with trio.open_nursery() as fuzzers:
                    for index in range(WORKERS_PER_KIND):
                        for target in targets(spec, peers, index):
                            rng = random.Random(f"{seed}-{target.kind}-{index}")
                            frames = Frames(rng, swarm=spec.name)
                            fuzzers.start_soon(worker, spec, target, frames, tally)
                done.set()
            elapsed = trio.current_time() - began
            after = await honest(spec, 10_000)
            assert all(alive(pid) for pid in pids.values()), log_digest(log)
    print(
        f"{sum(tally.frames.values())} frames on {tally.connections} connections in "
        f"{elapsed:.0f} s: per kind {tally.frames}, before Hello {tally.pre_hello}; "
        f"{tally.reset} resets after Hello, {tally.refused} refused; {len(during)} honest "
        "requests meanwhile"
    )
    assert all(n >= FRAMES_PER_KIND for n in tally.frames.values()), tally.frames
    assert all(n > 0 for n in tally.pre_hello.values()), tally.pre_hello
    assert tally.unanswered == [], tally.unanswered[:10]
    assert want and during and all(out == want for out in during), (want, during)
    assert after == want
    assert "Traceback" not in log_text(log), log_digest(log)


async def test_plain_links_survive_fuzzing(llama_dir: Path, tmp_path: Path, seed: int) -> None:
    """Plain wire: hostile frames on every link kind, before and after Hello; no node exits
    and honest requests during and after match `generate --local`."""
    spec = plain_spec(tmp_path / "spec.toml", llama_dir)
    await fuzz_swarm(spec, llama_dir, None, seed, tmp_path / "swarm.log")


async def test_sealed_links_survive_fuzzing(llama_dir: Path, tmp_path: Path, seed: int) -> None:
    """Sealed wire: admitted hostile peers and man-in-the-middle records (flipped, replayed,
    reordered, reflected, plaintext) on every link kind; no node exits and honest requests
    during and after match `generate --local`."""
    spec, keys = sealed_spec(tmp_path / "spec.toml", llama_dir)
    peers = {
        "client": Peer(keys.key("client"), keys.token("client")),
        "stage": Peer(keys.key("evil-stage"), keys.token("evil-stage")),
        "monitor": Peer(keys.key("evil-monitor"), keys.token("evil-monitor")),
    }
    await fuzz_swarm(spec, llama_dir, peers, seed, tmp_path / "swarm.log")
