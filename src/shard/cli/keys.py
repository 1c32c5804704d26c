"""``shard keygen``, ``shard admit``, ``shard receipt verify`` and ``shard api-key``: keys,
admission, receipts, and the HTTP API's bearer keys."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def keygen(args: argparse.Namespace) -> int:
    from shard.trust.compose import keygen

    return keygen(Path(args.out))


def admit(args: argparse.Namespace) -> int:
    from shard.trust.compose import admit

    try:
        return admit(
            authority=Path(args.authority),
            node_pub=args.node_pub,
            swarm=args.swarm,
            roles=args.roles,
            expires=args.expires,
            out=Path(args.out),
            serial=args.serial,
        )
    except ValueError as exc:
        print(f"shard admit: error: {exc}", file=sys.stderr)
        return 2


def receipt(args: argparse.Namespace) -> int:
    from shard.trust.receipts import ReceiptInvalid, RunReceipt, verify_run

    try:
        receipt = RunReceipt.from_json(Path(args.file).read_text())
        verify_run(receipt)
    except (OSError, ReceiptInvalid) as exc:
        print(f"shard: receipt INVALID: {args.file}: {exc}", file=sys.stderr)
        return 1
    stages = ", ".join(f"{s.node}[{s.first},{s.last})" for s in receipt.stages)
    print(
        f"receipt OK: job {receipt.job}, {len(receipt.output_ids)} tokens, "
        f"{receipt.n_layers} layers over {stages}; coordinator {receipt.coordinator} "
        f"ed25519:{receipt.coordinator_key[:16]}"
    )
    return 0


def api_key(args: argparse.Namespace) -> int:
    """Make an HTTP API key: its hash goes into the keys file, the key itself to stdout once."""
    from shard.api.keys import add_key

    key = add_key(Path(args.keys), args.label or "")
    print(key)
    print(
        f"shard api-key: added its hash to {args.keys}; the key is shown only now "
        "(clients send it as Authorization: Bearer KEY)",
        file=sys.stderr,
    )
    return 0
