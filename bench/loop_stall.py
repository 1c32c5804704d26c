"""The worst event-loop stall of a coordinator under hostile loads, measured side by side.

A probe task sleeps 10 ms at a time and records how late each wake-up is; the largest
lateness while a load runs is that load's worst stall (a stall past ``failover.dead_after_s``,
1 s by default, is what once made the scheduler declare healthy stages dead). Loads, each
``--repeats`` times, interleaved:

- ``prompt-900k-on-loop``: the old path: the ~900 KB prompt tokenized on the loop
  (``tokenizers``' ``encode``), the bundled SmolLM2 tokenizer;
- ``prompt-900k-thread-encode``: the same in a worker thread, with ``encode`` (which holds
  the GIL: a thread alone does not help);
- ``prompt-900k-served``: ``shard.coordinator.service.complete`` on a coordinator whose
  ``max_prompt_bytes`` admits it (1 MiB): tokenized in a thread with ``encode_batch``, which
  releases the GIL, then refused as longer than ``max_len``;
- ``prompt-900k-refused``: the same request under the default ``max_prompt_bytes`` (256 KiB):
  refused before tokenizing;
- ``flood-8x63MiB`` / ``flood-8x63MiB-decode-on-loop``: eight raw clients each send one valid
  63 MiB frame to a ``WebSocketNetwork`` server (default budget: 4 messages) that decodes
  them; the second mode forces decoding onto the loop (as before frames over 1 MiB went to a
  thread);
- ``idle-1200``: 1,200 TCP connections opened and left idle (``max_connections`` 256 keeps
  256 of them).

Writes JSON (``--json``), prints a Markdown table of medians and maxima. Nothing is
asserted: benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import resource
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from shard.convert.bundled import resolve_model
from shard.coordinator.config import CoordinatorChannels, CoordinatorConfig
from shard.coordinator.coordinator import Coordinator
from shard.coordinator.service import complete, prompt_ids
from shard.coordinator.text import TextAdapter
from shard.messages import ChunkSeq, Epoch, GenerateRequest, Message, NodeName, Prefill, SessionId
from shard.messages.values import Tensor
from shard.model.tokenizer import Tokenizer
from shard.spec.limits import Limits
from shard.transport import Connection, WebSocketNetwork, wsconnection
from shard.transport.base import split_address
from shard.wire import encode

PROBE_S = 0.01
WORDS = ("alpha", "beta", "gamma", "the", "of", "inference", "pipeline", "ring", "stage", "\n")


def prompt_text(size: int) -> str:
    words = (WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(size))
    return " ".join(words)[:size]


async def worst_stall(load: Callable[[], Awaitable[None]]) -> float:
    """Run ``load`` beside the probe; the largest lateness of a probe wake-up, in seconds."""
    worst = 0.0
    done = trio.Event()

    async def probe() -> None:
        nonlocal worst
        while not done.is_set():
            before = trio.current_time()
            await trio.sleep(PROBE_S)
            worst = max(worst, trio.current_time() - before - PROBE_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        await trio.sleep(5 * PROBE_S)
        await load()
        done.set()
    return worst


def bare_coordinator(max_prompt_bytes: int) -> Coordinator:
    to_send, _ = trio.open_memory_channel[Message](1)
    _, from_recv = trio.open_memory_channel[Message](1)
    return Coordinator(
        CoordinatorConfig(
            node=NodeName("coord"),
            eos_ids=[0],
            limits=Limits(max_len=2048, max_prompt_bytes=max_prompt_bytes),
        ),
        CoordinatorChannels(to_ring=to_send, from_ring=from_recv),
    )


def prompt_loads(tokenizer: Tokenizer, text: str) -> dict[str, Callable[[], Awaitable[None]]]:
    request = GenerateRequest(1, text, 4)
    backend = tokenizer._backend  # the old path called tokenizers' encode directly

    async def on_loop() -> None:
        backend.encode(text, add_special_tokens=True)
        await trio.lowlevel.checkpoint()

    async def thread_encode() -> None:
        await trio.to_thread.run_sync(lambda: backend.encode(text, add_special_tokens=True))

    async def served(max_bytes: int) -> None:
        async def drop(msg: Message) -> None:
            del msg

        done = await complete(bare_coordinator(max_bytes), TextAdapter(tokenizer), request, drop)
        assert done.finish_reason == "error", done

    return {
        "prompt-900k-on-loop": on_loop,
        "prompt-900k-thread-encode": thread_encode,
        "prompt-900k-served": lambda: served(1 << 20),
        "prompt-900k-refused": lambda: served(256 * 1024),
    }


def ws_frame(payload: bytes) -> bytes:
    """One masked (zero key) binary WebSocket frame, as a client sends it."""
    return b"\x82\xff" + struct.pack(">Q", len(payload)) + b"\0\0\0\0" + payload


async def raw_client(address: str, data: bytes) -> None:
    host, port = split_address(address)
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(
            f"GET / HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\nConnection: Upgrade"
            "\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13"
            "\r\n\r\n".encode()
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some()
        if data:
            await stream.send_all(data)
            with trio.move_on_after(120):  # until the server is done with it and hangs up
                while await stream.receive_some():
                    pass


def flood_load(peers: int, mib: int, *, on_loop: bool) -> Callable[[], Awaitable[None]]:
    hidden = Tensor("float32", (1, mib * 1024, 256), bytes(mib << 20))
    message = Prefill(SessionId(1), Epoch(0), ChunkSeq(0), 0, True, hidden=hidden)
    data = ws_frame(encode(message))  # built once, before the probe runs

    async def load() -> None:
        network = WebSocketNetwork()
        got = 0
        all_in = trio.Event()
        saved = wsconnection.OFFLOAD_BYTES
        if on_loop:
            wsconnection.OFFLOAD_BYTES = 1 << 62

        async def handler(conn: Connection) -> None:
            nonlocal got
            await conn.receive()
            got += 1
            if got == peers:
                all_in.set()

        try:
            async with network, trio.open_nursery() as nursery:
                address = await nursery.start(network.serve, "127.0.0.1:0", handler)
                for _ in range(peers):
                    nursery.start_soon(raw_client, address, data)
                await all_in.wait()
                FLOOD_PEAK.append(network.budget.statistics().peak)
                nursery.cancel_scope.cancel()
        finally:
            wsconnection.OFFLOAD_BYTES = saved

    return load


FLOOD_PEAK: list[int] = []


async def idle_load() -> None:
    network = WebSocketNetwork(connect_timeout_s=30)

    async def handler(conn: Connection) -> None:
        raise AssertionError(conn)

    async with network, trio.open_nursery() as nursery:
        address = await nursery.start(network.serve, "127.0.0.1:0", handler)
        host, port = split_address(address)
        streams = [await trio.open_tcp_stream(host, port) for _ in range(1200)]
        await trio.sleep(1.0)  # the probe never lets every task block: give accepts time
        IDLE_SERVED.append(network.served)
        nursery.cancel_scope.cancel()
    for stream in streams:
        await stream.aclose()


IDLE_SERVED: list[int] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-bytes", type=int, default=900_000)
    parser.add_argument("--json", type=Path, default=Path("bench/results/loop_stall.json"))
    args = parser.parse_args(argv)
    logging.getLogger("shard.transport").setLevel(logging.ERROR)  # 944 refusals are expected
    tokenizer = Tokenizer.from_dir(resolve_model("smollm2", progress=False))
    text = prompt_text(args.prompt_bytes)
    loads = prompt_loads(tokenizer, text)
    loads["flood-8x63MiB"] = flood_load(8, 63, on_loop=False)
    loads["flood-8x63MiB-decode-on-loop"] = flood_load(8, 63, on_loop=True)
    loads["idle-1200"] = idle_load
    stalls: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(args.repeats):
        for name, load in loads.items():
            stalls[name].append(trio.run(worst_stall, load))
            print(f"{name}: {stalls[name][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "prompt_bytes": len(text.encode()),
        "prompt_tokens": len(prompt_ids(tokenizer, GenerateRequest(1, text, 4))),
        "probe_s": PROBE_S,
        "worst_stall_s": stalls,
        "flood_budget_peak_bytes": FLOOD_PEAK,
        "idle_served": IDLE_SERVED,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"prompt: {report['prompt_bytes']} bytes, {report['prompt_tokens']} tokens")
    print("| load | median worst stall (ms) | max (ms) |\n|---|---:|---:|")
    for name, values in stalls.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {max(values) * 1e3:.1f} |")
    print(f"flood budget peak: {max(FLOOD_PEAK) / 2**20:.1f} MiB; idle served: {IDLE_SERVED}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
