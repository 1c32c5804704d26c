"""Specific malformed frames that shard.wire must refuse with a WireError and a clear reason.

Frames are built by hand (prefix + msgpack of a raw map + payload) so each case breaks exactly
one rule of an otherwise valid frame.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import zstandard

from shard import messages as m
from shard.messages import Tensor
from shard.wire import WireError, WireLimits, converter, decode, encode
from shard.wire.frame import HEADER_ZSTD, PAYLOAD_ZSTD, PREFIX, WIRE_VERSION
from shard.wire.tensors import TENSOR_EXT

VERIFY: dict[str, Any] = {"t": "Verify", "session": 1, "epoch": 0, "seq": 2, "start": 5}


def frame(
    header: Any,
    payload: bytes = b"",
    *,
    version: int = WIRE_VERSION,
    flags: int = 0,
    raw: bytes | None = None,
) -> bytes:
    """A frame around ``header`` (a tree to msgpack, or ``raw`` header bytes) and ``payload``."""
    body = raw if raw is not None else msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(version, flags, len(body)) + body + payload


def descriptor(dtype: Any, shape: Any, nbytes: Any) -> msgpack.ExtType:
    return msgpack.ExtType(TENSOR_EXT, msgpack.packb([dtype, shape, nbytes]))


def reject(data: bytes, match: str, limits: WireLimits | None = None) -> None:
    with pytest.raises(WireError, match=match):
        decode(data, limits=limits or WireLimits())


def test_handmade_frame_is_valid() -> None:
    """The hand-built baseline decodes, so every rejection below is about its one change."""
    msg = decode(frame({**VERIFY, "ids": [1, 2]}))
    assert msg == m.Verify(m.SessionId(1), m.Epoch(0), m.ChunkSeq(2), 5, ids=(1, 2))
    hidden = {**VERIFY, "hidden": descriptor("float32", [2, 3], 24)}
    assert decode(frame(hidden, bytes(24))) == m.Verify(
        m.SessionId(1), m.Epoch(0), m.ChunkSeq(2), 5, hidden=Tensor("float32", (2, 3), bytes(24))
    )


# --- prefix -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version_byte(version: int) -> None:
    """A frame of another wire version is refused and names both versions."""
    reject(frame({**VERIFY, "ids": [1]}, version=version), f"unsupported wire version {version}")


@pytest.mark.parametrize("flags", [PAYLOAD_ZSTD, 0x04, 0x80, 0xFF])
def test_unknown_flags(flags: int) -> None:
    """Flag bits this version does not define (payload compression included) are refused."""
    reject(frame({**VERIFY, "ids": [1]}, flags=flags), "unknown flags")


@pytest.mark.parametrize("size", [0, 1, 5])
def test_truncated_prefix(size: int) -> None:
    """A frame shorter than the 6-byte prefix is refused."""
    reject(frame({**VERIFY, "ids": [1]})[:size], "truncated")


def test_oversize_frame() -> None:
    """A frame over max_frame_bytes is refused before anything is parsed."""
    data = frame({**VERIFY, "hidden": descriptor("int64", [64], 512)}, bytes(512))
    reject(data, "max_frame_bytes", WireLimits(max_frame_bytes=500))


def test_header_length_beyond_frame() -> None:
    """A header length pointing past the end of the frame is refused."""
    data = frame({**VERIFY, "ids": [1]})
    reject(data[:-3], "only")
    reject(PREFIX.pack(WIRE_VERSION, 0, 0xFFFFFFFF) + data[PREFIX.size :], "max_header_bytes")


def test_oversize_header() -> None:
    """A plain header over max_header_bytes is refused from its declared length."""
    reject(
        frame({**VERIFY, "ids": list(range(100))}),
        "max_header_bytes",
        WireLimits(max_header_bytes=64),
    )


# --- compression ------------------------------------------------------------------------------


def test_zip_bomb_header() -> None:
    """A small compressed header that declares a huge decompressed size is refused unopened."""
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\x00" * (16 << 20))
    assert len(bomb) < 1024
    reject(frame(None, raw=bomb, flags=HEADER_ZSTD), "declares 16777216 bytes decompressed")


def test_forged_content_size() -> None:
    """A zstd frame header claiming 1 TiB (with no data behind it) is refused unopened."""
    forged = struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 0x50, 1 << 40) + b"\x01\x00\x00"
    reject(frame(None, raw=forged, flags=HEADER_ZSTD), "max_header_bytes")


def test_compressed_header_without_size() -> None:
    """A compressed header that does not declare its size is refused rather than streamed."""
    obj = zstandard.ZstdCompressor().compressobj()
    packed = obj.compress(msgpack.packb({**VERIFY, "ids": [1]})) + obj.flush()
    reject(frame(None, raw=packed, flags=HEADER_ZSTD), "does not declare its size")


def test_compressed_garbage_and_trailing_data() -> None:
    """Bytes that are not zstd, or zstd followed by junk, are refused under the zstd flag."""
    reject(frame(None, raw=b"not zstd at all", flags=HEADER_ZSTD), "header")
    packed = zstandard.ZstdCompressor().compress(msgpack.packb({**VERIFY, "ids": [1]}))
    reject(frame(None, raw=packed + b"junk", flags=HEADER_ZSTD), "header: zstd failed")


# --- tensors ----------------------------------------------------------------------------------


def test_shape_bytes_mismatch() -> None:
    """A descriptor whose byte length disagrees with shape x itemsize is refused."""
    data = frame({**VERIFY, "hidden": descriptor("float32", [2, 3], 1234)}, bytes(1234))
    reject(data, r"tensor 0: 1234 bytes declared, shape \(2, 3\) float32 needs 24")


@pytest.mark.parametrize(
    ("desc", "match"),
    [
        (("float8", [2], 2), "unknown dtype 'float8'"),
        (("float32", [2, -1], 8), "bad dim -1"),
        (("float32", [True, 2], 8), "bad dim True"),
        (("float32", [1] * 9, 4), "9 dims"),
        (("float32", [1 << 40, 1 << 40], 4), "bad dim"),
        (("float32", [1 << 20, 1 << 20], 1 << 42), "max_tensor_bytes"),
        (("float32", "ab", 8), "shape must be a tuple"),
        (("float32", [2], 8.0), "8.0 bytes declared"),
    ],
)
def test_bad_tensor_descriptor(desc: tuple[Any, Any, Any], match: str) -> None:
    """Unknown dtypes, bad dims, too many dims, oversize tensors and odd types are refused."""
    reject(frame({**VERIFY, "hidden": descriptor(*desc)}, bytes(8)), match)


def test_payload_shorter_than_declared() -> None:
    """A tensor whose bytes are missing from the frame is refused before copying."""
    reject(frame({**VERIFY, "hidden": descriptor("int64", [4], 32)}, bytes(31)), "only 31 left")


def test_unclaimed_trailing_payload() -> None:
    """Payload bytes that no descriptor claims are refused."""
    reject(frame({**VERIFY, "ids": [1]}, b"\x00"), "1 trailing bytes")


def test_unknown_extension_type() -> None:
    """msgpack extension types other than the tensor descriptor (timestamps too) are refused."""
    reject(frame({**VERIFY, "hidden": msgpack.ExtType(9, b"x")}), "unknown msgpack extension")
    stamp = frame({**VERIFY, "ids": [1], "hops": [msgpack.Timestamp(1, 0)]})
    reject(stamp, "hops")


def test_map_in_tensor_slot() -> None:
    """A plain map where a tensor belongs (trying to smuggle bytes in the header) is refused."""
    data = frame({**VERIFY, "hidden": {"dtype": "float32", "shape": [1], "data": b"\x00" * 4}})
    reject(data, "expected a tensor descriptor")


# --- header and message -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({**VERIFY, "t": "Foo", "ids": [1]}, "unknown message tag 'Foo'"),
        ({k: v for k, v in VERIFY.items() if k != "t"}, "missing or non-string message tag"),
        ({**VERIFY, "t": 3, "ids": [1]}, "missing or non-string message tag"),
        ([1, 2, 3], "expected a map"),
        ({**{k: v for k, v in VERIFY.items() if k != "seq"}, "ids": [1]}, "required field missing"),
        ({**VERIFY, "ids": [1], "extra": 1}, r"extra fields found \(extra\)"),
        ({**VERIFY, "ids": [1], "start": True}, "expected int, got bool @ \\$.start"),
        ({**VERIFY, "ids": [True]}, r"expected int, got bool @ \$.ids\[0\]"),
        ({**VERIFY, "ids": [1], "start": 5.0}, "expected int, got float"),
        ({**VERIFY, "ids": [1], "start": "5"}, "expected int, got str"),
        ({**VERIFY, "ids": {"1": 2}}, "expected an array, got dict"),
        ({**VERIFY, "ids": "12"}, "expected an array, got str"),
        ({**VERIFY, "ids": [1 << 63]}, "outside int64"),
        ({**VERIFY, "ids": [-1]}, "not a token id"),
        ({**VERIFY, "ids": [1], "start": -1}, r"start = -1 is outside \[0"),
        ({**VERIFY, "ids": [1], "hops": [{"node": 1}]}, r"expected str, got int @ \$.hops\[0\]"),
        ({**VERIFY, "ids": [1], "hops": [7]}, r"expected a map @ \$.hops\[0\]"),
        (VERIFY, "exactly one of ids and hidden"),
        ({**VERIFY, "ids": [1], "hidden": descriptor("int64", [0], 0)}, "exactly one"),
        ({"t": "Heartbeat", "node": "a", "sent_at": "now"}, "expected float, got str"),
        ({**VERIFY, "t": "Prefill", "final": 1, "ids": [1]}, "expected bool, got int"),
        ({"t": "Fault", "node": "a", "kind": "x", "detail": b"bytes"}, "expected str, got bytes"),
    ],
)
def test_malformed_header(header: Any, match: str) -> None:
    """Unknown tags, missing or extra fields, wrong types and bad values are refused."""
    reject(frame(header), match)


def test_too_many_ids() -> None:
    """More ids than max_items is refused by msgpack's array cap, before the list is built."""
    reject(frame({**VERIFY, "ids": list(range(17))}), "max_array_len", WireLimits(max_items=16))


def test_nested_tuple_cap() -> None:
    """max_items also bounds nested sequences such as hops."""
    hop = {"node": "a", "compute_s": 0.0, "received_at": 0.0, "sent_at": 0.0}
    reject(
        frame({**VERIFY, "ids": [1], "hops": [hop] * 5}), "max_array_len", WireLimits(max_items=4)
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"",  # nothing
        b"\xc1",  # msgpack's never-used byte
        b"\x81\xa1t",  # truncated map
        b"\xdd\xff\xff\xff\xff",  # array of 2**32-1 items, none present
        b"\xdb\xff\xff\xff\xff",  # str of 4 GiB, none present
        b"\x81\xa1t\xa2\xff\xfe",  # invalid UTF-8 in a str
        msgpack.packb({**VERIFY, "ids": [1]}) + b"\x00",  # a second object after the header
        b"\x91" * 5000 + b"\x90",  # deep nesting
    ],
)
def test_malformed_msgpack(raw: bytes) -> None:
    """Broken, truncated, lying or over-deep msgpack is refused as a header error."""
    reject(frame(None, raw=raw), "header")


def test_encode_refuses_bad_messages() -> None:
    """encode raises WireError for a non-message, a bad tensor, a list field or a bad value."""
    good = m.Verify(m.SessionId(1), m.Epoch(0), m.ChunkSeq(0), 0, ids=(1,))
    with pytest.raises(WireError, match="not a message type"):
        encode(m.Sampling())  # type: ignore[arg-type]
    with pytest.raises(WireError, match="needs 24"):
        encode(
            m.Verify(good.session, good.epoch, good.seq, 0, hidden=Tensor("float32", (2, 3), b""))
        )
    with pytest.raises(WireError, match="unsupported type list"):
        encode(m.Verify(good.session, good.epoch, good.seq, 0, ids=[1]))  # type: ignore[arg-type]
    with pytest.raises(WireError, match="outside"):
        encode(m.Verify(good.session, good.epoch, good.seq, -3, ids=(1,)))
    with pytest.raises(WireError, match="cannot pack"):
        encode(m.Fault(m.NodeName("a"), "k", "\ud800"))  # a lone surrogate is not UTF-8


def test_header_is_the_converters_format() -> None:
    """The header is exactly the converter's unstructured message (tag 't'), as msgpack."""
    msg = m.Verify(m.SessionId(1), m.Epoch(0), m.ChunkSeq(2), 5, ids=(1, 2))
    data = encode(msg, compress=False)
    tree = msgpack.unpackb(data[PREFIX.size :])
    assert tree == converter().unstructure(msg, unstructure_as=m.Message)
    assert tree["t"] == "Verify"
