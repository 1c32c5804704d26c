"""Hard caps applied to every frame, checked before anything is allocated.

The defaults fit one hidden-state chunk of a mid-size model (64 MiB) and headers full of token
ids; a transport's own message cap (e.g. trio-websocket's ``max_message_size``) must be at
least ``max_frame_bytes`` plus the sealer's overhead.
"""

from __future__ import annotations

import attrs

MiB = 1 << 20

#: Every integer on the wire fits a signed 64-bit slot (what torch and the receiver assume).
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def _positive(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"WireLimits.{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class WireLimits:
    """Maximum sizes a frame may have; both ``encode`` and ``decode`` enforce them.

    ``max_header_bytes`` bounds the header both as sent and after decompression (so a small
    compressed header cannot expand past it); ``max_items`` bounds every sequence field (ids,
    drafts, hops), which also bounds the work done per frame.
    """

    max_frame_bytes: int = attrs.field(default=64 * MiB, validator=_positive)
    max_header_bytes: int = attrs.field(default=1 * MiB, validator=_positive)
    max_tensor_bytes: int = attrs.field(default=64 * MiB, validator=_positive)
    max_dims: int = attrs.field(default=8, validator=_positive)
    max_items: int = attrs.field(default=65_536, validator=_positive)
