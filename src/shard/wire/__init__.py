"""shard.wire: the one frame format for messages that leave a process.

A frame is a 6-byte prefix (version, flags, header length), a msgpack header holding the
message as a cattrs tagged union (zstd-compressed when that pays), then the raw bytes of any
tensors, described in the header by dtype, shape and length only. ``docs/wire.md`` gives the
byte layout.

    errors.py    WireError: the only exception a malformed frame raises
    limits.py    WireLimits: the hard caps, checked before allocation
    convert.py   the one strict cattrs converter and the tag table
    tensors.py   tensor descriptors in the header, payloads after it
    checks.py    value rules shared by encode and decode
    frame.py     encode / decode
    seal.py      Sealer, the seam for per-connection encryption; PlainSealer

Light on purpose: msgpack, zstandard, attrs and cattrs only, never torch.
"""

from shard.wire.convert import converter
from shard.wire.errors import WireError
from shard.wire.frame import WIRE_VERSION, decode, encode
from shard.wire.limits import WireLimits
from shard.wire.seal import PlainSealer, Sealer

__all__ = [
    "WIRE_VERSION",
    "PlainSealer",
    "Sealer",
    "WireError",
    "WireLimits",
    "converter",
    "decode",
    "encode",
]
