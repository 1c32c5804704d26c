"""``shard relay``: run one ``DelayRelay`` (``shard.transport.relay``) until Ctrl-C, SIGTERM or
SIGHUP (then 0); 1 on a bind error, 2 on bad limits. The arguments are declared in
``shard.cli.args.relay``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import trio

from shard.transport.base import ListenError
from shard.transport.relay import DelayRelay

__all__ = ["relay", "relay_main"]


def relay(args: argparse.Namespace) -> int:
    """Run the relay ``args`` describe until a signal asks it to stop.

    Prints one status line once listening:
    ``relay listening=HOST:PORT target=HOST:PORT latency_ms=X bandwidth_mbps=Y``.
    """
    try:
        delay = DelayRelay(
            args.listen,
            args.target,
            latency_s=args.latency_ms / 1000,
            bandwidth_bps=args.bandwidth_mbps * 1e6,
            max_connections=args.max_connections,
            max_buffered_bytes=args.max_buffer_mib << 20,
        )
    except ValueError as exc:
        print(f"shard relay: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        # SIGINT too when started in the background (`shard relay ... &` ignores it): a
        # signal sent on purpose is a request to stop, whatever the shell decided for Ctrl-C.
        stop = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        with trio.open_signal_receiver(*stop) as signals:
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(delay.run)
                print(
                    f"relay listening={bound} target={args.target} "
                    f"latency_ms={args.latency_ms:g} bandwidth_mbps={args.bandwidth_mbps:g}",
                    flush=True,
                )
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    status = 0
    try:
        trio.run(main)
    except* KeyboardInterrupt:
        pass
    except* ListenError as group:
        print(f"shard relay: error: {group.exceptions[0]}", file=sys.stderr)
        status = 1
    return status


def relay_main(argv: Sequence[str]) -> int:
    """``shard relay ARGV``, parsed by the command table: what ``shard relay`` returns."""
    from shard.cli import main

    return main(["relay", *argv])
