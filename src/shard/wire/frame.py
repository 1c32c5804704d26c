"""Encode and decode one frame: prefix, msgpack header (maybe zstd), raw tensor payloads.

Layout (see ``docs/wire.md``)::

    offset 0   u8    version       WIRE_VERSION
    offset 1   u8    flags         bit 0 HEADER_ZSTD; bit 1 PAYLOAD_ZSTD (reserved); others 0
    offset 2   u32   header_len    big-endian; bytes of header as sent
    offset 6   ...   header        msgpack map of the tagged message (zstd if bit 0)
    then       ...   payloads      each tensor's bytes, in descriptor order, no padding

Decoding checks every length against ``WireLimits`` before it allocates, and turns any failure
of msgpack, cattrs, zstd or struct into ``WireError``; nothing received is executed.
"""

from __future__ import annotations

import struct
from typing import Any, cast

import msgpack
import zstandard

from shard.messages import Message, Tensor
from shard.wire.checks import check_message
from shard.wire.convert import TAG, TAGS, converter, explain
from shard.wire.errors import WireError
from shard.wire.limits import WireLimits
from shard.wire.tensors import PayloadReader, pack_descriptor

WIRE_VERSION = 1
HEADER_ZSTD = 0x01
#: Reserved so a later version can compress payloads; version 1 never sets it and rejects it.
PAYLOAD_ZSTD = 0x02
KNOWN_FLAGS = HEADER_ZSTD

PREFIX = struct.Struct(">BBI")
#: Headers shorter than this are sent plain: zstd's frame overhead eats the gain.
COMPRESS_MIN_BYTES = 256
ZSTD_LEVEL = 3
# No message has more fields than this; a bigger map is garbage, refused before allocation.
_MAX_MAP_LEN = 64
_DEFAULT_LIMITS = WireLimits()


def encode(msg: Message, *, limits: WireLimits = _DEFAULT_LIMITS, compress: bool = True) -> bytes:
    """Serialize ``msg`` to one frame; raise ``WireError`` if it breaks a rule or a limit.

    The header is zstd-compressed only when ``compress`` is set, it is at least
    ``COMPRESS_MIN_BYTES`` long and compression makes it smaller. Tensor payloads are never
    compressed (activations shrink by ~5%, not worth the CPU on the hot path).
    """
    if type(msg) not in TAGS.values():
        raise WireError(f"encode: {type(msg).__name__} is not a message type")
    tensors = check_message(msg, limits)
    try:
        tree = converter().unstructure(msg, unstructure_as=Message)
        header = msgpack.packb(tree, default=_pack_tensor, use_bin_type=True)
    except Exception as exc:
        raise WireError(f"encode: cannot pack {type(msg).__name__} ({exc})") from exc
    if len(header) > limits.max_header_bytes:
        raise WireError(
            f"encode: header of {len(header)} bytes, max_header_bytes is {limits.max_header_bytes}"
        )
    flags = 0
    if compress and len(header) >= COMPRESS_MIN_BYTES:
        packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(
            header
        )
        if len(packed) < len(header):
            header, flags = packed, flags | HEADER_ZSTD
    total = PREFIX.size + len(header) + sum(memoryview(t.data).nbytes for t in tensors)
    if total > limits.max_frame_bytes:
        raise WireError(
            f"encode: frame of {total} bytes, max_frame_bytes is {limits.max_frame_bytes}"
        )
    return b"".join(
        [PREFIX.pack(WIRE_VERSION, flags, len(header)), header, *(t.data for t in tensors)]
    )


def decode(
    data: bytes | bytearray | memoryview, *, limits: WireLimits = _DEFAULT_LIMITS
) -> Message:
    """Parse one frame into a message; raise ``WireError`` (only) on any malformed input.

    Each step translates its own failures into a precise reason; the outer net guarantees
    the contract even for a failure nobody foresaw, so a hostile frame resets one connection
    and never crashes the node.
    """
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise WireError(f"frame: not a contiguous byte buffer ({exc})") from exc
    try:
        header_raw, payload = _split(view, limits)
        reader = PayloadReader(payload, limits)
        tree = _unpack(header_raw, reader, limits)
        reader.finish()
        msg = _structure(tree)
        check_message(msg, limits)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"frame: unexpected {type(exc).__name__} ({exc})") from exc
    return msg


def _pack_tensor(obj: object) -> msgpack.ExtType:
    if isinstance(obj, Tensor):
        return pack_descriptor(obj)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _split(view: memoryview, limits: WireLimits) -> tuple[bytes | memoryview, memoryview]:
    """Check the prefix; return the (decompressed) header bytes and the payload section."""
    size = view.nbytes
    if size > limits.max_frame_bytes:
        raise WireError(f"frame: {size} bytes, max_frame_bytes is {limits.max_frame_bytes}")
    if size < PREFIX.size:
        raise WireError(
            f"frame: truncated, {size} bytes is shorter than the {PREFIX.size}-byte prefix"
        )
    version, flags, header_len = PREFIX.unpack_from(view)
    if version != WIRE_VERSION:
        raise WireError(
            f"frame: unsupported wire version {version} (this build speaks {WIRE_VERSION})"
        )
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"frame: unknown flags 0x{flags:02x}")
    if header_len > limits.max_header_bytes:
        raise WireError(
            f"header: {header_len} bytes declared, max_header_bytes is {limits.max_header_bytes}"
        )
    end = PREFIX.size + header_len
    if end > size:
        raise WireError(f"header: {header_len} bytes declared, only {size - PREFIX.size} in frame")
    header = view[PREFIX.size : end]
    if flags & HEADER_ZSTD:
        return _decompress(header, limits), view[end:]
    return header, view[end:]


def _decompress(packed: memoryview, limits: WireLimits) -> bytes:
    """Inflate a zstd header whose frame declares a content size within ``max_header_bytes``.

    zstd allocates the declared content size up front (it ignores ``max_output_size`` then),
    so the declaration is bounded before anything is decompressed; frames that do not declare
    a size are refused rather than streamed.
    """
    cap = limits.max_header_bytes
    try:
        declared = zstandard.frame_content_size(packed)
    except zstandard.ZstdError as exc:
        raise WireError(f"header: not a zstd frame ({exc})") from exc
    if declared < 0:
        raise WireError("header: compressed header does not declare its size")
    if declared > cap:
        raise WireError(
            f"header: declares {declared} bytes decompressed, max_header_bytes is {cap}"
        )
    # zstd's window is a power of two in [1 KiB, 2 GiB]; a header never needs more than cap.
    window = min(1 << 31, max(1 << 10, 1 << (cap - 1).bit_length()))
    try:
        out: bytes = zstandard.ZstdDecompressor(max_window_size=window).decompress(
            packed, max_output_size=cap, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise WireError(f"header: zstd failed ({exc})") from exc
    if len(out) != declared:
        raise WireError(f"header: declared {declared} bytes, inflated to {len(out)}")
    return out


def _unpack(header: bytes | memoryview, reader: PayloadReader, limits: WireLimits) -> Any:
    try:
        return msgpack.unpackb(
            header,
            ext_hook=reader,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes,
            max_array_len=limits.max_items,
            max_map_len=_MAX_MAP_LEN,
            max_ext_len=limits.max_header_bytes,
        )
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"header: malformed msgpack ({type(exc).__name__}: {exc})") from exc


def _structure(tree: Any) -> Message:
    if type(tree) is not dict:
        raise WireError(f"header: expected a map, got {type(tree).__name__}")
    tag = tree.get(TAG)
    if type(tag) is not str:
        raise WireError(f"header: missing or non-string message tag {TAG!r}")
    if tag not in TAGS:
        raise WireError(f"header: unknown message tag {tag[:64]!r}")
    try:
        msg: Message = converter().structure(tree, cast(Any, Message))
    except Exception as exc:
        raise WireError(f"header: {tag}: {explain(exc)}") from exc
    return msg
