"""Weight-fetch messages: a joining node asks a seeder for manifest chunks."""

from __future__ import annotations

import attrs

from shard.messages.values import Tensor


@attrs.frozen
class ChunkRequest:
    """Fetcher -> seeder: send chunk ``index`` of ``file`` of the manifest whose root is ``root``.

    One request, one answer (``ChunkData`` or ``ChunkMissing``), in order, per connection.
    """

    root: str
    file: str
    index: int


@attrs.frozen
class ChunkData:
    """Seeder -> fetcher: the chunk's bytes (a ``uint8`` tensor of shape ``(len,)``).

    Untrusted until the fetcher has checked it against the signed manifest's chunk hash.
    """

    root: str
    file: str
    index: int
    data: Tensor


@attrs.frozen
class ChunkMissing:
    """Seeder -> fetcher: this seeder cannot serve that chunk (``reason`` says why)."""

    root: str
    file: str
    index: int
    reason: str
