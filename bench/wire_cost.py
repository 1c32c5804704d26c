"""The secure wire's cost, side by side with plaintext, in one run.

Per frame, for two messages of the ring's hot path:

- ``ids``: an ids-only ``Verify`` (the coordinator -> stage 0 edge, last token + 4 drafts);
- ``hidden``: a ``Verify`` carrying a float32 hidden state ``[1, 16, 576]`` (36 KiB, a stage ->
  stage edge of SmolLM2 verifying 16 positions),

it times ``encode -> seal -> open -> decode`` (what one frame costs a sender plus a receiver)
with ``PlainSealer`` (``insecure = true``) and with ``SessionSealer`` (ChaCha20-Poly1305), and
the seal + open alone. Modes are interleaved round by round; each figure is the median over
rounds of the mean per frame in a round. It also times one whole handshake (both sides, pure)
and, unless ``--no-loopback``, the median round trip of each message through a real
WebSocket echo on 127.0.0.1, plain vs secure.

Writes JSON (``--json``, default ``bench/results/wire_cost.json``) and prints a Markdown
table. Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from shard.messages import ChunkSeq, Epoch, Message, SessionId, Tensor, Verify
from shard.transport import Connection, WebSocketNetwork
from shard.transport.secure import SecureWebSocketNetwork
from shard.trust.admission import issue
from shard.trust.channel import Credentials, TrustPolicy
from shard.trust.handshake import DialerHandshake, ListenerHandshake
from shard.trust.identity import NodeIdentity
from shard.trust.sealer import OVERHEAD, SessionSealer
from shard.wire import PlainSealer, Sealer, decode, encode

REPO = Path(__file__).resolve().parent.parent
Record = dict[str, Any]
NOW = time.time()


def messages() -> dict[str, Message]:
    hidden = Tensor("float32", (1, 16, 576), os.urandom(16 * 576 * 4))
    return {
        "ids": Verify(SessionId(7), Epoch(1), ChunkSeq(42), start=300, ids=(9, 11, 12, 13, 14)),
        "hidden": Verify(SessionId(7), Epoch(1), ChunkSeq(42), start=300, hidden=hidden),
    }


def pair() -> tuple[Sealer, Sealer]:
    a, b = os.urandom(32), os.urandom(32)
    return SessionSealer(send_key=a, receive_key=b), SessionSealer(send_key=b, receive_key=a)


def round_trip_us(msg: Message, mode: str, n: int) -> float:
    """Mean µs per frame of encode + seal + open + decode over ``n`` frames."""
    tx, rx = (PlainSealer(), PlainSealer()) if mode == "plain" else pair()
    start = time.perf_counter_ns()
    for _ in range(n):
        decode(rx.open(tx.seal(encode(msg))))
    return (time.perf_counter_ns() - start) / n / 1000


def seal_only_us(msg: Message, mode: str, n: int) -> float:
    """Mean µs per frame of seal + open alone (the sealer's own cost)."""
    frame = encode(msg)
    tx, rx = (PlainSealer(), PlainSealer()) if mode == "plain" else pair()
    start = time.perf_counter_ns()
    for _ in range(n):
        rx.open(tx.seal(frame))
    return (time.perf_counter_ns() - start) / n / 1000


def credentials(authority: NodeIdentity, role: str) -> Credentials:
    me = NodeIdentity.generate()
    token = issue(
        authority,
        node_pub=me.public,
        swarm="bench",
        roles=[role],
        not_before=int(NOW) - 60,
        expires=int(NOW) + 3600,
        serial=1,
    )
    return Credentials(me, token)


def handshake_us(n: int) -> float:
    """Mean µs of one complete handshake, both sides, no I/O."""
    authority = NodeIdentity.generate()
    policy = TrustPolicy(authority.public, "bench")
    coord, stage = credentials(authority, "coordinator"), credentials(authority, "stage")
    start = time.perf_counter_ns()
    for _ in range(n):
        d = DialerHandshake(coord, policy, role="coordinator", now=NOW)
        s = ListenerHandshake(stage, policy, role="stage", now=NOW)
        m4, _ = s.on_confirm(d.on_answer(s.on_offer(d.offer())))
        d.on_verdict(m4)
    return (time.perf_counter_ns() - start) / n / 1000


def measure(rounds: int, frames: int) -> list[Record]:
    rows: list[Record] = []
    for name, msg in messages().items():
        size = len(encode(msg))
        samples: dict[str, list[float]] = {k: [] for k in ("plain", "sealed", "p_seal", "s_seal")}
        for _ in range(rounds):
            samples["plain"].append(round_trip_us(msg, "plain", frames))
            samples["sealed"].append(round_trip_us(msg, "sealed", frames))
            samples["p_seal"].append(seal_only_us(msg, "plain", frames))
            samples["s_seal"].append(seal_only_us(msg, "sealed", frames))
        med = {k: statistics.median(v) for k, v in samples.items()}
        for mode, key in (("plain", "plain"), ("sealed", "sealed")):
            us = med[key]
            rows.append(
                {
                    "message": name,
                    "mode": mode,
                    "frame_bytes": size,
                    "sealed_bytes": size + (OVERHEAD if mode == "sealed" else 0),
                    "us_per_frame": round(us, 2),
                    "frames_per_s": round(1e6 / us),
                    "mb_per_s": round(size / us, 1),  # bytes per µs = MB/s
                    "seal_open_us": round(med["s_seal" if mode == "sealed" else "p_seal"], 2),
                    "ratio_vs_plain": round(us / med["plain"], 2),
                }
            )
    return rows


async def loopback_rtt_ms(msg: Message, secure: bool, n: int) -> float:
    """Median ms of ``n`` echo round trips of ``msg`` over a WebSocket on 127.0.0.1."""
    authority = NodeIdentity.generate()
    policy = TrustPolicy(authority.public, "bench")

    def network(role: str) -> WebSocketNetwork | SecureWebSocketNetwork:
        if not secure:
            return WebSocketNetwork()
        return SecureWebSocketNetwork(credentials(authority, role), policy, role=role)

    async def echo(conn: Connection) -> None:
        while True:
            await conn.send(await conn.receive())

    times: list[float] = []
    async with trio.open_nursery() as nursery, network("coordinator") as net:
        address = await nursery.start(network("stage").serve, "127.0.0.1:0", echo)
        conn = await net.dial(address)
        for _ in range(n):
            start = time.perf_counter()
            await conn.send(msg)
            await conn.receive()
            times.append((time.perf_counter() - start) * 1000)
        await conn.aclose()
        nursery.cancel_scope.cancel()
    return statistics.median(times)


async def loopback(n: int) -> list[Record]:
    rows = []
    for name, msg in messages().items():
        plain = await loopback_rtt_ms(msg, False, n)
        sealed = await loopback_rtt_ms(msg, True, n)
        rows.append(
            {"message": name, "plain_rtt_ms": round(plain, 3), "secure_rtt_ms": round(sealed, 3)}
        )
    return rows


def report(result: Record) -> str:
    head = "| message | mode | frame B | µs/frame | frames/s | MB/s | seal+open µs | × plain |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in result["frames"]:
        lines.append(
            f"| {r['message']} | {r['mode']} | {r['frame_bytes']} | {r['us_per_frame']} | "
            f"{r['frames_per_s']} | {r['mb_per_s']} | {r['seal_open_us']} | {r['ratio_vs_plain']} |"
        )
    lines.append(f"\nhandshake (both sides, no I/O): {result['handshake_us']:.0f} µs")
    for r in result.get("loopback", []):
        lines.append(
            f"loopback echo RTT, {r['message']}: plain {r['plain_rtt_ms']} ms, "
            f"secure {r['secure_rtt_ms']} ms"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/wire_cost.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=15, help="rounds per mode (default 15)")
    p.add_argument("--frames", type=int, default=400, help="frames per round (default 400)")
    p.add_argument("--rtts", type=int, default=300, help="loopback round trips (default 300)")
    p.add_argument("--no-loopback", action="store_true", help="skip the WebSocket echo")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/wire_cost.json")
    args = p.parse_args(argv)
    result: Record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cores_usable": len(os.sched_getaffinity(0)),
            "load_avg_1m": os.getloadavg()[0],
        },
        "settings": {"rounds": args.rounds, "frames_per_round": args.frames, "rtts": args.rtts},
        "frames": measure(args.rounds, args.frames),
        "handshake_us": round(statistics.median(handshake_us(200) for _ in range(5)), 1),
    }
    if not args.no_loopback:
        result["loopback"] = trio.run(loopback, args.rtts)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
