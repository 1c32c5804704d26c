"""``shard keygen``, ``shard admit`` and ``shard receipt verify``: keys, admission, receipts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def keygen(args: argparse.Namespace) -> int:
    from shard.trust.compose import keygen

    out = Path(args.out)
    _make_parent(out)
    return keygen(out)


def _make_parent(out: Path) -> None:
    """Create ``out``'s missing folders (``keys/`` in ``--out keys/s0.key``), private: they
    hold secret keys. An existing folder is left as it is.

    Errors: ``InputError`` when a folder cannot be created."""
    from shard.cli.errors import InputError

    try:
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out.parent}: cannot create the folder: {exc.strerror}") from None


def admit(args: argparse.Namespace) -> int:
    from shard.trust.compose import admit

    _make_parent(Path(args.out))
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
