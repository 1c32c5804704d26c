"""Fuzzing shard.wire.decode: random and mutated frames either decode or raise WireError.

Seed frames come from a seeded ``random.Random`` that builds every message type from its type
hints; mutations range from byte-level (bit flips, truncation, splicing, lying lengths) to
structural (a field swapped for a value of the wrong type, re-packed and re-compressed) so that
every layer (prefix, zstd, msgpack, tensors, cattrs, value checks) sees hostile input. The seed
is printed; rerun with the same seed to reproduce a failure.
"""

from __future__ import annotations

import math
import random
import struct
import time
import tracemalloc
import types
import typing
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import zstandard

from shard import messages as m
from shard.messages import MESSAGE_TYPES, TENSOR_DTYPES, Tensor
from shard.wire import WireError, WireLimits, decode, encode
from shard.wire.frame import HEADER_ZSTD, PREFIX, WIRE_VERSION
from shard.wire.tensors import TENSOR_EXT

SEED = 0x5EED_0001
CASES = 20_000
SMALL = WireLimits(
    max_frame_bytes=4096, max_header_bytes=512, max_tensor_bytes=1024, max_dims=3, max_items=16
)
NASTY: list[Any] = [
    None, True, False, 0, -1, 1 << 63, (1 << 64) - 1, -(1 << 63), 2.5, math.nan,
    "", "x" * 300, "Verify", b"\x00" * 8, [], [1, 2], {}, {"t": "Verify"}, [[[[]]]],
    msgpack.ExtType(TENSOR_EXT, msgpack.packb(["float32", [1 << 30], 1 << 32])),
    msgpack.ExtType(TENSOR_EXT, msgpack.packb(["int64", [2], 16])),
    msgpack.ExtType(5, b"??"),
]  # fmt: skip


def sample(tp: Any, name: str, rng: random.Random) -> Any:
    """A valid value of type ``tp`` for a field called ``name`` (ids are non-negative)."""
    if isinstance(tp, typing.NewType):
        return sample(tp.__supertype__, name, rng)
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.choice([0, 1, rng.randrange(1 << 17), rng.randrange(1 << 63)])
    if tp is float:
        return rng.choice([0.0, rng.uniform(-1e3, 1e3), 1e300])
    if tp is str:
        return rng.choice(["", "stage-0", "héllo ☃", "x" * rng.randrange(80)])
    if tp is Tensor:
        dtype = rng.choice(sorted(TENSOR_DTYPES))
        shape = tuple(rng.randrange(5) for _ in range(rng.randrange(4)))
        return Tensor(dtype, shape, rng.randbytes(math.prod(shape) * TENSOR_DTYPES[dtype]))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return tuple(sample(args[0], name, rng) for _ in range(rng.choice([0, 1, 3, 40])))
    if origin in (typing.Union, types.UnionType):
        return sample(rng.choice(args), name, rng) if type(None) in args else None
    if tp is type(None):
        return None
    hints = typing.get_type_hints(tp)
    return tp(**{f.name: sample(hints[f.name], f.name, rng) for f in attrs.fields(tp)})


def sample_message(cls: type, rng: random.Random) -> Any:
    msg = sample(cls, cls.__name__, rng)
    if cls in (m.Prefill, m.Verify):
        if rng.random() < 0.5:
            return attrs.evolve(
                msg, ids=(rng.randrange(1 << 17),) * rng.randrange(1, 60), hidden=None
            )
        return attrs.evolve(msg, ids=(), hidden=sample(Tensor, "hidden", rng))
    return msg


# --- mutators: each takes (rng, frame, other frame) and returns candidate bytes ---------------


def flip_bits(rng: random.Random, f: bytes, _other: bytes) -> bytes:
    b = bytearray(f)
    for _ in range(rng.randrange(1, 9)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def set_bytes(rng: random.Random, f: bytes, _other: bytes) -> bytes:
    b = bytearray(f)
    for _ in range(rng.randrange(1, 4)):
        b[rng.randrange(len(b))] = rng.choice([0, 0xFF, 0x7F, 0x80, 0xC1, rng.randrange(256)])
    return bytes(b)


def truncate(rng: random.Random, f: bytes, _: bytes) -> bytes:
    return f[: rng.randrange(len(f))]


def extend(rng: random.Random, f: bytes, _: bytes) -> bytes:
    return f + rng.randbytes(rng.choice([1, 7, 100]))


def random_bytes(rng: random.Random, _f: bytes, _o: bytes) -> bytes:
    head = bytes([WIRE_VERSION, rng.choice([0, HEADER_ZSTD])]) if rng.random() < 0.7 else b""
    return head + rng.randbytes(rng.randrange(64))


def swap_headers(rng: random.Random, f: bytes, other: bytes) -> bytes:
    """The prefix and header of one frame with the payload (or tail) of another."""
    (n,) = struct.unpack_from(">I", f, 2)
    (k,) = struct.unpack_from(">I", other, 2)
    return f[: PREFIX.size + n] + other[PREFIX.size + k :]


def lie_about_length(rng: random.Random, f: bytes, _: bytes) -> bytes:
    n = rng.choice([0, 1, 0xFFFFFFFF, 1 << 20, 1 << 24, rng.randrange(len(f) * 2 + 1)])
    return f[:2] + struct.pack(">I", n) + f[PREFIX.size :]


def mutate_header_tree(rng: random.Random, f: bytes, _: bytes) -> bytes:
    """Replace, add or drop one field of the real header, then re-frame (maybe compressed)."""
    flags, (n,) = f[1], struct.unpack_from(">I", f, 2)
    raw = f[PREFIX.size : PREFIX.size + n]
    if flags & HEADER_ZSTD:
        raw = zstandard.ZstdDecompressor().decompress(raw)
    tree = msgpack.unpackb(raw, ext_hook=msgpack.ExtType, strict_map_key=False)
    key = rng.choice(sorted(tree))
    roll = rng.random()
    if roll < 0.6:
        tree[key] = rng.choice(NASTY)
    elif roll < 0.8:
        tree.pop(key)
    else:
        tree[rng.choice(["extra", "t", "hidden", "ids", 7])] = rng.choice(NASTY)
    body: bytes = msgpack.packb(tree, use_bin_type=rng.random() < 0.5)
    if rng.random() < 0.5:
        body, flags = zstandard.ZstdCompressor().compress(body), HEADER_ZSTD
    else:
        flags = 0
    return PREFIX.pack(WIRE_VERSION, flags, len(body)) + body + f[PREFIX.size + n :]


def mutate_inflated_header(rng: random.Random, f: bytes, o: bytes) -> bytes:
    """Flip bits inside the decompressed header and recompress, so msgpack sees the damage."""
    (n,) = struct.unpack_from(">I", f, 2)
    raw = f[PREFIX.size : PREFIX.size + n]
    if f[1] & HEADER_ZSTD:
        raw = zstandard.ZstdDecompressor().decompress(raw)
    body = zstandard.ZstdCompressor().compress(flip_bits(rng, raw, o))
    return PREFIX.pack(WIRE_VERSION, HEADER_ZSTD, len(body)) + body + f[PREFIX.size + n :]


MUTATORS: list[Callable[[random.Random, bytes, bytes], bytes]] = [
    flip_bits,
    set_bytes,
    truncate,
    extend,
    random_bytes,
    swap_headers,
    lie_about_length,
    mutate_header_tree,
    mutate_inflated_header,
]


def seed_frames(rng: random.Random) -> list[bytes]:
    frames = []
    for _ in range(6):
        for cls in MESSAGE_TYPES:
            frames.append(encode(sample_message(cls, rng), compress=rng.random() < 0.7))
    return frames


#: A decode (and the re-encode of what it accepted) slower than this, at its best of four
#: tries, suggests it allocated beyond the limits; a single slow try on a busy machine is a
#: preemption, so a slow case is timed again before it counts.
SLOW_S = 0.5


def timed_decode(data: bytes, limits: WireLimits) -> float:
    t0 = time.perf_counter()
    try:
        msg = decode(data, limits=limits)
    except WireError:
        pass
    else:
        if limits is not SMALL:
            decode(encode(msg))
    return time.perf_counter() - t0


def test_fuzz_decode_only_raises_wire_error() -> None:
    """>= 10,000 mutated frames each decode to a message or raise WireError, and return fast."""
    rng = random.Random(SEED)
    print(f"wire fuzz seed {SEED:#x}, {CASES} cases")
    seeds = seed_frames(rng)
    outcomes = {"ok": 0, "rejected": 0}
    slowest, started = 0.0, time.perf_counter()
    for case in range(CASES):
        mutator = rng.choice(MUTATORS)
        data = mutator(rng, rng.choice(seeds), rng.choice(seeds))
        limits = SMALL if case % 3 == 0 else WireLimits()
        t0 = time.perf_counter()
        try:
            msg = decode(data, limits=limits)
        except WireError:
            outcomes["rejected"] += 1
        except Exception as exc:
            raise AssertionError(
                f"seed {SEED:#x} case {case} ({mutator.__name__}): {exc!r} on {data[:80]!r}"
            ) from exc
        else:
            outcomes["ok"] += 1
            assert isinstance(msg, MESSAGE_TYPES)
            if limits is not SMALL:
                decode(encode(msg))  # whatever decode accepts, encode accepts too
        elapsed = time.perf_counter() - t0
        if elapsed >= SLOW_S:  # a preempted case is fast again; a decode that allocates is not
            elapsed = min(elapsed, *(timed_decode(data, limits) for _ in range(3)))
        slowest = max(slowest, elapsed)
    total = time.perf_counter() - started
    print(f"wire fuzz: {outcomes}, slowest decode {slowest * 1e3:.1f} ms, total {total:.1f} s")
    assert outcomes["ok"] > 0
    assert outcomes["rejected"] > CASES // 2
    assert slowest < SLOW_S, "a decode took long enough to suggest an allocation beyond the limits"


def test_hostile_lengths_allocate_within_limits() -> None:
    """Frames that declare huge sizes are refused without allocating what they declare."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (64 << 20))
    forged_zstd = struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 0x50, 1 << 40) + b"\x01\x00\x00"

    def frame(body: bytes, flags: int = 0, payload: bytes = b"") -> bytes:
        return PREFIX.pack(WIRE_VERSION, flags, len(body)) + body + payload

    def tensor_header(dtype: str, shape: list[int], nbytes: int) -> bytes:
        ext = msgpack.ExtType(TENSOR_EXT, msgpack.packb([dtype, shape, nbytes]))
        verify = {"t": "Verify", "session": 1, "epoch": 0, "seq": 0, "start": 0, "hidden": ext}
        body: bytes = msgpack.packb(verify)
        return body

    hostile = [
        PREFIX.pack(WIRE_VERSION, 0, 0xFFFFFFFF) + b"\x80",
        frame(bomb, HEADER_ZSTD),
        frame(forged_zstd, HEADER_ZSTD),
        frame(b"\xdd\xff\xff\xff\xff"),  # array of 4 G items
        frame(b"\xdf\xff\xff\xff\xff"),  # map of 4 G pairs
        frame(b"\xdb\xff\xff\xff\xff"),  # str of 4 GiB
        frame(b"\xc6\xff\xff\xff\xff"),  # bin of 4 GiB
        frame(b"\xc9\xff\xff\xff\xff\x01"),  # ext of 4 GiB
        frame(tensor_header("float32", [1 << 30, 1 << 30], 1 << 62)),
        frame(tensor_header("int64", [1 << 24], 1 << 27), payload=b"\x00" * 64),
        frame(tensor_header("float32", [1 << 26], 1 << 28), payload=b"\x00" * 64),
    ]
    tracemalloc.start()
    try:
        for data in hostile:
            try:
                decode(data)
            except WireError:
                pass
            else:
                raise AssertionError(f"hostile frame decoded: {data[:40]!r}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak traced allocation over {len(hostile)} hostile frames: {peak} bytes")
    assert peak < 256 * 1024
