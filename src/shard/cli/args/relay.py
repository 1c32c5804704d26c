"""``shard relay``'s arguments (run by ``shard.cli.relay``), added when it parses: their
defaults live in ``shard.transport``, which ``shard --help`` does not import."""

from __future__ import annotations

import argparse

from shard.cli.args.base import Parser


def add_relay(sub: argparse._SubParsersAction[Parser]) -> None:
    relay = sub.add_parser(
        "relay",
        help="a delaying TCP relay that emulates a WAN link",
        description="Forward TCP from --listen to --target, adding one-way latency each way.",
    )
    relay.strict, relay.populate = True, _relay_args


def _relay_args(relay: Parser) -> None:
    """Added when ``shard relay`` parses: its defaults live in ``shard.transport``."""
    from shard.transport.relay import MAX_BUFFERED_BYTES, MAX_CONNECTIONS

    relay.add_argument("--listen", required=True, help="host:port to accept on (port 0: any)")
    relay.add_argument("--target", required=True, help="host:port to forward to")
    relay.add_argument("--latency-ms", type=float, required=True, help="one-way delay, ms")
    relay.add_argument(
        "--bandwidth-mbps", type=float, default=0.0, help="cap per direction, Mbit/s (0: none)"
    )
    relay.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help=f"connections relayed at once; more are closed at once (default {MAX_CONNECTIONS})",
    )
    relay.add_argument(
        "--max-buffer-mib",
        type=int,
        default=MAX_BUFFERED_BYTES >> 20,
        help="MiB held in flight by all connections together, shared out per direction; a "
        f"direction whose share is spent stops reading (default {MAX_BUFFERED_BYTES >> 20})",
    )
