"""Test-only entry point: ``python -m shard.testing.nat_node MODE [shard args...]`` runs
``shard ARGS`` with the relay role held by a ``TamperingHub`` (``shard.testing.nat``): MODE
``tamper`` flips one bit of the first relayed record of at least ``MIN_BYTES`` bytes after the
handshake and Hello (a ring frame carrying activations); ``watch`` changes nothing and only
logs when it carries a plaintext wire frame. There is no production flag for this: the seam
is the hub class ``shard.nodes.compose`` builds, patched here only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

import shard.nodes.compose as compose
from shard.cli import main
from shard.testing.nat import TamperingHub

#: Message 3 of a direction is the first after the two handshake messages and Hello.
AT = 3
#: Larger than any control frame (a sealed heartbeat is ~50 bytes): an activation chunk.
MIN_BYTES = 300


def _run(mode: str, argv: Sequence[str]) -> int:
    times = {"tamper": 1, "watch": 0}[mode]
    compose.RelayHub = partial(TamperingHub, at=AT, min_bytes=MIN_BYTES, times=times)  # type: ignore[attr-defined,assignment]
    return main(list(argv))


if __name__ == "__main__":
    raise SystemExit(_run(sys.argv[1], sys.argv[2:]))
